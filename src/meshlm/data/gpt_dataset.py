"""GPT pretraining samples from indexed datasets, with Megatron-core's indices and splits.

A sample is ``seq_length + 1`` consecutive tokens of the shuffled document stream (tokens =
x[:-1], labels = x[1:]); consecutive samples share one token. Three indices, built once per
(dataset, split, sample count, seed, sequence length; the dataset also by a sample of its document
lengths, ``lengths_fingerprint``) and cached as .npy files (MEGATRON_FORMATS.md):

- document_index int32: the split's documents repeated for enough epochs, shuffled;
- sample_index [M + 1, 2]: (position in document_index, token offset) where each sample starts;
- shuffle_index: a permutation of the M samples.

Built from the same files, seed and sizes they equal megatron-core 0.16.1's GPTDataset indices, so a
run draws the same samples in the same order as Megatron-LM.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket

import numpy as np
import torch

from ..config import global_batch, run_iterations, run_samples
from ..errors import ConfigError, DataError
from ..parallel.agree import first_problem
from .blend import SURPLUS, BlendedDataset, normalize, samples_per_dataset
from .indexed import IndexedDataset
from .packing import Packing
from .sources import blends, per_split, split_string, weighted
from .tokenizer import build_tokenizer

SPLITS = ("train", "valid", "test")
EXTRA = 1  # the one extra token per sample, so tokens and labels both have seq_length ids
SEPARATE_EPOCH_THRESHOLD = 0.80  # a final epoch that contributes < 80 % of an epoch is shuffled apart


def split_weights(split: str) -> list:
    """``--split "969,30,1"`` → three weights normalised to sum 1 (missing ones are 0). Commas,
    slashes or spaces separate them; quotes around the whole are dropped (Megatron's Llama 3 8B
    FP8 example passes ``'99,1,0'``, quotes included, which Megatron reads as its numbers).

    ConfigError says what is wrong: not numbers, more than three, a negative or non-finite
    weight, or every weight 0.
    """
    text = split.strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    try:
        w = [float(x) for x in text.replace("/", " ").replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--split {split!r} is not a list of numbers; give up to three weights "
                          f"train,valid,test, e.g. 969,30,1") from None
    if not 1 <= len(w) <= 3:
        raise ConfigError(f"--split {split!r} has {len(w)} weights; give one to three (train,valid,test), "
                          f"e.g. 969,30,1")
    if not all(0 <= x < math.inf for x in w):
        raise ConfigError(f"--split {split!r} has a negative or non-finite weight; give finite weights "
                          f"≥ 0, e.g. 969,30,1")
    if sum(w) == 0:
        raise ConfigError(f"--split {split!r} gives every split weight 0, so the training set gets no data; "
                          f"make the first (train) weight positive, e.g. 969,30,1")
    return normalize(w + [0.0] * (3 - len(w)))


def split_ranges(split: str, num_sequences: int) -> list:
    """Half-open sequence ranges [round(lo·N), round(hi·N)) for train, valid, test; None where the
    weight is 0. lo/hi are the running sums of the normalised weights (Megatron's bookends)."""
    bounds = [0.0]
    for w in split_weights(split):
        bounds.append(bounds[-1] + w)
    return [None if hi <= lo else (int(round(lo * num_sequences)), int(round(hi * num_sequences)))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def num_samples_per_split(cfg, world_size: int) -> list:
    """Samples each split must supply (Megatron's counts): the samples the run's steps take, at
    least --train-samples (``config.run_samples``);
    (train_iters // eval_interval + 1)·eval_iters·B; eval_iters·B, with B the global batch (after
    any ramp) and train_iters the run's steps (``config.run_iterations``)."""
    t, b, iters = cfg.training, global_batch(cfg, world_size), run_iterations(cfg, world_size)
    return [run_samples(cfg, world_size), (iters // t.eval_interval + 1) * t.eval_iters * b, t.eval_iters * b]


def build_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int,
                  seq_length: int, seed: int):
    """Megatron's (document_index, sample_index, shuffle_index) for ``num_samples`` samples of
    ``seq_length`` (+1) tokens drawn from ``documents`` (sequence ids) of an indexed dataset.

    Raises ValueError if the documents hold no tokens.
    """
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the documents hold no tokens")
    need = num_samples * seq_length + EXTRA
    epochs = max(1, -(-need // tokens_per_epoch))
    separate_last = False
    if epochs > 1:
        sans_last = ((epochs - 1) * tokens_per_epoch - EXTRA) // seq_length
        per_epoch = (tokens_per_epoch - EXTRA) // seq_length
        separate_last = (num_samples - sans_last) < int(SEPARATE_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)

    def shuffled_epochs(n):
        index = np.tile(np.asarray(documents, dtype=np.int32), n)
        rng.shuffle(index)
        return index

    if separate_last:
        document_index = np.concatenate([shuffled_epochs(epochs - 1), shuffled_epochs(1)])
    else:
        document_index = shuffled_epochs(epochs)

    # Sample j starts at stream position j·S. Row j (j ≥ 1) is the document holding the last token
    # sample j−1 needs (position j·S + E − 1), with the offset of position j·S inside it.
    total = (epochs * tokens_per_epoch - EXTRA) // seq_length
    starts = np.zeros(document_index.size + 1, dtype=np.int64)
    np.cumsum(sequence_lengths[document_index], dtype=np.int64, out=starts[1:])
    pos = np.arange(1, total + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts, pos + EXTRA - 1, side="right") - 1
    big = max(document_index.size, int(sequence_lengths.max())) > np.iinfo(np.int32).max
    sample_index = np.zeros((total + 1, 2), dtype=np.int64 if big else np.int32)
    sample_index[1:, 0] = doc
    sample_index[1:, 1] = pos - starts[doc]

    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = sans_last if separate_last else total
    shuffle_index = np.arange(first, dtype=dtype)
    rng.shuffle(shuffle_index)
    if separate_last:
        rest = np.arange(first, total, dtype=dtype)
        rng.shuffle(rest)
        shuffle_index = np.concatenate([shuffle_index, rest])
    return document_index, sample_index, shuffle_index


def _item(x: np.ndarray, seq_length: int, packing: Packing | None = None) -> dict:
    """Sample dict from up to seq_length + 1 ids; padding (id 0) gets loss mask 0; ``packing``
    adds EOD masking, position ids and document ids (data/packing.py)."""
    n = x.size
    buf = np.zeros(seq_length + EXTRA, dtype=np.int64)
    buf[:n] = x
    mask = np.zeros(seq_length, dtype=np.float32)
    mask[:max(n - 1, 0)] = 1.0
    text = torch.from_numpy(buf)
    item = {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.from_numpy(mask)}
    return packing.apply(item) if packing else item


def documents(begin: int, end: int, total: int) -> str:
    """A split's range in words: --split divides the .idx's sequences (as Megatron's GPTDataset
    does), which are its documents unless it was preprocessed with --split-sentences."""
    return f"documents [{begin}, {end}) of {total}; sentences if preprocessed with --split-sentences"


DESCRIPTION = "-description.txt"  # the last file of a cache entry written (GPTDataset._save)


def holds_index_cache(folder: str | None) -> bool:
    """Whether ``folder`` holds sample indices of some GPTDataset (read-only, it still serves them)."""
    return bool(folder) and os.path.isdir(folder) and any(n.endswith(DESCRIPTION) for n in os.listdir(folder))


FINGERPRINT_DOCUMENTS = 65_537  # documents whose lengths key the index cache (evenly spaced, both ends)


def lengths_fingerprint(indexed) -> str:
    """md5 of the token counts of up to ``FINGERPRINT_DOCUMENTS`` evenly spaced documents: the same
    path, document count and token total after preprocessing again with other documents (Megatron's key)
    reused indices built for the old lengths, silently; a few hundred kB read, whatever the size."""
    n = len(indexed)
    picks = np.linspace(0, n - 1, num=min(n, FINGERPRINT_DOCUMENTS)).round().astype(np.int64) if n else []
    sample = np.ascontiguousarray(indexed.sequence_lengths[picks], dtype=np.int32)
    return hashlib.md5(sample.tobytes(), usedforsecurity=False).hexdigest()


class GPTDataset:
    """``num_samples`` (at least; len() is every whole sample of the epochs used) GPT samples from
    sequences [begin, end) of an indexed dataset.

    ``ds[i]`` → {"tokens": int64 [s], "labels": int64 [s], "loss_mask": float32 [s]}, plus
    "position_ids" / "document_ids" int64 [s] under ``packing`` (data/packing.py).
    Indices are read from / written to ``cache_dir`` (default ``<data dir>/cache/GPTDataset_indices``)
    under an md5 of :attr:`description`. Global rank 0 builds them first (as in Megatron); then the
    leader (local rank 0) of every node that does not see them — its cache folder is on a file
    system of its own, or a --data-cache-path of its own — builds the same files; the other ranks
    wait for both steps and load. Collective when torch.distributed is initialised; ``local_rank`` is
    this process's rank on its node (the caller's: parallel/mesh.py ``local_rank``).
    Raises DataError (on every rank alike) if the range holds no tokens or a cache folder is not
    writable.
    """

    def __init__(self, indexed: IndexedDataset, split: str, doc_range: tuple, num_samples: int,
                 seq_length: int, seed: int, split_string: str = "", cache_dir: str | None = None,
                 tokenizer_identity: str = "", packing: Packing | None = None, local_rank: int = 0):
        self.indexed, self.seq_length, self.split, self.packing = indexed, seq_length, split, packing
        begin, end = doc_range
        self.description = json.dumps({
            "class": "GPTDataset", "dataset_path": indexed.prefix, "num_sequences": len(indexed),
            "num_tokens": indexed.num_tokens, "split": split_string, "index_split": split,
            "documents": [begin, end], "num_samples": num_samples, "random_seed": seed,
            "sequence_length": seq_length, "add_extra_token_to_sequence": EXTRA,
            "tokenizer": tokenizer_identity, "document_lengths": lengths_fingerprint(indexed)}, indent=2)
        digest = hashlib.md5(self.description.encode(), usedforsecurity=False).hexdigest()
        cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)),
                                              "cache", "GPTDataset_indices")
        base = os.path.join(cache_dir, f"{digest}-GPTDataset-{split}")
        paths = [f"{base}-{name}.npy" for name in ("document_index", "sample_index", "shuffle_index")]
        desc_path = base + DESCRIPTION
        if not indexed.sequence_lengths[begin:end].any():  # checked on every rank: no one waits in vain
            raise DataError(f"--data-path {indexed.prefix}: the {split} split ({documents(begin, end, len(indexed))}) "
                            f"holds no tokens; change --split {split_string} or add documents")
        distributed = torch.distributed.is_initialized()
        rank0 = not distributed or torch.distributed.get_rank() == 0
        self.cache_hit = all(os.path.isfile(p) for p in paths + [desc_path])
        if distributed:  # every rank has looked before rank 0 builds: cache_hit is what was there before
            first_problem(None)

        def build():
            arrays = build_indices(indexed.sequence_lengths, np.arange(begin, end), num_samples, seq_length, seed)
            return self._save(cache_dir, paths, arrays, desc_path)
        problem = build() if rank0 and not self.cache_hit else None
        if distributed:
            problem = first_problem(problem)
            if problem is None and not rank0 and local_rank == 0 and \
                    not all(os.path.isfile(p) for p in paths + [desc_path]):
                problem = build()  # this node does not see rank 0's files
            problem = first_problem(problem)
        if problem:
            raise DataError(problem)
        self.document_index, self.sample_index, self.shuffle_index = (np.load(p, mmap_mode="r") for p in paths)

    def _save(self, cache_dir, paths, arrays, desc_path) -> str | None:
        """Write the index files (each atomically, through a file of this process's own, so that
        processes building the same cache at once, e.g. a sweep's trials, do not collide); None, or
        the problem as one line."""
        tmp = f".{os.getpid()}.tmp"
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for path, arr in zip(paths, arrays):
                with open(path + tmp, "wb") as f:
                    np.save(f, arr)
                os.replace(path + tmp, path)
            with open(desc_path + tmp, "w") as f:
                f.write(self.description)
            os.replace(desc_path + tmp, desc_path)
        except OSError as e:
            return (f"--data-cache-path {cache_dir}: cannot write the sample indices ({e.strerror}) on "
                    f"{socket.gethostname()}; point --data-cache-path at a writable folder")
        return None

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens(self, i: int) -> np.ndarray:
        """The seq_length + 1 ids of sample i (after shuffling), across document boundaries."""
        j = int(self.shuffle_index[i])
        (k0, o0), (k1, o1) = self.sample_index[j], self.sample_index[j + 1]
        k0, o0, k1, o1 = int(k0), int(o0), int(k1), int(o1)
        get, docs = self.indexed.get, self.document_index
        if k0 == k1:
            return get(int(docs[k0]), o0, o1 - o0 + EXTRA).astype(np.int64)
        parts = [get(int(docs[k0]), o0)]
        parts += [get(int(docs[k])) for k in range(k0 + 1, k1)]
        parts.append(get(int(docs[k1]), 0, o1 + EXTRA))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict:
        return _item(self.tokens(i), self.seq_length, self.packing)


class MockGPTDataset:
    """``--mock-data``: ``num_samples`` samples of uniform random ids in [0, vocab_size).

    Sample i depends only on (seed, split, i): the same on every rank and layout.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str = "train",
                 packing: Packing | None = None):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.packing = packing
        self.seed, self.split_id = seed, SPLITS.index(split)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, self.split_id, i])
        return _item(rng.integers(0, self.vocab_size, self.seq_length + EXTRA), self.seq_length, self.packing)


def _has_tokens(indexed: IndexedDataset, doc_range) -> bool:
    return doc_range is not None and bool(indexed.sequence_lengths[doc_range[0]:doc_range[1]].any())


def suggest_split(split: str, indexed: list, needed: list) -> str | None:
    """A ``--split`` in sequence counts of the first dataset: ``split``'s ranges with one sequence
    moved from the largest split into train and valid where ``needed`` and empty. None when even
    that leaves the needed train/valid split of some dataset without tokens."""
    counts = [0 if r is None else r[1] - r[0] for r in split_ranges(split, len(indexed[0]))]
    for s in (0, 1):
        if needed[s] and not counts[s]:
            counts[int(np.argmax(counts))] -= 1
            counts[s] = 1
    candidate = ",".join(str(c) for c in counts)
    ok = min(counts) >= 0 and all(_has_tokens(ds, r) for ds in indexed
                                  for r, need in zip(split_ranges(candidate, len(ds))[:2], needed) if need)
    return candidate if ok else None


def _drop_empty_splits(split: str, indexed: list, ranges: list, needed: list) -> list:
    """Which splits to build. Train (and valid while evaluating) must hold tokens in every dataset,
    else DataError naming --split; an empty test split is not built (one note on rank 0)."""
    build = list(needed)
    for s, name in enumerate(SPLITS):
        empty = [k for k, ds in enumerate(indexed) if needed[s] and not _has_tokens(ds, ranges[k][s])]
        if not empty:
            continue
        ds, (lo, hi) = indexed[empty[0]], ranges[empty[0]][s]
        where = (f"--data-path {ds.prefix}: --split {split} leaves the {name} split "
                 f"({documents(lo, hi, len(ds))})")
        if name == "test":
            build[s] = False
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print(f"note: {where} without tokens; no test split is built (training never reads it)")
            continue
        fix = suggest_split(split, indexed, needed)
        why = " (--eval-iters > 0 evaluates on it)" if name == "valid" else ""
        raise DataError(f"{where} without tokens{why}; "
                        + (f"use e.g. --split {fix}" if fix else "add documents to the dataset")
                        + (" or --eval-iters 0" if name == "valid" else ""))
    return build


def _one_split(blend: list, flag: str, n: int, dataset_of, blended: bool = False):
    """One split's dataset of ``n`` samples: ``dataset_of(k, n)`` for a single prefix unless
    ``blended`` (Megatron blends one weighted --data-path prefix too), else a BlendedDataset over
    ``dataset_of(k, m_k)``, m_k each prefix's share with Megatron's surplus."""
    if len(blend) == 1 and not blended:
        return dataset_of(0, n)
    w = [wt for wt, _ in blend]
    parts = [dataset_of(k, m) for k, m in enumerate(samples_per_dataset(w, n, SURPLUS))]
    return BlendedDataset(parts, w, sum(samples_per_dataset(w, n)), [p for _, p in blend], flag)


def build_datasets(cfg, world_size: int | None = None, ps=None, local_rank: int = 0) -> tuple:
    """(train, valid, test) datasets for ``cfg``; None for a split the run does not need: weight 0,
    0 samples (valid and test with --eval-iters 0), a test split that holds no tokens, or (per-split
    data) a split without a blend.

    Sizes follow Megatron (see :func:`num_samples_per_split`), with the global batch for
    ``ps.world_size`` (else ``world_size``, else 1) ranks. --data-path (data/sources.py): one prefix
    gives GPTDatasets over the --split ranges, several give BlendedDatasets over GPTDatasets of each
    prefix. --train/valid/test-data-path: each split's blend likewise, over whole datasets (Megatron's
    blend_per_split). Collective when torch.distributed is initialised (every rank must call it, with
    its rank on its node as ``local_rank``: a node's local rank 0 builds its own index cache).
    Raises ConfigError / DataError on bad flags or files, DataError naming --split when the train
    split (or the valid split, while evaluating) of a dataset holds no tokens, and DataError naming
    the flag when a per-split dataset holds no tokens.
    """
    world = ps.world_size if ps is not None else (world_size or 1)
    sizes = num_samples_per_split(cfg, world)
    d, seq, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    if d.mock_data:
        if not cfg.model.vocab_size:
            raise ConfigError("--mock-data needs --vocab-size")
        tokenizer = build_tokenizer(d, cfg.model.vocab_size)
        packing = Packing.of(d, tokenizer.eod, tokenizer.pad)
        return tuple(MockGPTDataset(n, seq, cfg.model.vocab_size, seed, name, packing) if w > 0 and n > 0 else None
                     for name, w, n in zip(SPLITS, split_weights(split_string(d)), sizes))
    data = blends(d)
    if not data or data[0][1] is None:
        raise ConfigError("no training data: give --data-path PREFIX (from `meshlm preprocess`), "
                          "--train-data-path PREFIX, or --mock-data")
    tokenizer = build_tokenizer(d, cfg.model.vocab_size)
    identity, packing = tokenizer.identity, Packing.of(d, tokenizer.eod, tokenizer.pad)

    def gpt(indexed, s, doc_range, n, split_string=""):
        return GPTDataset(indexed, SPLITS[s], doc_range, n, seq, seed, split_string, d.data_cache_path, identity,
                          packing, local_rank)

    if per_split(d):
        return tuple(None if blend is None or n == 0 else _whole_datasets(blend, flag, s, n, gpt)
                     for s, ((flag, blend), n) in enumerate(zip(data, sizes)))
    (flag, blend), split = data[0], split_string(d)
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    build = _drop_empty_splits(split, indexed, ranges, [w > 0 and n > 0 for w, n in zip(split_weights(split), sizes)])
    return tuple(_one_split(blend, flag, n, lambda k, m: gpt(indexed[k], s, ranges[k][s], m, split), weighted(d))
                 if build[s] else None for s, n in enumerate(sizes))


def _whole_datasets(blend: list, flag: str, s: int, n: int, gpt):
    """Split s from its own blend (per-split data): every sequence of each prefix."""
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    for ds in indexed:
        if not _has_tokens(ds, (0, len(ds))):
            raise DataError(f"{flag} {ds.prefix}: the dataset holds no tokens; give a dataset with documents")
    return _one_split(blend, flag, n, lambda k, m: gpt(indexed[k], s, (0, len(indexed[k])), m))
