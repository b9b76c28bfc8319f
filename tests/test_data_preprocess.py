"""meshlm preprocess: jsonl / text → .bin/.idx; bad records reported by file:line, good ones kept."""

import argparse
import json

import numpy as np
import pytest

from meshlm.data.indexed import IndexedDataset
from meshlm.data.preprocess import add_arguments, preprocess_files, run
from meshlm.data.records import SHOW_BAD
from meshlm.errors import DataError

VOCAB = 100  # NullTokenizer: text is ids, eod = 99


def null_cfg():
    return argparse.Namespace(tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_file=None, merge_file=None)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_bad_records_are_counted_with_file_and_line_and_good_ones_kept(tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"text": "1 2 3"}).encode(),           # 1 good
        b'{"text": "4 5"',                                  # 2 bad JSON
        json.dumps({"body": "6"}).encode(),                 # 3 missing key
        json.dumps({"text": 7}).encode(),                   # 4 not a string
        b'{"text": "8 \xff 9"}',                            # 5 invalid UTF-8
        b"",                                                # 6 blank: ignored
        json.dumps({"text": "10 11", "extra": 1}).encode(),  # 7 good
        json.dumps(["text"]).encode(),                      # 8 not an object
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    args = parse(["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                  "NullTokenizer", "--vocab-size", str(VOCAB), "--append-eod"])
    assert run(args) == 0
    captured = capsys.readouterr()
    for line, reason in [(2, "invalid JSON"), (3, "missing key 'text'"), (4, "'text' is int, not a string"),
                         (5, "not UTF-8"), (8, "expected a JSON object")]:
        assert f"{path}:{line}: {reason}" in captured.err
    assert f":6:" not in captured.err
    assert "2 documents" in captured.out and "5 bad records" in captured.out
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 99], [10, 11, 99]]


def test_only_the_first_bad_records_are_shown_but_all_are_counted(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("{bad\n" * (SHOW_BAD + 5) + json.dumps({"text": "1"}) + "\n")
    stats = preprocess_files([str(path)], str(tmp_path / "out"), null_cfg(), VOCAB, quiet=True)
    assert stats.bad.count == SHOW_BAD + 5
    assert len(stats.bad.messages) == SHOW_BAD
    assert stats.documents == 1


def test_plain_text_file_is_one_document_and_several_keys_stay_aligned(tmp_path):
    txt = tmp_path / "doc.txt"
    txt.write_text("1 2\n\n3 4\n")
    jsonl = tmp_path / "two.jsonl"
    jsonl.write_text(json.dumps({"a": "5", "b": "6 7"}) + "\n" + json.dumps({"a": "8"}) + "\n")
    stats = preprocess_files([str(txt), str(jsonl)], str(tmp_path / "out"), null_cfg(), VOCAB,
                             json_keys=("a", "b"), quiet=True)
    assert stats.bad.count == 1  # the record without "b" is dropped from both keys
    a = IndexedDataset(str(tmp_path / "out_a_document"))
    b = IndexedDataset(str(tmp_path / "out_b_document"))
    assert [a[i].tolist() for i in range(len(a))] == [[1, 2, 3, 4], [5]]
    assert [b[i].tolist() for i in range(len(b))] == [[1, 2, 3, 4], [6, 7]]
    assert stats.tokens == 5


def test_worker_pool_writes_the_same_files(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "big.jsonl"
    docs = [" ".join(map(str, rng.integers(0, VOCAB - 1, rng.integers(0, 50)))) for _ in range(3000)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    one = preprocess_files([str(path)], str(tmp_path / "one"), null_cfg(), VOCAB, append_eod=True, quiet=True)
    two = preprocess_files([str(path)], str(tmp_path / "two"), null_cfg(), VOCAB, append_eod=True,
                           workers=2, quiet=True)
    assert one.documents == two.documents == len(docs)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{ext}").read_bytes() == (tmp_path / f"two_text_document{ext}").read_bytes()


def test_missing_input_and_nothing_usable_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="absent.jsonl: no such file"):
        preprocess_files([str(tmp_path / "absent.jsonl")], str(tmp_path / "out"), null_cfg(), VOCAB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(DataError, match="no usable record"):
        preprocess_files([str(bad)], str(tmp_path / "out"), null_cfg(), VOCAB, quiet=True)
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("append_eod", [False, True])
def test_records_that_are_all_empty_write_nothing(tmp_path, append_eod):
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB)] + (["--append-eod"] if append_eod else [])
    with pytest.raises(DataError, match=r"blank.jsonl: 0 tokens written: every record's 'text' was empty"):
        run(parse(argv))
    assert not list(tmp_path.glob("out*"))


def test_one_key_whose_records_are_all_empty_is_named_and_nothing_written(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"a": "1 2", "b": ""}) + "\n" + json.dumps({"a": "3", "b": ""}) + "\n")
    with pytest.raises(DataError, match=r"every record's 'b' was empty"):
        preprocess_files([str(path)], str(tmp_path / "out"), null_cfg(), VOCAB, json_keys=("a", "b"), quiet=True)
    assert not list(tmp_path.glob("out*"))
