"""Blending several --data-path prefixes by weight, as megatron-core's BlendedDataset does."""

import os
import types
import warnings

import numpy as np
import pytest

from meshlm.config import Config
from meshlm.data.blend import BlendedDataset, build_blending_indices, parse_data_path, samples_per_dataset
from meshlm.data.gpt_dataset import build_datasets
from meshlm.data.indexed import IndexedDatasetWriter
from meshlm.errors import ConfigError, DataError

VOCAB, SEQ = 500, 16


def test_every_prefix_of_the_blend_keeps_the_weights():
    weights = [0.2, 0.5, 0.3]
    which, local = build_blending_indices(weights, 1000)
    counts = np.zeros(3)
    for s, i in enumerate(which):
        assert local[s] == counts[i]  # each dataset's samples are taken in order
        counts[i] += 1
        assert np.all(np.abs(counts - np.array(weights) * (s + 1)) <= 1.0 + 1e-9)
    assert counts.tolist() == [200, 500, 300]


def test_first_choice_breaks_ties_toward_the_first_dataset():
    which, _ = build_blending_indices([0.5, 0.5], 4)
    assert which.tolist() == [0, 1, 0, 1]


def test_blending_indices_equal_megatron_core():
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    try:
        from megatron.core.datasets import helpers
    except ImportError as e:
        pytest.skip(f"megatron-core's compiled dataset helpers are unavailable: {e}")
    weights = [0.13, 0.61, 0.26]
    size = 5000
    their_which = np.zeros(size, dtype=np.int16)
    their_local = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(their_which, their_local, np.array(weights), len(weights), size, False)
    which, local = build_blending_indices(weights, size)
    np.testing.assert_array_equal(which, their_which)
    np.testing.assert_array_equal(local, their_local)


def test_samples_per_dataset_has_a_half_percent_surplus():
    assert samples_per_dataset([0.3, 0.7], 1000) == [300, 700]
    assert samples_per_dataset([0.3, 0.7], 1000, 0.005) == [302, 704]


def test_weighted_data_path_is_normalised():
    assert parse_data_path(["3", "A", "1", "B"]) == [(0.75, "A"), (0.25, "B")]
    assert parse_data_path(["A", "B"]) == [(0.5, "A"), (0.5, "B")]
    assert parse_data_path(["1e308", "A", "1e308", "B"]) == [(0.5, "A"), (0.5, "B")]


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "1e400", "0", "-1"])
def test_a_weight_that_is_not_finite_and_positive_is_refused(weight):
    """`--data-path nan A 1 B` passed validation and ended in a worker's ValueError traceback."""
    with pytest.raises(ConfigError, match=f"--train-data-path: expected a finite positive weight then a prefix, "
                                          f"got '{weight}' 'A'"):
        parse_data_path([weight, "A", "1", "B"], "--train-data-path")


def test_a_dataset_that_cannot_supply_its_share_is_a_data_error():
    small, large = list(range(10)), list(range(1000))
    BlendedDataset([small, large], [0.1, 0.9], 100, ["small", "large"])
    with pytest.raises(DataError, match="--data-path small: .* asks for 50 samples but it holds 10"):
        BlendedDataset([small, large], [0.5, 0.5], 100, ["small", "large"])


def test_blended_items_come_from_the_chosen_dataset_in_order():
    a, b = [f"a{i}" for i in range(100)], [f"b{i}" for i in range(100)]
    blend = BlendedDataset([a, b], [1, 3], 8, ["a", "b"])
    # by hand: s=0 errors (.25, .75) → b; s=1 (.25, -.25) → a; s=4 (0, 0) tie → a; ...
    assert [blend[i] for i in range(8)] == ["b0", "a0", "b1", "b2", "a1", "b3", "b4", "b5"]


def write_corpora(folder):
    rng = np.random.default_rng(0)
    prefixes = []
    for name, n in (("a", 200), ("b", 60)):
        writer = IndexedDatasetWriter(os.path.join(folder, name), np.uint16)
        for _ in range(n):
            writer.add_document(rng.integers(0, VOCAB, rng.integers(1, 40)))
        writer.finalize()
        prefixes.append(os.path.join(folder, name))
    return prefixes


