"""The embedded default corpus: stdlib sources → BPE tokenizer → .bin/.idx, reusable."""

import json
import os
import sysconfig
from types import SimpleNamespace

import numpy as np

from meshlm.data.corpus import cut_documents, prepare_default_corpus
from meshlm.data.indexed import IndexedDataset, check_token_ids
from meshlm.data.tokenizer import build_tokenizer


def test_cut_documents_end_at_blank_lines_and_rejoin():
    text = "a = 1\n\n" * 50 + "def f():\n    pass\n"
    pieces = cut_documents(text, size=40)
    assert "".join(pieces) == text
    assert all(p.endswith("\n\n") and len(p) >= 40 for p in pieces[:-1])
    assert cut_documents("short", size=40) == ["short"]


def test_default_corpus_is_real_stdlib_text_tokenized_with_eod(tmp_path):
    out = prepare_default_corpus(str(tmp_path), max_bytes=300_000, vocab_size=512)
    prefix, = out["data_path"]
    assert out["vocab_size"] == 512
    records = [json.loads(line) for line in open(tmp_path / "data" / "corpus.jsonl")]
    stdlib = sysconfig.get_paths()["stdlib"]
    first = records[0]["path"]
    with open(os.path.join(stdlib, first), encoding="utf-8") as f:
        assert "".join(r["text"] for r in records if r["path"] == first) == f.read()
    assert not any("site-packages" in r["path"] for r in records)

    ds = IndexedDataset(prefix)
    tok = build_tokenizer(SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=out["tokenizer_model"],
                                          vocab_file=None, merge_file=None))
    assert len(ds) == len(records) == out["documents"]
    assert ds.dtype == np.uint16
    check_token_ids([prefix], out["vocab_size"])
    for i in (0, len(ds) - 1):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == records[i]["text"]

    mtime = os.stat(prefix + ".bin").st_mtime_ns
    again = prepare_default_corpus(str(tmp_path), max_bytes=300_000, vocab_size=512)
    assert again == out and os.stat(prefix + ".bin").st_mtime_ns == mtime
