"""meshlm preprocess: jsonl / text → .bin/.idx; bad records reported by file:line, good ones kept."""

import argparse
import json

import numpy as np
import pytest

from meshlm.data.indexed import IndexedDataset
from meshlm.data.preprocess import add_arguments, preprocess_files, run
from meshlm.data.records import SHOW_BAD, check_json_keys
from meshlm.errors import ConfigError, DataError

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


@pytest.fixture
def full_pool(monkeypatch):
    """Start every --workers process even for these small inputs (pool_size caps it at the input's
    chunks and the machine's cores): the tests below are about the pool itself."""
    from meshlm.data import preprocess
    monkeypatch.setattr(preprocess, "pool_size", lambda workers, total_bytes, cores=None: workers)


def test_worker_pool_writes_the_same_files(tmp_path, full_pool):
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


# ----------------------------------------------------------------------------- bad records, no leftovers

def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("out"))


@pytest.mark.parametrize("workers", [1, 2])
def test_every_kind_of_bad_record_is_skipped_by_the_cli_and_the_rest_kept(tmp_path, capsys, workers, full_pool):
    from meshlm.cli import main
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join([
        '{"text": "1 2"}',          # 1 good
        '{"text": "a\\ud800b"}',     # 2 lone surrogate (bad unicode)
        '{"text": ["3"]}',          # 3 not a string
        '{"body": "4"}',            # 4 missing key
        '"5"',                      # 5 not an object
        '{"text": "6 70000"}',      # 6 id outside the vocabulary (uint16 would overflow)
        '{"text": "-1"}',           # 7 negative id
        '{"text": "7 8"}',          # 8 good
    ]) + "\n")
    code = main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--workers", str(workers)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for line, reason in [(2, "'text' holds a lone surrogate '\\ud800' at character 1, which is not valid Unicode"),
                         (3, "'text' is list, not a string"), (4, "missing key 'text'"),
                         (5, "expected a JSON object, got str"), (6, f"token id 70000 outside [0, {VOCAB})"),
                         (7, f"token id -1 outside [0, {VOCAB})")]:
        assert f"bad record: {path}:{line}: {reason}\n" in captured.err
    assert "2 documents" in captured.out and "skipped 6 bad records" in captured.out
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [7, 8]]
    assert _leftovers(tmp_path) == ["out_text_document.bin", "out_text_document.idx"]


def test_null_tokenizer_ids_beyond_uint16_are_checked_against_the_vocabulary(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "1 70000"}) + "\n" + json.dumps({"text": "65535 3"}) + "\n")
    stats = preprocess_files([str(path)], str(tmp_path / "out"), null_cfg(), 65536, quiet=True)
    assert stats.bad.messages == [f"{path}:1: token id 70000 outside [0, 65536)"]
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [65535, 3]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from meshlm.data.tokenizer import train_bpe
    path = str(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
    train_bpe(["hello world, some text to learn from"] * 4, 270, path)
    return argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path, vocab_file=None,
                              merge_file=None)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_surrogate_does_not_reach_a_real_tokenizer(tmp_path, bpe, workers, full_pool):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "hello"}\n{"text": "a\\ud800b"}\n{"text": "world"}\n')
    stats = preprocess_files([str(path)], str(tmp_path / "out"), bpe, workers=workers, quiet=True)
    assert (stats.documents, stats.bad.count) == (2, 1)
    assert stats.bad.messages[0].startswith(f"{path}:2: 'text' holds a lone surrogate")
    assert _leftovers(tmp_path) == ["out_text_document.bin", "out_text_document.idx"]


def _corpus(tmp_path, n=50):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i % VOCAB} 1"}) + "\n" for i in range(n)))
    return path


