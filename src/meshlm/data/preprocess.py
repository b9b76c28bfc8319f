"""``meshlm preprocess``: jsonl / plain-text files → Megatron ``.bin/.idx`` indexed datasets.

Inputs: ``*.jsonl`` / ``*.json`` files hold one JSON object per line, each key of ``--json-keys``
a string (one document); any other file is plain text and is ONE document (the whole file). Output:
``{output_prefix}_{key}_document.bin/.idx`` per key, ids as uint16 below 65,500 vocabulary ids
else int32, one document = one sequence; ``--append-eod`` appends the tokenizer's eod id.

Bad records (invalid JSON, not an object, a missing key, a non-string value, bytes that are not
UTF-8, NullTokenizer text that is not integers) are skipped, counted and reported as
``file:line: reason`` (the first :data:`SHOW_BAD` shown); a record is kept only if every key is
good, so the datasets of several keys stay aligned. Blank jsonl lines are ignored. When no record
is usable, or every usable record's text is empty for some key, nothing is written (DataError).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..errors import DataError
from .indexed import IndexedDatasetWriter, token_dtype
from .tokenizer import build_tokenizer

SHOW_BAD = 10
CHUNK_BYTES = 1 << 20  # records are sent to workers in chunks of about this many bytes
JSON_EXTS = (".jsonl", ".json")


class BadRecord(ValueError):
    """A record that cannot be used; the message is the reason."""


@dataclass
class PreprocessStats:
    """What a preprocessing run did. seconds: wall time; outputs: the written prefixes."""

    documents: int = 0
    tokens: int = 0
    bad: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    outputs: list = field(default_factory=list)
    bad_messages: list = field(default_factory=list)


def iter_records(paths):
    """Yield (path, line number, raw bytes, is_json) for every record of the inputs, in order."""
    for path in paths:
        if path.endswith(JSON_EXTS):
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield path, n, line, True
        else:
            with open(path, "rb") as f:
                yield path, 1, f.read(), False


def parse_record(raw: bytes, is_json: bool, keys) -> list:
    """The texts of one record, one per key. Raises BadRecord with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not is_json:
        return [text] * len(keys)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        if key not in obj:
            raise BadRecord(f"missing key {key!r}")
        if not isinstance(obj[key], str):
            raise BadRecord(f"{key!r} is {type(obj[key]).__name__}, not a string")
        texts.append(obj[key])
    return texts


def iter_texts(paths, keys=("text",)):
    """Every good text of the inputs (bad records silently skipped): the BPE trainer's feed."""
    for _, _, raw, is_json in iter_records(paths):
        try:
            yield from parse_record(raw, is_json, keys)
        except BadRecord:
            continue


_worker_state = {}


def _init_worker(tok_cfg, vocab_size, keys, append_eod, tokenizer=None):
    if tokenizer is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
        tokenizer = build_tokenizer(tok_cfg, vocab_size)
    _worker_state.update(tok=tokenizer, keys=keys, append_eod=append_eod)


def _encode_chunk(chunk):
    """Tokenize a chunk of records → (list of per-key id lists of good records, bad messages, bytes,
    per-key text tokens: the ids before any appended eod)."""
    tok, keys, append_eod = _worker_state["tok"], _worker_state["keys"], _worker_state["append_eod"]
    good, bad, nbytes, text_tokens = [], [], 0, [0] * len(keys)
    for path, line, raw, is_json in chunk:
        nbytes += len(raw)
        try:
            texts = parse_record(raw, is_json, keys)
            ids = tok.encode_batch(texts)
        except (BadRecord, ValueError) as e:
            bad.append(f"{path}:{line}: {e}")
            continue
        text_tokens = [t + len(x) for t, x in zip(text_tokens, ids)]
        if append_eod:
            ids = [x + [tok.eod] for x in ids]
        good.append(ids)
    return good, bad, nbytes, text_tokens


