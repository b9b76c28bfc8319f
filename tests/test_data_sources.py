"""Per-split data (--train/valid/test-data-path and the args files), as megatron-core builds it."""

import json
import os
import types
import warnings

import numpy as np
import pytest

from meshlm.config import Config
from meshlm.data.gpt_dataset import build_datasets
from meshlm.data.indexed import IndexedDatasetWriter
from meshlm.errors import ConfigError, DataError
from meshlm.validate import validate

VOCAB, SEQ = 500, 16


def write_corpora(folder, sizes=(("a", 200), ("b", 60), ("c", 90))):
    rng = np.random.default_rng(0)
    prefixes = []
    for name, n in sizes:
        writer = IndexedDatasetWriter(os.path.join(folder, name), np.uint16)
        for _ in range(n):
            writer.add_document(rng.integers(0, VOCAB, rng.integers(1 if n else 0, 40)))
        writer.finalize()
        prefixes.append(os.path.join(folder, name))
    return prefixes


def config(**data) -> Config:
    cfg = Config()
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.seed, cfg.training.train_iters, cfg.training.micro_batch_size = 7, 50, 4
    cfg.training.eval_interval, cfg.training.eval_iters = 10, 3
    return cfg


SIZES = [50 * 4, (50 // 10 + 1) * 3 * 4, 3 * 4]  # train_iters·B, (iters // interval + 1)·eval_iters·B, eval_iters·B


def megatron_per_split(blend_per_split):
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    try:
        from megatron.core.datasets import helpers  # noqa: F401  (compiled sample-index builder)
    except ImportError as e:
        pytest.skip(f"megatron-core's compiled dataset helpers are unavailable: {e}")
    tok = types.SimpleNamespace(eod=VOCAB - 1, vocab_size=VOCAB, pad=-1, unique_identifiers={"class": "t"})
    mcfg = GPTDatasetConfig(random_seed=7, sequence_length=SEQ, blend_per_split=blend_per_split, split=None,
                            tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                            eod_mask_loss=False)  # no cache path: megatron then needs no process group
    return builder.BlendedMegatronDatasetBuilder(GPTDataset, SIZES, lambda: True, mcfg).build()


def assert_same_samples(ours, theirs):
    assert len(ours) == len(theirs)
    if hasattr(theirs, "dataset_index"):
        np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
        np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
    else:
        np.testing.assert_array_equal(ours.shuffle_index, theirs.shuffle_index)
        np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)
    for i in range(len(theirs)):
        assert ours[i]["tokens"].tolist() == theirs[i]["tokens"].tolist()


def test_per_split_blends_equal_megatron_core(tmp_path):
    """Train blends two datasets by weight, valid is one dataset, test has none."""
    a, b, c = write_corpora(str(tmp_path))
    cfg = config(train_data_path=["0.3", a, "0.7", b], valid_data_path=[c])
    ours = build_datasets(cfg)
    theirs = megatron_per_split([([a, b], [0.3, 0.7]), ([c], None), None])
    assert ours[2] is None and theirs[2] is None
    for o, t in zip(ours[:2], theirs[:2]):
        assert_same_samples(o, t)


def test_args_files_give_the_same_datasets_as_the_flags(tmp_path):
    a, b, c = write_corpora(str(tmp_path))
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7 {b}\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"0.3 {a} 0.7 {b}", "valid": [c], "test": [b]}))
    by_flag = build_datasets(config(data_path=["0.3", a, "0.7", b], split="90,8,2"))
    by_file = build_datasets(config(data_args_path=str(tmp_path / "blend.txt"), split="90,8,2"))
    for x, y in zip(by_flag, by_file):
        np.testing.assert_array_equal(x.dataset_index, y.dataset_index)
        assert x[5]["tokens"].tolist() == y[5]["tokens"].tolist()
    per_flag = build_datasets(config(train_data_path=["0.3", a, "0.7", b], valid_data_path=[c], test_data_path=[b]))
    per_file = build_datasets(config(per_split_data_args_path=str(tmp_path / "splits.json")))
    for x, y in zip(per_flag, per_file):
        assert len(x) == len(y) and x[3]["tokens"].tolist() == y[3]["tokens"].tolist()