def test_keyboard_interrupt_while_writing_leaves_no_file(tmp_path, monkeypatch):
    from meshlm.data.indexed import IndexedDatasetWriter
    calls = []

    def interrupted(self, ids):
        calls.append(ids)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return add(self, ids)

    add = IndexedDatasetWriter.add_document
    monkeypatch.setattr(IndexedDatasetWriter, "add_document", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess_files([str(_corpus(tmp_path))], str(tmp_path / "out"), null_cfg(), VOCAB,
                         json_keys=("text",), quiet=True)
    assert _leftovers(tmp_path) == []


def test_an_error_in_a_worker_process_leaves_no_file(tmp_path, monkeypatch, full_pool):
    import multiprocessing
    from meshlm.data.tokenizer import NullTokenizer
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the patched tokenizer reaches the workers only through fork")

    def broken(self, texts):
        raise RuntimeError("worker failed")

    monkeypatch.setattr(NullTokenizer, "encode_batch", broken)
    with pytest.raises(RuntimeError, match="worker failed"):
        preprocess_files([str(_corpus(tmp_path))], str(tmp_path / "out"), null_cfg(), VOCAB, workers=2, quiet=True)
    assert _leftovers(tmp_path) == []


def test_a_failure_while_finalizing_leaves_no_file(tmp_path, monkeypatch):
    import os

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(ConfigError, match=rf"^--output-prefix {tmp_path / 'out'}: no space left in {tmp_path} "
                                          r"\([\d,]+ bytes free; OSError: .*\); free space there"):
        preprocess_files([str(_corpus(tmp_path))], str(tmp_path / "out"), null_cfg(), VOCAB,
                         json_keys=("text",), quiet=True)
    assert _leftovers(tmp_path) == []


def test_a_full_disk_while_writing_documents_is_one_line_naming_the_prefix(tmp_path, monkeypatch):
    """It was the OSError's traceback (from IndexedDatasetWriter.add_document)."""
    from meshlm.data.indexed import IndexedDatasetWriter

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(IndexedDatasetWriter, "add_document", full_disk)
    with pytest.raises(ConfigError, match=rf"^--output-prefix {tmp_path / 'out'}: no space left"):
        preprocess_files([str(_corpus(tmp_path))], str(tmp_path / "out"), null_cfg(), VOCAB,
                         json_keys=("text",), quiet=True)
    assert _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- flags checked up front

def test_duplicate_json_keys_zero_workers_and_zero_partitions_are_one_line_errors(tmp_path, capsys):
    from meshlm.cli import main
    path = _corpus(tmp_path, 2)
    base = ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
    for extra, message in [(["--json-keys", "text", "text"], "--json-keys text text: 'text' is named twice"),
                           (["--workers", "0"], "--workers 0: use 1 or more"),
                           (["--partitions", "0"], "--partitions 0: use 1 or more")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("meshlm: error: ") and message in err and err.count("\n") == 1
    assert _leftovers(tmp_path) == []


def test_an_output_prefix_that_cannot_be_written_is_refused_before_tokenizing(tmp_path, monkeypatch):
    from meshlm.errors import ConfigError
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr("meshlm.data.preprocess._write", lambda *a: pytest.fail("tokenized before the check"))
    with pytest.raises(ConfigError, match=f"--output-prefix {blocker}/out: {blocker} is a file, not a folder"):
        preprocess_files([str(_corpus(tmp_path))], str(blocker / "out"), null_cfg(), VOCAB, quiet=True)


def test_a_directory_given_as_input_is_named(tmp_path):
    with pytest.raises(DataError, match=f"--input {tmp_path} is a directory; give the files in it"):
        preprocess_files([str(tmp_path)], str(tmp_path / "out"), null_cfg(), VOCAB)


def _megatron_argv(tmp_path, n_docs):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i % 50} {i % 7}"}) + "\n" for i in range(n_docs)))
    return ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB), "--append-eod", "--workers", "1"]


def test_megatron_preprocess_flags_are_accepted_and_log_interval_prints_progress(tmp_path, capsys):
    from meshlm.cli import main
    argv = _megatron_argv(tmp_path, 5000) + ["--log-interval", "1000", "--partitions", "1", "--keep-newlines",
                                             "--lang", "english", "--keep-sequential-samples"]
    assert main(argv) == 0, capsys.readouterr().err
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("preprocess: ")]
    assert progress and len(progress) <= 5 and "5,000 documents" in progress[-1]
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 5000


