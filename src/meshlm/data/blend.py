"""--data-path parsing (``A``, ``A B`` with equal weights, or ``0.7 A 0.3 B``) and blending.

Blending follows Megatron-core's BlendedDataset: each dataset is asked for a share of the samples
with a 0.5 % surplus, and a greedy rule interleaves them so every prefix of the blend keeps the
weights as closely as integers allow.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, DataError

SURPLUS = 0.005


def normalize(weights) -> list:
    """Weights divided by their sum in float64, bit for bit as megatron-core's
    ``datasets.utils.normalize`` (the greedy blend below and --split's rounded bounds turn on the
    last bit: "0.3 A 0.3 B 0.4 C" scaled by the largest weight first picked another dataset at
    sample 10). Weights whose sum overflows (1e308,1e308) are scaled by the largest first."""
    w = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):
        total = np.sum(w)
    if not np.isfinite(total):
        w = w / w.max()
        total = np.sum(w)
    return (w / total).tolist()


def is_number(token: str) -> bool:
    """Whether a --data-path token reads as a weight (a float, as Megatron's get_blend_from_list)."""
    try:
        float(token)
        return True
    except ValueError:
        return False


def parse_data_path(tokens: list, flag: str = "--data-path") -> list:
    """Return [(weight, prefix), ...] with weights normalised to sum 1; prefixes without weights
    get equal weights.

    Raises ConfigError naming ``flag`` (where the tokens came from) when weights and prefixes do
    not alternate or a weight is not a finite positive number (``nan``/``inf``/``1e400`` parse as
    floats but leave no share to sample by).
    """
    if not tokens:
        return []
    if not is_number(tokens[0]):
        if any(is_number(t) for t in tokens):
            raise ConfigError(f"{flag} {' '.join(tokens)}: give either all prefixes or weight/prefix pairs")
        return [(1.0 / len(tokens), t) for t in tokens]
    if len(tokens) % 2:
        raise ConfigError(f"{flag} {' '.join(tokens)}: weights and prefixes must alternate "
                          f"(e.g. 0.7 A 0.3 B)")
    pairs = []
    for w, prefix in zip(tokens[::2], tokens[1::2]):
        if not is_number(w) or not 0 < float(w) < math.inf or is_number(prefix):
            raise ConfigError(f"{flag}: expected a finite positive weight then a prefix, got {w!r} {prefix!r}")
        pairs.append((float(w), prefix))
    return list(zip(normalize([w for w, _ in pairs]), [prefix for _, prefix in pairs]))


def samples_per_dataset(weights, num_samples: int, surplus: float = 0.0) -> list:
    """Samples to take from each blended dataset: ceil(ceil(n · w_i) · (1 + surplus)).

    Megatron-core blends sum_i ceil(n · w_i) samples (surplus 0) and builds each dataset with a
    0.5 % surplus (:data:`SURPLUS`) so the greedy choice below never runs one dry.
    """
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus))) for w in weights]


def build_blending_indices(weights, size: int):
    """Megatron's greedy blending: for each global sample s pick the dataset i maximising
    w_i · max(s, 1) − count_i (the first maximum wins), take that dataset's next sample.

    Returns (dataset_index int16 [size], dataset_sample_index int64 [size]).
    """
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for s in range(size):
        x = max(float(s), 1.0)
        best, best_err = 0, weights[0] * x - counts[0]
        for i in range(1, len(weights)):
            err = weights[i] * x - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """``size`` samples drawn from several datasets in proportion to ``weights``.

    datasets: objects with ``len()`` and ``ds[i]``; names: how each is named in errors (its
    prefix), after ``flag`` (the flag that named it). Raises DataError when a dataset cannot supply
    its share.
    """

    def __init__(self, datasets, weights, size: int, names, flag: str = "--data-path"):
        self.datasets = list(datasets)
        self.weights = normalize(weights)  # again, as megatron-core's BlendedDataset does
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        for i, (ds, name) in enumerate(zip(self.datasets, names)):
            chosen = self.dataset_sample_index[self.dataset_index == i]
            need = int(chosen.max()) + 1 if chosen.size else 0
            if need > len(ds):
                raise DataError(f"{flag} {name}: its weight {self.weights[i]:.3g} asks for {need} samples "
                                f"but it holds {len(ds)}; lower its weight or add data")

    def __len__(self) -> int:
        return self.dataset_index.size

    def __getitem__(self, i: int):
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]
