"""GPT samples: splits, Megatron's document/sample/shuffle indices, the index cache, build_datasets."""

import os
import types
import warnings

import numpy as np
import pytest

from meshlm.config import Config
from meshlm.data.gpt_dataset import (GPTDataset, MockGPTDataset, build_datasets, build_indices,
                                     num_samples_per_split, split_ranges)
from meshlm.data.indexed import IndexedDataset, IndexedDatasetWriter
from meshlm.errors import ConfigError, DataError

VOCAB, SEQ = 500, 16


def megatron_gpt_dataset() -> tuple:
    """(megatron.core.datasets.gpt_dataset, its IndexedDataset class, its Split enum); the test is
    skipped when megatron-core or its compiled sample-index helpers are not installed."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    mg = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split
    try:
        from megatron.core.datasets import helpers  # noqa: F401  (compiled sample-index builder)
    except ImportError as e:
        pytest.skip(f"megatron-core's compiled dataset helpers are unavailable: {e}")
    return mg, IndexedDataset, Split


def make_dataset(prefix, n_docs=120, seed=0, min_len=1, max_len=40):
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(n_docs):
        writer.add_document(rng.integers(0, VOCAB, rng.integers(min_len, max_len)))
    writer.finalize()
    return IndexedDataset(str(prefix))


def config(data_path, split="90,8,2", train_iters=20, micro=4, eval_interval=10, eval_iters=2):
    cfg = Config()
    cfg.data.data_path, cfg.data.split = list(data_path), split
    cfg.data.tokenizer_type, cfg.model.vocab_size = "NullTokenizer", VOCAB
    cfg.model.seq_length, cfg.training.seed = SEQ, 7
    cfg.training.train_iters, cfg.training.micro_batch_size = train_iters, micro
    cfg.training.eval_interval, cfg.training.eval_iters = eval_interval, eval_iters
    return cfg


def test_split_ranges_are_rounded_cumulative_bounds():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("98,2", 50) == [(0, 49), (49, 50), None]
    assert split_ranges("1", 7) == [(0, 7), None, None]
    assert split_ranges("1/1/1", 10) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(ConfigError, match="--split"):
        split_ranges("a,b", 10)


def test_sample_sizes_follow_megatron():
    cfg = config(["x"], train_iters=25, micro=2, eval_interval=10, eval_iters=3)
    cfg.training.global_batch_size = 8
    assert num_samples_per_split(cfg, world_size=2) == [25 * 8, (25 // 10 + 1) * 3 * 8, 3 * 8]


@pytest.mark.parametrize("num_samples", [5, 150, 400, 1000])
def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path, num_samples):
    ds = make_dataset(tmp_path / "d", min_len=0)  # empty documents included
    docs = np.arange(10, 100)
    doc_idx, sample_idx, shuffle_idx = build_indices(ds.sequence_lengths, docs, num_samples, SEQ, seed=3)
    tokens_per_epoch = int(ds.sequence_lengths[docs].sum())
    epochs = int(np.ceil((num_samples * SEQ + 1) / tokens_per_epoch))
    assert sorted(doc_idx.tolist()) == sorted(docs.tolist() * epochs)
    assert len(shuffle_idx) == (epochs * tokens_per_epoch - 1) // SEQ >= num_samples
    assert sorted(shuffle_idx.tolist()) == list(range(len(shuffle_idx)))
    stream = np.concatenate([ds[int(d)] for d in doc_idx])
    gpt = GPTDataset(ds, "train", (10, 100), num_samples, SEQ, seed=3, cache_dir=str(tmp_path / "c"))
    for i in range(0, len(gpt), max(1, len(gpt) // 50)):
        j = int(shuffle_idx[i])
        window = stream[j * SEQ: j * SEQ + SEQ + 1]
        item = gpt[i]
        assert item["tokens"].tolist() == window[:-1].tolist()
        assert item["labels"].tolist() == window[1:].tolist()
        assert item["loss_mask"].tolist() == [1.0] * SEQ


@pytest.mark.parametrize("num_samples", [10, 300, 700, 2000])
def test_indices_equal_megatron_core(tmp_path, num_samples):
    """700 samples take 3 epochs with a short final epoch: shuffled on its own, as in Megatron."""
    mg, TheirIndexed, Split = megatron_gpt_dataset()
    prefix = tmp_path / "d"
    make_dataset(prefix)
    tok = types.SimpleNamespace(eod=VOCAB - 1, vocab_size=VOCAB, pad=-1, unique_identifiers={"class": "t"})
    cfg = mg.GPTDatasetConfig(random_seed=11, sequence_length=SEQ, blend=([str(prefix)], None), split="969,30,1",
                              tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path / "mc"))
    docs = np.arange(5, 110, dtype=np.int32)
    theirs = mg.GPTDataset(TheirIndexed(str(prefix)), str(prefix), docs, num_samples, Split.train, cfg)
    ours = GPTDataset(IndexedDataset(str(prefix)), "train", (5, 110), num_samples, SEQ, seed=11,
                      cache_dir=str(tmp_path / "c"))
    np.testing.assert_array_equal(ours.document_index, theirs.document_index)
    np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)
    np.testing.assert_array_equal(ours.shuffle_index, theirs.shuffle_index)
    assert ours.sample_index.dtype == theirs.sample_index.dtype
    assert ours.shuffle_index.dtype == theirs.shuffle_index.dtype
    for i in range(0, len(theirs), max(1, len(theirs) // 40)):
        assert ours[i]["tokens"].tolist() == theirs[i]["tokens"].tolist()
        assert ours[i]["labels"].tolist() == theirs[i]["labels"].tolist()


def test_index_cache_is_reused_and_rebuilt_when_parameters_change(tmp_path):
    ds = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    first = GPTDataset(ds, "train", (0, 100), 50, SEQ, seed=1, cache_dir=str(cache))
    files = sorted(os.listdir(cache))
    assert not first.cache_hit and len(files) == 4
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    again = GPTDataset(ds, "train", (0, 100), 50, SEQ, seed=1, cache_dir=str(cache))
    assert again.cache_hit and {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    assert [again[i]["tokens"].tolist() for i in range(5)] == [first[i]["tokens"].tolist() for i in range(5)]
    other = GPTDataset(ds, "train", (0, 100), 50, SEQ, seed=2, cache_dir=str(cache))
    assert not other.cache_hit and len(os.listdir(cache)) == 8
    os.remove(cache / files[0])
    rebuilt = GPTDataset(ds, "train", (0, 100), 50, SEQ, seed=1, cache_dir=str(cache))
    assert not rebuilt.cache_hit
    np.testing.assert_array_equal(rebuilt.shuffle_index, first.shuffle_index)


def test_default_cache_folder_is_beside_the_data(tmp_path):
    ds = make_dataset(tmp_path / "d")
    GPTDataset(ds, "valid", (0, 100), 10, SEQ, seed=1)
    assert len(os.listdir(tmp_path / "cache" / "GPTDataset_indices")) == 4


def test_build_datasets_single_prefix_sizes_and_zero_weight_split(tmp_path):
    make_dataset(tmp_path / "d")
    cfg = config([str(tmp_path / "d")], split="90,10,0", train_iters=20, micro=4)
    train, valid, test = build_datasets(cfg, world_size=2)  # global batch 4 × DP 2 = 8
    assert test is None
    assert len(train) >= 20 * 8 and len(valid) >= (20 // 10 + 1) * 2 * 8
    assert train[0]["tokens"].shape == (SEQ,)
    assert build_datasets(cfg, world_size=2)[0].cache_hit


def test_an_empty_test_split_is_not_built_and_noted_in_one_line(tmp_path, capsys):
    make_dataset(tmp_path / "d", n_docs=292)  # 969,30,1 → test = documents [292, 292)
    train, valid, test = build_datasets(config([str(tmp_path / "d")], split="969,30,1"))
    assert test is None and len(train) > 0 and len(valid) > 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(notes) == 1 and "test split" in notes[0] and "--split 969,30,1" in notes[0]
    assert "the test split (documents [292, 292) of 292;" in notes[0]  # the 292 are documents, not samples


def test_an_empty_valid_split_is_not_built_without_evaluation(tmp_path):
    make_dataset(tmp_path / "d", n_docs=10)  # 969,30,1 → valid = documents [10, 10)
    train, valid, test = build_datasets(config([str(tmp_path / "d")], split="969,30,1", eval_iters=0))
    assert len(train) > 0 and valid is None and test is None


def suggested_split(message):
    return message.split("--split ")[-1].split()[0]


@pytest.mark.parametrize("split, empty", [("969,30,1", "valid"), ("0.001,99,1", "train")])
def test_an_empty_needed_split_names_split_and_suggests_one_that_works(tmp_path, split, empty):
    make_dataset(tmp_path / "d", n_docs=10)
    cfg = config([str(tmp_path / "d")], split=split)
    with pytest.raises(DataError) as err:
        build_datasets(cfg)
    msg = str(err.value)
    assert f"--split {split} leaves the {empty} split" in msg and "\n" not in msg
    cfg.data.split = suggested_split(msg)
    assert cfg.data.split != split
    train, valid, _ = build_datasets(cfg)
    assert len(train) > 0 and len(valid) > 0


def test_an_empty_split_of_one_blended_dataset_names_that_dataset(tmp_path):
    make_dataset(tmp_path / "big", n_docs=300)
    make_dataset(tmp_path / "small", n_docs=10, seed=1)
    cfg = config([str(tmp_path / "big"), str(tmp_path / "small")], split="969,30,1")
    with pytest.raises(DataError, match=r"--data-path \S*small: --split 969,30,1 leaves the valid split"):
        build_datasets(cfg)


def test_build_datasets_without_data_names_the_flags(tmp_path):
    with pytest.raises(ConfigError, match="--data-path"):
        build_datasets(config([]))


def test_mock_data_is_deterministic_and_in_vocabulary():
    a = MockGPTDataset(100, SEQ, VOCAB, seed=5)
    b = MockGPTDataset(100, SEQ, VOCAB, seed=5)
    assert len(a) == 100
    assert a[7]["tokens"].tolist() == b[7]["tokens"].tolist()
    assert a[7]["tokens"].tolist() != a[8]["tokens"].tolist()
    assert a[7]["tokens"][1:].tolist() == a[7]["labels"][:-1].tolist()
    assert 0 <= int(a[3]["tokens"].min()) and int(a[3]["tokens"].max()) < VOCAB
    cfg = config([], split="98,2,0")
    cfg.data.mock_data = True
    train, valid, test = build_datasets(cfg)
    assert len(train) == 20 * 4 and test is None
    assert train[0]["tokens"].tolist() != valid[0]["tokens"].tolist()


def test_index_cache_is_rebuilt_for_a_dataset_preprocessed_again_with_other_document_lengths(tmp_path):
    """The same path, document count and token total, other document lengths (preprocessed again):
    the cached indices of the old lengths were reused, so samples crossed the new documents wrongly."""
    from meshlm.data.indexed import IndexedDatasetWriter
    cache = tmp_path / "cache"

    def write(lengths):
        writer = IndexedDatasetWriter(str(tmp_path / "d"), np.uint16)
        for n in lengths:
            writer.add_document(np.arange(n) % VOCAB)
        writer.finalize()
        return IndexedDataset(str(tmp_path / "d"))

    first = GPTDataset(write([10, 30] * 20), "train", (0, 40), 20, SEQ, seed=1, cache_dir=str(cache))
    again = write([30, 10] * 20)  # 40 documents, 800 tokens, as before
    assert (len(again), again.num_tokens) == (40, 800)
    second = GPTDataset(again, "train", (0, 40), 20, SEQ, seed=1, cache_dir=str(cache))
    assert not first.cache_hit and not second.cache_hit


@pytest.mark.parametrize("split", ["90,5,5", "969,30,1", "7,2,1", "33,33,34", "98,2"])
def test_split_ranges_equal_megatrons_bookends_for_every_size(split):
    """Megatron's rule, written from its definition: weights / their sum (float64), running sums
    as bookends, [round(lo·N), round(hi·N)). Weights scaled by the largest first gave "90,5,5" on
    15 documents a train split of 13 where Megatron's has 14."""
    w = np.asarray([float(x) for x in split.split(",")] + [0.0] * (3 - len(split.split(","))))
    w = (w / np.sum(w)).tolist()
    bounds = [0.0]
    for x in w:
        bounds.append(bounds[-1] + x)
    for n in range(1, 400):
        expected = [None if hi <= lo else (int(round(lo * n)), int(round(hi * n))) for lo, hi in zip(bounds, bounds[1:])]
        assert split_ranges(split, n) == expected, n


def test_a_read_only_data_cache_path_that_holds_the_indices_is_used(tmp_path, monkeypatch):
    """A shared cache built once and mounted read-only: Megatron loads it; meshlm refused it before
    any worker ('--data-cache-path … is not writable'). A read-only cache without indices stays refused."""
    import errno

    from meshlm.validate import validate
    make_dataset(tmp_path / "d")
    cfg = config([str(tmp_path / "d")])
    cfg.data.data_cache_path = str(tmp_path / "cache")
    build_datasets(cfg)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("meshlm.folders.tempfile.mkstemp", read_only)
    validate(cfg, world=1, check_files=False)
    assert all(ds.cache_hit for ds in build_datasets(cfg))
    cfg.data.data_cache_path = str(tmp_path)
    with pytest.raises(ConfigError, match=f"--data-cache-path {tmp_path} is not writable \\(Read-only file system\\)"):
        validate(cfg, world=1, check_files=False)
