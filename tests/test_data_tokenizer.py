"""Tokenizers by --tokenizer-type, and byte-level BPE training (meshlm tokenizer train)."""

import argparse
import json
import os
from types import SimpleNamespace

import pytest

from meshlm.data.tokenizer import (EOD, add_train_arguments, build_tokenizer, run_train, train_bpe)
from meshlm.errors import ConfigError, DataError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "Tensor parallelism splits each weight matrix across GPUs; pipeline parallelism splits layers.",
    "Unicode survives the round trip: naïve café, Ελληνικά, 日本語, emoji 🚀\ttab\n\nblank lines",
] * 20


def tok_cfg(**kw):
    fields = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_bpe(TEXTS, 320, path)
    return path


def test_trained_bpe_round_trips_any_text(trained):
    tok = build_tokenizer(tok_cfg(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=trained))
    assert tok.vocab_size == 320
    assert tok.decode([tok.eod]) == EOD
    unseen = "Zebra quokka ∑ 🐍 — never in the training text\r\n"
    for text in TEXTS[:4] + [unseen, ""]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges were learned
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]


def test_tokenizer_folder_and_type_inferred_from_model(trained):
    tok = build_tokenizer(tok_cfg(tokenizer_model=os.path.dirname(trained)))
    assert tok.identity.startswith("HF:tokenizer.json:")
    assert tok.decode(tok.encode("x = 1")) == "x = 1"


