"""The embedded default corpus: the running interpreter's standard-library sources.

Every machine with Python has this real, non-synthetic text. ``prepare_default_corpus`` takes the
``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in a fixed shuffled order (skipping
site-packages, test folders and files that are not UTF-8) up to :data:`MAX_CORPUS_BYTES`, cuts
each at blank lines into documents of about :data:`DOC_BYTES` (so that even the 0.1 % test share of
``--split 969,30,1`` gets a few documents), writes them as ``data/corpus.jsonl``, trains a byte-level BPE of :data:`DEFAULT_VOCAB` ids on them and
preprocesses them with ``--append-eod`` into ``data/stdlib_text_document.bin/.idx``. A second call
on the same run directory reuses the files.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
import time
from types import SimpleNamespace

from .indexed import IndexedDataset
from .preprocess import preprocess_files
from .tokenizer import train_bpe

MAX_CORPUS_BYTES = 8 << 20  # 8 MiB of source text: about 2.5M tokens, prepared in seconds on 2 cores
DEFAULT_VOCAB = 4096
DOC_BYTES = 4096  # a file is cut at the first blank line after this many characters
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
             "encodings"}  # encodings: generated codec tables, not prose-like code


def stdlib_sources(max_bytes: int = MAX_CORPUS_BYTES, seed: int = 1234):
    """Yield (path relative to the stdlib, text) until max_bytes (UTF-8) are taken.

    Files are taken in a fixed pseudo-random order (sorted, then shuffled with ``seed``), so the
    corpus samples the whole library and the train/valid/test splits — contiguous ranges of
    documents — come from the same distribution on every machine with the same Python.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths.extend(os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".py"))
    random.Random(seed).shuffle(paths)
    taken = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if taken + len(raw) > max_bytes:
            continue
        taken += len(raw)
        yield os.path.relpath(path, root), text


def cut_documents(text: str, size: int = DOC_BYTES) -> list:
    """Cut text into pieces of at least ``size`` characters (the last may be shorter), each ending
    at a blank line; the pieces concatenate back to ``text``."""
    pieces, start, pos = [], 0, 0
    while True:
        pos = text.find("\n\n", start + size)
        if pos < 0:
            break
        pieces.append(text[start:pos + 2])
        start = pos + 2
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def prepare_default_corpus(run_dir: str, max_bytes: int = MAX_CORPUS_BYTES,
                           vocab_size: int = DEFAULT_VOCAB) -> dict:
    """Build (or reuse) the default corpus under ``run_dir/data``.

    Returns {"data_path": [prefix], "tokenizer_model": tokenizer.json path, "vocab_size": ids}.
    """
    data_dir = os.path.join(run_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    corpus = os.path.join(data_dir, "corpus.jsonl")
    tokenizer_path = os.path.join(data_dir, "tokenizer.json")
    prefix = os.path.join(data_dir, "stdlib")
    result = {"data_path": [prefix + "_text_document"], "tokenizer_model": tokenizer_path}
    done = os.path.join(data_dir, "corpus.json")  # written last: its presence means complete
    if os.path.isfile(done):
        with open(done) as f:
            result.update(json.load(f))
        print(f"default corpus: reusing {result['data_path'][0]} ({result['num_tokens']:,} tokens)")
        return result

    start = time.perf_counter()
    texts, nbytes, files = [], 0, 0
    with open(corpus + ".tmp", "w", encoding="utf-8") as f:
        for files, (rel, text) in enumerate(stdlib_sources(max_bytes), 1):
            for part, doc in enumerate(cut_documents(text)):
                f.write(json.dumps({"text": doc, "path": rel, "part": part}) + "\n")
            texts.append(text)
            nbytes += len(text.encode("utf-8"))
    os.replace(corpus + ".tmp", corpus)
    print(f"default corpus: {files:,} stdlib files, {nbytes / 2**20:.1f} MiB → {corpus}")
    tok = train_bpe(texts, vocab_size, tokenizer_path)
    print(f"default corpus: byte-level BPE, vocab {tok.vocab_size} → {tokenizer_path}")
    stats = preprocess_files([corpus], prefix, SimpleNamespace(tokenizer_type="HuggingFaceTokenizer",
                             tokenizer_model=tokenizer_path), append_eod=True, quiet=True)
    num_tokens = IndexedDataset(result["data_path"][0]).num_tokens
    print(f"default corpus: {stats.documents:,} documents, {num_tokens:,} tokens → "
          f"{result['data_path'][0]}.bin/.idx ({time.perf_counter() - start:.1f} s)")
    summary = {"vocab_size": tok.vocab_size, "num_tokens": num_tokens, "documents": stats.documents}
    with open(done + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(done + ".tmp", done)
    result.update(summary)
    return result