def test_split_sentences_is_refused_in_one_line_naming_it(tmp_path, capsys):
    from meshlm.cli import main
    assert main(_megatron_argv(tmp_path, 3) + ["--split-sentences"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--split-sentences: meshlm does not split" in err
    assert not (tmp_path / "out_text_document.bin").exists()


def test_workers_beyond_the_inputs_chunks_or_the_cores_are_not_started(tmp_path, capsys):
    """`meshlm preprocess --workers 100000` on a 30 KiB file forked 100000 tokenizer processes and
    ran for half an hour; the pool is now as large as there is work and cores for, with a note."""
    from meshlm.data.preprocess import CHUNK_BYTES, pool_size
    assert pool_size(100000, 30_000, cores=2) == 1 and pool_size(8, 5 * CHUNK_BYTES, cores=16) == 5
    assert pool_size(8, 100 * CHUNK_BYTES, cores=2) == 2 and pool_size(3, 100 * CHUNK_BYTES, cores=16) == 3
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "1 2"}\n')
    stats = preprocess_files([str(path)], str(tmp_path / "out"), null_cfg(), VOCAB, workers=100000)
    assert stats.documents == 1
    assert "preprocess: note: --workers 100000: using 1 tokenizer process(es)" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["{tmp}/", "{tmp}/.", "."])
def test_an_output_prefix_naming_a_folder_is_refused_naming_the_files_it_would_make(tmp_path, monkeypatch, prefix):
    """`--output-prefix data/` wrote data/_text_document.bin/.idx, named by no prefix a user would give."""
    monkeypatch.chdir(tmp_path)  # "." names it
    prefix = prefix.replace("{tmp}", str(tmp_path))
    with pytest.raises(ConfigError, match=f"--output-prefix {prefix} names a folder: the files would be named "
                                          f"{prefix}_text_document.bin"):
        preprocess_files([str(_corpus(tmp_path))], prefix, null_cfg(), VOCAB, quiet=True)


def test_a_vocab_size_the_tokenizer_file_overrides_is_named(tmp_path, capsys):
    """Silently ignored by preprocess (pretrain names it at start)."""
    from meshlm.cli import main
    from meshlm.data.tokenizer import train_bpe
    train_bpe(["a b c d e f"] * 5, 270, str(tmp_path / "tok.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "a b c"}) + "\n")
    assert main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok.json"), "--vocab-size", "10"]) == 0
    assert "meshlm: note: --vocab-size 10 ignored with HuggingFaceTokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["tokenizer", "preprocess"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, capsys, command):
    """`tokenizer train --input corpus.jsonl --output corpus.jsonl` replaced the corpus by the tokenizer."""
    from meshlm.cli import main
    text = json.dumps({"text": "1 2 3"}) + "\n"
    if command == "tokenizer":
        corpus = tmp_path / "c.jsonl"
        argv = ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--output", str(corpus)]
    else:
        corpus = tmp_path / "o_text_document.idx"
        argv = ["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
    corpus.write_text(text)
    assert main(argv) == 2
    assert f"is the --input {corpus}; writing it would replace the text it reads" in capsys.readouterr().err
    assert corpus.read_text() == text


def test_a_files_utf8_byte_order_mark_is_not_part_of_its_first_record(tmp_path):
    """Windows editors start a file with a BOM: the first JSON line was a bad record (dropped) and a
    text file's first token carried U+FEFF; preprocess and tokenizer train read through iter_records."""
    from meshlm.data.records import iter_texts
    jsonl, txt = tmp_path / "bom.jsonl", tmp_path / "bom.txt"
    jsonl.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "1 2"}).encode() + b"\r\n"
                      + json.dumps({"text": "3"}).encode() + b"\r\n")
    txt.write_bytes(b"\xef\xbb\xbf4 5\n")
    stats = preprocess_files([str(jsonl), str(txt)], str(tmp_path / "out"), null_cfg(), VOCAB, quiet=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert stats.bad.count == 0 and [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5]]
    assert list(iter_texts([str(jsonl), str(txt)])) == ["1 2", "3", "4 5\n"]