def test_blended_build_datasets_equals_megatron_core(tmp_path):
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    a, b = write_corpora(str(tmp_path))
    cfg = Config()
    cfg.data.data_path, cfg.data.split = ["0.3", a, "0.7", b], "90,8,2"
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.seed, cfg.training.train_iters, cfg.training.micro_batch_size = 7, 50, 4
    cfg.training.eval_interval, cfg.training.eval_iters = 10, 3
    ours = build_datasets(cfg)
    tok = types.SimpleNamespace(eod=VOCAB - 1, vocab_size=VOCAB, pad=-1, unique_identifiers={"class": "t"})
    mcfg = GPTDatasetConfig(random_seed=7, sequence_length=SEQ, blend=([a, b], [0.3, 0.7]), split="90,8,2",
                            tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False)  # no cache path: megatron then needs no process group
    sizes = [50 * 4, (50 // 10 + 1) * 3 * 4, 3 * 4]
    theirs = builder.BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, mcfg).build()
    for o, t in zip(ours, theirs):
        assert len(o) == len(t)
        np.testing.assert_array_equal(o.dataset_index, t.dataset_index)
        np.testing.assert_array_equal(o.dataset_sample_index, t.dataset_sample_index)
        for i in range(len(t)):
            assert o[i]["tokens"].tolist() == t[i]["tokens"].tolist()


def megatron_normalize(weights):
    """megatron-core's datasets.utils.normalize, written from its definition: float64 w / sum(w)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


@pytest.mark.parametrize("raw", [[0.3, 0.3, 0.4], [8.04, 1.43], [0.53, 6.22, 0.27]])
def test_blend_weights_are_normalised_bit_for_bit_as_megatron(raw):
    """Weights scaled by the largest before the sum differed in the last bit, and the greedy blend
    turns on it: "0.3 A 0.3 B 0.4 C" took another dataset than Megatron at sample 10."""
    tokens = [t for i, w in enumerate(raw) for t in (str(w), f"P{i}")]
    weights = [w for w, _ in parse_data_path(tokens)]
    assert weights == megatron_normalize(raw)
    blend = BlendedDataset([range(5000)] * len(raw), weights, 2000, [f"P{i}" for i in range(len(raw))])
    expected, _ = build_blending_indices(megatron_normalize(megatron_normalize(raw)), 2000)
    np.testing.assert_array_equal(blend.dataset_index, expected)


def test_one_weighted_prefix_is_blended_with_the_surplus_as_in_megatron(tmp_path):
    """`--data-path 1.0 A` is a blend in Megatron: A is built for ceil(n · 1.005) samples, here 63 for
    62, which takes a second epoch of its 1,000 tokens (63 · 16 + 1 > 1000). meshlm built A for 62
    samples directly, one epoch, and so drew other samples than Megatron."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    prefix = str(tmp_path / "a")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for k in range(100):
        writer.add_document(np.arange(k, k + 10) % VOCAB)
    writer.finalize()
    cfg = Config()
    cfg.data.data_path, cfg.data.split = ["1.0", prefix], "1"
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.seed, cfg.training.train_iters, cfg.training.micro_batch_size = 3, 31, 2
    cfg.training.eval_iters = 0
    ours = build_datasets(cfg)[0]
    tok = types.SimpleNamespace(eod=VOCAB - 1, vocab_size=VOCAB, pad=-1, unique_identifiers={"class": "t"})
    mcfg = GPTDatasetConfig(random_seed=3, sequence_length=SEQ, blend=([prefix], [1.0]), split="1", tokenizer=tok,
                            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    theirs = builder.BlendedMegatronDatasetBuilder(GPTDataset, [62, 0, 0], lambda: True, mcfg).build()[0]
    assert len(ours) == len(theirs) == 62
    assert [ours[i]["tokens"].tolist() for i in range(62)] == [theirs[i]["tokens"].tolist() for i in range(62)]