def test_without_valid_data_there_is_no_validation_set(tmp_path):
    a, _, _ = write_corpora(str(tmp_path))
    train, valid, test = build_datasets(config(train_data_path=[a]))
    assert len(train) >= SIZES[0] and valid is None and test is None


def test_a_per_split_dataset_without_tokens_names_its_flag(tmp_path):
    a, empty = write_corpora(str(tmp_path), (("a", 50), ("empty", 0)))
    with pytest.raises(DataError, match=r"^--valid-data-path \S*empty: the dataset holds no tokens"):
        build_datasets(config(train_data_path=[a], valid_data_path=[empty]))


def problems(cfg, check_files=False):
    with pytest.raises(ConfigError) as err:
        validate(cfg, world=1, check_files=check_files)
    return err.value.problems


def test_megatron_rules_on_the_data_flags(tmp_path):
    a, b, _ = write_corpora(str(tmp_path))
    validate(config(train_data_path=[a], valid_data_path=[b]), world=1)
    assert problems(config(data_path=[a], train_data_path=[a])) == [
        "--data-path and --train-data-path are exclusive: give one source of data"]
    assert problems(config(train_data_path=[a], split="90,10,0")) == [
        "--split 90,10,0 with --train-data-path: each split already has its own data (Megatron-LM refuses "
        "this too); drop --split"]
    assert problems(config(valid_data_path=[a], test_data_path=[b])) == [
        "--valid-data-path/--test-data-path without --train-data-path: give the training data too"]
    assert problems(config(mock_data=True, per_split_data_args_path="x.json")) == [
        "--mock-data and --per-split-data-args-path are exclusive: give one source of data"]


def test_bad_args_files_are_one_line_each(tmp_path):
    a, _, _ = write_corpora(str(tmp_path))
    (tmp_path / "no_test.json").write_text(json.dumps({"train": a, "valid": None}))
    (tmp_path / "no_train.json").write_text(json.dumps({"train": None, "valid": a, "test": None}))
    (tmp_path / "bad.txt").write_text(f"0.5 {a} {a}")
    assert problems(config(per_split_data_args_path=str(tmp_path / "no_test.json")), True) == [
        f"--per-split-data-args-path {tmp_path / 'no_test.json'}: no key 'test'; give an object with keys "
        f"\"train\", \"valid\", \"test\" (null for a split without data)"]
    assert problems(config(per_split_data_args_path=str(tmp_path / "no_train.json")), True) == [
        f"--per-split-data-args-path {tmp_path / 'no_train.json'} (train): no training data; give \"train\" "
        f"a dataset"]
    (tmp_path / "typo.json").write_text(json.dumps({"train": a, "validation": a, "valid": None, "test": None}))
    assert problems(config(per_split_data_args_path=str(tmp_path / "typo.json")), True) == [
        f"--per-split-data-args-path {tmp_path / 'typo.json'}: unknown key 'validation'; the keys are \"train\", "
        f"\"valid\", \"test\""]
    assert "weights and prefixes must alternate" in problems(config(data_args_path=str(tmp_path / "bad.txt")),
                                                              True)[0]
    assert problems(config(data_args_path=str(tmp_path / "no_test.json")), True) == [  # one line, not one a word
        f"--data-args-path {tmp_path / 'no_test.json'}: the file is JSON; --data-args-path takes the --data-path "
        f"tokens as plain text (0.7 data/a_text_document 0.3 data/b_text_document), and a JSON file of "
        f"train/valid/test blends is --per-split-data-args-path"]
    missing = problems(config(data_args_path=str(tmp_path / "none.txt")), True)
    assert missing[0].startswith(f"--data-args-path {tmp_path / 'none.txt'}: cannot read it")
    assert problems(config(train_data_path=[a + "x"]), True) == [
        f"--train-data-path: {a}x.bin does not exist (run `meshlm preprocess` to make it)"]  # one line a prefix