def test_input_and_json_keys_given_twice_add_up_not_replace():
    """`--input a.jsonl --input b.jsonl` (preprocess, tokenizer train) read b.jsonl alone: argparse kept
    the last list; --json-keys likewise. Without the flag --json-keys is text."""
    from meshlm.data.tokenizer import add_train_arguments
    for add in (add_arguments, add_train_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        args, _ = parser.parse_known_args(["--input", "a", "--input", "b", "c", "--output-prefix", "o", "--output",
                                           "t", "--json-keys", "text", "--json-keys", "title"])
        assert args.input == ["a", "b", "c"] and args.json_keys == ["text", "title"]
        args, _ = parser.parse_known_args(["--input", "a", "--output-prefix", "o", "--output", "t"])
        assert check_json_keys(args.json_keys) == ("text",)


def read_idx(path):
    """An independent reader of the .idx layout (MEGATRON_FORMATS.md): header, then int32 lengths,
    int64 pointers, int64 document index."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = np.frombuffer(raw[9:17], "<u8")[0], raw[17], *np.frombuffer(raw[18:34], "<u8")
    lengths = np.frombuffer(raw, "<i4", int(n), 34)
    pointers = np.frombuffer(raw, "<i8", int(n), 34 + 4 * int(n))
    documents = np.frombuffer(raw, "<i8", int(d), 34 + 12 * int(n))
    assert version == 1 and len(raw) == 34 + 12 * int(n) + 8 * int(d)
    return code, lengths.tolist(), pointers.tolist(), documents.tolist()


@pytest.mark.parametrize("append_eod", [False, True])
def test_an_empty_document_adds_no_sequence_and_no_eod_as_in_megatrons_preprocess(tmp_path, append_eod):
    """Megatron's preprocess_data.py skips a text without tokens (its eod too) but keeps the document's
    entry; meshlm wrote a sequence [eod] (or of length 0), so --split cut other sequences."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1 2", "", "3", "  ", "4 5 6"]))
    preprocess_files([str(path)], str(tmp_path / "out"), null_cfg(), VOCAB, append_eod=append_eod, quiet=True)
    eod = [99] if append_eod else []
    code, lengths, pointers, documents = read_idx(tmp_path / "out_text_document.idx")
    assert code == 8 and lengths == [2 + len(eod), 1 + len(eod), 3 + len(eod)]  # uint16
    assert pointers == [0, 2 * lengths[0], 2 * (lengths[0] + lengths[1])]
    assert documents == [0, 1, 1, 2, 2, 3]
    ids = np.frombuffer((tmp_path / "out_text_document.bin").read_bytes(), "<u2").tolist()
    assert ids == [1, 2] + eod + [3] + eod + [4, 5, 6] + eod


def test_a_jsonl_shard_without_the_extension_is_read_as_json_lines(tmp_path):
    """Megatron reads every --input as JSON lines; `split -l` shards (xaa) or *.ndjson were taken as
    ONE plain-text document holding the JSON syntax, silently. A plain text starting with "{" stays text."""
    shard, code = tmp_path / "xaa", tmp_path / "main.c"
    shard.write_text(json.dumps({"text": "1 2 3"}) + "\n\n" + json.dumps({"text": "4"}) + "\n")
    code.write_text("{ 5 6\n7 }\n")
    preprocess_files([str(shard)], str(tmp_path / "a"), null_cfg(), VOCAB, quiet=True)
    ds = IndexedDataset(str(tmp_path / "a_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4]]
    from meshlm.data.records import iter_records
    assert [(line, is_json) for _, line, _, is_json in iter_records([str(code), str(shard)])] == \
        [(1, False), (1, True), (3, True)]


def test_a_tokenizer_with_unused_ids_sizes_the_vocabulary_by_its_largest_id(tmp_path):
    """An added token at id 70000 over 4 tokens: the vocabulary was counted as 4, so preprocess chose
    uint16 and ended in an OverflowError traceback (and a model of 4 embeddings could not read the data)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "<|endoftext|>": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    cfg = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok.json"),
                             vocab_file=None, merge_file=None)
    preprocess_files([str(tmp_path / "c.jsonl")], str(tmp_path / "out"), cfg, append_eod=True, quiet=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [0, 1, 70000]


def test_a_gzip_input_is_read_decompressed_and_a_damaged_one_is_one_line(tmp_path):
    """Megatron's preprocess_data.py reads *.jsonl.gz; meshlm read the compressed bytes as one text
    record and refused it as 'not UTF-8'."""
    import gzip
    text = json.dumps({"text": "1 2 3"}) + "\n" + json.dumps({"text": "4"}) + "\n"
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    preprocess_files([str(tmp_path / "c.jsonl.gz")], str(tmp_path / "out"), null_cfg(), VOCAB, quiet=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4]]
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(text.encode())[:-12])
    with pytest.raises(DataError, match=r"^--input \S+cut.jsonl.gz: cannot read it \(Compressed file ended"):
        preprocess_files([str(tmp_path / "cut.jsonl.gz")], str(tmp_path / "o2"), null_cfg(), VOCAB, quiet=True)
    assert not list(tmp_path.glob("o2*"))