def _chunks(records):
    chunk, size = [], 0
    for rec in records:
        chunk.append(rec)
        size += len(rec[2])
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _progress(total_bytes: int, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(TextColumn("[bold]preprocess"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TextColumn("{task.fields[docs]:,} docs {task.fields[dps]:,.0f} docs/s "
                                   "{task.fields[tps]:,.0f} tokens/s"), TimeElapsedColumn(),
                        console=console, disable=quiet or not console.is_terminal)
    return progress, progress.add_task("", total=max(total_bytes, 1), docs=0, dps=0.0, tps=0.0)


def preprocess_files(inputs, output_prefix: str, tok_cfg, vocab_size=None, json_keys=("text",),
                     append_eod: bool = False, workers: int = 1, quiet: bool = False) -> PreprocessStats:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx``; return the stats.

    tok_cfg: tokenizer fields (tokenizer_type, tokenizer_model, vocab_file, merge_file), e.g. a
    DataConfig. workers > 1 tokenizes in a process pool (order of documents is kept).
    Raises DataError (and writes nothing) when an input is missing, no record at all is usable, or
    every usable record's text is empty for some key.
    """
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"--input {path}: no such file")
    tok_cfg = SimpleNamespace(**{k: getattr(tok_cfg, k, None) for k in
                                 ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")})
    tokenizer = build_tokenizer(tok_cfg, vocab_size)
    keys = tuple(json_keys)
    prefixes = [f"{output_prefix}_{key}_document" for key in keys]
    writers = [IndexedDatasetWriter(p, token_dtype(tokenizer.vocab_size)) for p in prefixes]
    stats = PreprocessStats()
    start = time.perf_counter()
    progress, task = _progress(sum(os.path.getsize(p) for p in inputs), quiet)
    text_tokens = [0] * len(keys)
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context().Pool(workers, _init_worker,
                                                  (tok_cfg, vocab_size, keys, append_eod))
        results = pool.imap(_encode_chunk, _chunks(iter_records(inputs)))
    else:
        _init_worker(tok_cfg, vocab_size, keys, append_eod, tokenizer)
        results = map(_encode_chunk, _chunks(iter_records(inputs)))
    try:
        with progress:
            for good, bad, nbytes, chunk_tokens in results:
                text_tokens = [t + c for t, c in zip(text_tokens, chunk_tokens)]
                for ids in good:
                    for writer, doc in zip(writers, ids):
                        writer.add_document(doc)
                    stats.tokens += len(ids[0])
                stats.documents += len(good)
                stats.bad += len(bad)
                stats.bad_messages.extend(bad[:SHOW_BAD - len(stats.bad_messages)])
                stats.bytes_read += nbytes
                dt = max(time.perf_counter() - start, 1e-9)
                progress.update(task, advance=nbytes, docs=stats.documents, dps=stats.documents / dt,
                                tps=stats.tokens / dt)
    finally:
        if pool is not None:
            pool.terminate()
    stats.seconds = time.perf_counter() - start
    empty_keys = [key for key, t in zip(keys, text_tokens) if t == 0]
    if stats.documents == 0 or empty_keys:
        for writer in writers:
            writer.abort()
    if stats.documents == 0:
        raise DataError(f"--input {' '.join(inputs)}: no usable record ({stats.bad} bad); "
                        f"first: {stats.bad_messages[0] if stats.bad_messages else 'the inputs are empty'}")
    if empty_keys:
        raise DataError(f"--input {' '.join(inputs)}: 0 tokens written: every record's "
                        f"{', '.join(repr(k) for k in empty_keys)} was empty, so nothing was written; "
                        f"give files with text (or other --json-keys)")
    for writer in writers:
        writer.finalize()
    stats.outputs = prefixes
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshlm preprocess`` (Megatron's tools/preprocess_data.py names)."""
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl files (one JSON object per line) or plain-text files (one document each)")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields to tokenize")
    parser.add_argument("--tokenizer-type", default=None,
                        choices=["HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"])
    parser.add_argument("--tokenizer-model", default=None, help="tokenizer.json (HuggingFaceTokenizer)")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")


def report(stats: PreprocessStats) -> None:
    """Print the bad records shown (stderr) and the summary line (stdout)."""
    for msg in stats.bad_messages:
        print(f"bad record: {msg}", file=sys.stderr)
    if stats.bad > len(stats.bad_messages):
        print(f"... and {stats.bad - len(stats.bad_messages)} more bad records", file=sys.stderr)
    rate = stats.tokens / max(stats.seconds, 1e-9)
    print(f"preprocessed {stats.documents:,} documents, {stats.tokens:,} tokens, {stats.bad:,} bad records "
          f"in {stats.seconds:.1f} s ({rate:,.0f} tokens/s) → {', '.join(p + '.bin/.idx' for p in stats.outputs)}")


def run(args: argparse.Namespace) -> int:
    """``meshlm preprocess``: returns 0 when a dataset was written (DataError otherwise)."""
    stats = preprocess_files(args.input, args.output_prefix, args, args.vocab_size, args.json_keys,
                             args.append_eod, args.workers)
    report(stats)
    return 0