def test_gpt2_vocab_and_merges_match_the_same_bpe(trained, tmp_path):
    from tokenizers import Tokenizer
    vocab, merges = Tokenizer.from_file(trained).model.save(str(tmp_path))
    hf = build_tokenizer(tok_cfg(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=trained))
    gpt2 = build_tokenizer(tok_cfg(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert gpt2.eod == hf.eod and gpt2.vocab_size == hf.vocab_size
    for text in TEXTS[:4]:
        assert gpt2.encode(text) == hf.encode(text)
        assert gpt2.decode(gpt2.encode(text)) == text


def test_null_tokenizer_reads_ids():
    tok = build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer"), vocab_size=100)
    assert tok.eod == 99 and tok.vocab_size == 100
    assert tok.encode(" 5 17\n3 ") == [5, 17, 3]
    assert tok.decode([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError):
        tok.encode("5 x")


def test_tokenizer_mistakes_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer"))
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer(tok_cfg())
    with pytest.raises(DataError, match="--tokenizer-model .*missing.json: no such file"):
        build_tokenizer(tok_cfg(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a tokenizer.json"):
        build_tokenizer(tok_cfg(tokenizer_model=str(bad)))


def test_train_cli_reads_jsonl_keys_and_plain_text(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t}) for t in TEXTS) + "\n{broken\n")
    txt = tmp_path / "b.txt"
    txt.write_text("plain text file, one document\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = str(tmp_path / "out" / "tokenizer.json")
    args = parser.parse_args(["--input", str(jsonl), str(txt), "--json-keys", "body", "--vocab-size", "300",
                              "--output", out])
    assert run_train(args) == 0
    tok = build_tokenizer(tok_cfg(tokenizer_model=out))
    assert tok.vocab_size == 300
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    missing = parser.parse_args(["--input", str(tmp_path / "nope.jsonl"), "--output", out])
    with pytest.raises(DataError, match="nope.jsonl"):
        run_train(missing)


def test_train_cli_says_when_the_input_cannot_give_the_vocabulary_asked(tmp_path, capsys):
    """--vocab-size 100000000 on a small file silently gave a few hundred ids."""
    txt = tmp_path / "b.txt"
    txt.write_text("plain text file, one document\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = str(tmp_path / "tokenizer.json")
    assert run_train(parser.parse_args(["--input", str(txt), "--vocab-size", "100000000", "--output", out])) == 0
    size = build_tokenizer(tok_cfg(tokenizer_model=out)).vocab_size
    assert (f"meshlm: note: --vocab-size 100,000,000 asked, but the input gives only {size:,} tokens (every merge "
            f"it has); train on more text for a larger vocabulary") in capsys.readouterr().out
    assert run_train(parser.parse_args(["--input", str(txt), "--vocab-size", str(size), "--output", out])) == 0
    assert "note:" not in capsys.readouterr().out


def test_the_bpe_trainer_is_asked_for_no_more_ids_than_the_text_can_give(tmp_path, monkeypatch):
    """--vocab-size 1000000000 made the tokenizers library allocate 70 GB for its tables and abort
    the process (a Rust OOM backtrace); the text bounds the vocabulary: 257 + one merge per byte."""
    import tokenizers.trainers
    asked, real = [], tokenizers.trainers.BpeTrainer

    def recording(**kw):
        asked.append(kw["vocab_size"])
        assert kw["vocab_size"] < 10**6, "the trainer would allocate its tables for this many ids"
        return real(**kw)
    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", recording)
    txt = tmp_path / "b.txt"
    txt.write_text("plain text file, one document\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = str(tmp_path / "tokenizer.json")
    assert run_train(parser.parse_args(["--input", str(txt), "--vocab-size", str(10**9), "--output", out])) == 0
    train_bpe(["ab", "abc"], 10**9, str(tmp_path / "t.json"))
    assert asked == [257 + txt.stat().st_size, 257 + 5]
    assert run_train(parser.parse_args(["--input", str(txt), "--vocab-size", "270", "--output", out])) == 0
    assert asked[-1] == 270


@pytest.mark.parametrize("content", ["", json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n",
                                     "{broken\n" + json.dumps({"body": "text under another key"}) + "\n"])
def test_train_cli_without_any_text_is_a_data_error_and_writes_nothing(tmp_path, content):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "t.json"
    args = parser.parse_args(["--input", str(empty), "--vocab-size", "500", "--output", str(out)])
    with pytest.raises(DataError, match=r"no text to train on in \S*empty.jsonl"):
        run_train(args)
    assert not out.exists() and not list(tmp_path.glob("t.json*"))


def test_train_bpe_on_no_texts_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no text to train on"):
        train_bpe(["", ""], 300, str(tmp_path / "t.json"))
    assert not (tmp_path / "t.json").exists()


def test_null_tokenizer_refuses_ids_outside_the_vocabulary():
    tok = build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer"), vocab_size=100)
    with pytest.raises(ValueError, match=r"^token id 100 outside \[0, 100\)$"):
        tok.encode("5 100")
    with pytest.raises(ValueError, match=r"^token id -3 outside \[0, 100\)$"):
        tok.encode("-3")
    with pytest.raises(ValueError, match=r"^'def' is not an integer token id$"):
        tok.encode("def ")
    with pytest.raises(ConfigError, match="--vocab-size -5"):
        build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer"), vocab_size=-5)


def test_train_cli_skips_and_reports_bad_records(tmp_path, capsys):
    from meshlm.cli import main
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": t}) for t in TEXTS[:8]]
                               + ['{"text": "a\\ud800b"}', '{"text": 5}', '["text"]', '{"body": "x"}']) + "\n")
    out = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "train", "--input", str(jsonl), "--vocab-size", "300", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    for line, reason in [(9, "'text' holds a lone surrogate"), (10, "'text' is int, not a string"),
                         (11, "expected a JSON object, got list"), (12, "missing key 'text'")]:
        assert f"bad record: {jsonl}:{line}: {reason}" in captured.err
    assert "skipped 4 bad records" in captured.out
    tok = build_tokenizer(tok_cfg(tokenizer_model=str(out)))
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "tokenizer.json"]


def test_train_without_text_names_the_first_bad_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "\\udc00"}\n')
    with pytest.raises(DataError, match=rf"1 bad records; first: {bad}:1: 'text' holds a lone surrogate"):
        train_bpe([str(bad)], 300, str(tmp_path / "t.json"))


@pytest.mark.parametrize("where, message", [
    ("dir", "is a directory; give the path of a file"),
    ("file/tok.json", "is a file, not a folder"),
])
def test_train_output_is_checked_before_training(tmp_path, monkeypatch, where, message):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    monkeypatch.setattr("meshlm.data.tokenizer.train_bpe", lambda *a: pytest.fail("trained before the check"))
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--input", str(jsonl), "--output", str(tmp_path / where)])
    with pytest.raises(ConfigError, match=f"--output {tmp_path / where}: .*{message}"):
        run_train(args)
    dup = parser.parse_args(["--input", str(jsonl), "--output", str(tmp_path / "t.json"), "--json-keys", "a", "a"])
    with pytest.raises(ConfigError, match="--json-keys a a: 'a' is named twice"):
        run_train(dup)


@pytest.mark.parametrize("config, message", [
    ("{not json", r"invalid JSON \(.* at line 1 column 2\)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"eos_token": 5}', "eos_token must be a string or .*, not int"),
    ('{"eos_token": {"content": ["x"]}}', "eos_token must be a string or .*, not list"),
    (b'{"eos_token": "\xff"}', "not UTF-8 text"),
    ('{"eos_token": "<none>"}', "eos_token '<none>' is not in the vocabulary of"),
])
def test_a_malformed_tokenizer_config_is_a_one_line_error_naming_it(trained, tmp_path, config, message):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(open(trained, "rb").read())
    path = folder / "tokenizer_config.json"
    path.write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(DataError, match=f"^{path}: {message}") as e:
        build_tokenizer(tok_cfg(tokenizer_model=str(folder)))
    assert "\n" not in str(e.value)


def test_tokenizer_config_eos_token_is_used(trained, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(open(trained, "rb").read())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    tok = build_tokenizer(tok_cfg(tokenizer_model=str(folder)))
    assert tok.decode([tok.eod]) == "a"


def test_null_tokenizer_takes_megatrons_eod_and_pad_ids(tmp_path):
    """--null-tokenizer-eod-id / --null-tokenizer-pad-id as Megatron-LM has them (eod default
    vocab − 1, pad −1: none); a .bin whose ids reach --vocab-size (megatron-core 0.16.1's
    NullTokenizer: eod = --vocab-size) is named in one line with the flag that loads it."""
    import numpy as np

    from meshlm.data.indexed import IndexedDatasetWriter, check_token_ids
    from meshlm.data.tokenizer import null_ids_problem
    assert build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer"), vocab_size=100).eod == 99
    tok = build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer", null_tokenizer_eod_id=0, null_tokenizer_pad_id=5),
                          vocab_size=100)
    assert (tok.eod, tok.pad, tok.vocab_size) == (0, 5, 100)
    with pytest.raises(ConfigError, match=r"--null-tokenizer-eod-id 100 is not an id of --vocab-size 100.*"
                                          r"--vocab-size 101"):
        build_tokenizer(tok_cfg(tokenizer_type="NullTokenizer", null_tokenizer_eod_id=100), vocab_size=100)
    assert null_ids_problem(tok_cfg(null_tokenizer_pad_id=-1), 100) is None
    assert "--null-tokenizer-pad-id -2" in null_ids_problem(tok_cfg(null_tokenizer_pad_id=-2), 100)
    prefix = str(tmp_path / "old_text_document")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([3, 7, 100])  # megatron-core 0.16.1 at --vocab-size 100 appends eod 100
    w.finalize()
    with pytest.raises(DataError) as e:
        check_token_ids([prefix], 100, null_tokenizer=True)
    assert "megatron-core 0.16.1's NullTokenizer" in str(e.value) and "--vocab-size 101" in str(e.value)
    assert "\n" not in str(e.value)
    check_token_ids([prefix], 101, null_tokenizer=True)
    with pytest.raises(DataError, match="use the tokenizer the data was preprocessed with"):
        check_token_ids([prefix], 100)  # another tokenizer: the general line


def test_train_onto_a_full_disk_is_one_line_naming_output_and_leaves_no_file(tmp_path, monkeypatch):
    """The tokenizers library's `Exception: No space left on device (os error 28)` was a traceback."""
    import contextlib

    import meshlm.data.tokenizer as tokenizer_module
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "tokenizer.json"
    args = parser.parse_args(["--input", str(jsonl), "--vocab-size", "300", "--output", str(out)])
    real_replacing = tokenizer_module.replacing

    @contextlib.contextmanager
    def replacing_onto_a_full_disk(path):  # tok.save(tmp) in it fails as the tokenizers library does
        with real_replacing(path) as tmp:
            yield tmp
            raise Exception("No space left on device (os error 28)")
    monkeypatch.setattr(tokenizer_module, "replacing", replacing_onto_a_full_disk)
    with pytest.raises(ConfigError, match=rf"^--output {out}: no space left in {tmp_path} .*os error 28"):
        run_train(args)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]
