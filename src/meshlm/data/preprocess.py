"""``meshlm preprocess``: jsonl / plain-text files → Megatron ``.bin/.idx`` indexed datasets.

Inputs are read as :mod:`.records` says (one JSON object per line, or a plain-text file as ONE
document). Output: ``{output_prefix}_{key}_document.bin/.idx`` per key, ids as uint16 below 65,500
vocabulary ids else int32, one document = one sequence; ``--append-eod`` appends the tokenizer's
eod id. A document without tokens (empty text) adds no sequence, only its document-index entry, and
gets no eod: Megatron's preprocess_data.py writes the same bytes, so --split cuts the same sequences.

Bad records (see :mod:`.records`; also any text the tokenizer cannot encode, e.g. NullTokenizer
text that is not integer ids in [0, vocab)) are skipped, counted and reported as
``file:line: reason``; a record is kept only if every key is good, so the datasets of several
keys stay aligned. When no record is usable, or every usable record's text is empty for some key,
nothing is written (DataError). The files are written under temporary names, removed on any error
(in a worker process too, or on KeyboardInterrupt).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from ..config import TOKENIZER_TYPES, DataConfig
from ..errors import ConfigError, DataError
from ..folders import space_errors_named
from .indexed import IndexedDatasetWriter, token_dtype
from .outputs import check_output_file
from .records import BadRecords, check_inputs, check_json_keys, iter_records, parse_record, text_bytes_bound
from .tokenizer import TOKENIZER_FIELDS, build_tokenizer

CHUNK_BYTES = 1 << 20  # records are sent to workers in chunks of about this many bytes


@dataclass
class PreprocessStats:
    """What a preprocessing run did. seconds: wall time; outputs: the written prefixes."""

    documents: int = 0
    tokens: int = 0
    bad: BadRecords = field(default_factory=BadRecords)
    seconds: float = 0.0
    bytes_read: int = 0
    outputs: list = field(default_factory=list)


_worker_state = {}


def _init_worker(tokenizer, keys, append_eod, in_pool=False):
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops the pool
    _worker_state.update(tok=tokenizer, keys=keys, append_eod=append_eod)


def _encode_chunk(chunk):
    """Tokenize a chunk of records → (list of per-key id lists of good records, bad messages, bytes,
    per-key text tokens: the ids before any appended eod)."""
    tok, keys, append_eod = _worker_state["tok"], _worker_state["keys"], _worker_state["append_eod"]
    good, bad, nbytes, text_tokens = [], [], 0, [0] * len(keys)
    for path, line, raw, is_json in chunk:
        nbytes += len(raw)
        try:
            ids = tok.encode_batch(parse_record(raw, is_json, keys))
        except (ValueError, TypeError) as e:  # BadRecord, or text the tokenizer cannot encode
            bad.append(f"{path}:{line}: {e}")
            continue
        text_tokens = [t + len(x) for t, x in zip(text_tokens, ids)]
        if append_eod:  # not to an empty document, which adds no sequence (Megatron's preprocess_data.py)
            ids = [x + [tok.eod] if x else x for x in ids]
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


def _progress(total_bytes: Optional[int], quiet: bool):
    """A progress bar over ``total_bytes`` of text (None: unknown, a .gz input)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(TextColumn("[bold]preprocess"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                        TextColumn("{task.fields[docs]:,} docs {task.fields[dps]:,.0f} docs/s "
                                   "{task.fields[tps]:,.0f} tokens/s"), TimeElapsedColumn(),
                        console=console, disable=quiet or not console.is_terminal)
    total = None if total_bytes is None else max(total_bytes, 1)
    return progress, progress.add_task("", total=total, docs=0, dps=0.0, tps=0.0)


def preprocess_files(inputs, output_prefix: str, tok_cfg, vocab_size=None, json_keys=("text",),
                     append_eod: bool = False, workers: int = 1, quiet: bool = False,
                     log_interval: Optional[int] = None) -> PreprocessStats:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx``; return the stats.

    tok_cfg: tokenizer fields (tokenizer_type, tokenizer_model, vocab_file, merge_file), e.g. a
    DataConfig. workers > 1 tokenizes in a process pool (order of documents is kept).
    log_interval: off a terminal (no progress bar), a progress line on stderr each time this many
    more documents are done (Megatron's --log-interval); None: none.
    Raises ConfigError for bad flags or an output that cannot be written, DataError when an input
    is missing, no record at all is usable, or every usable record's text is empty for some key; on
    any error nothing is written and no temporary file is left.
    """
    check_inputs(inputs)
    keys = check_json_keys(json_keys)
    if output_prefix.endswith(("/", os.sep)) or os.path.basename(output_prefix) in ("", ".", ".."):
        raise ConfigError(f"--output-prefix {output_prefix} names a folder: the files would be named "
                          f"{output_prefix}_{keys[0]}_document.bin/.idx; give a file prefix in it, e.g. "
                          f"--output-prefix {os.path.join(output_prefix, 'web')}")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: use 1 or more tokenizer processes")
    if log_interval is not None and log_interval < 1:
        raise ConfigError(f"--log-interval {log_interval}: use 1 or more documents between progress lines")
    tok_cfg = SimpleNamespace(**{k: getattr(tok_cfg, k, None) for k in TOKENIZER_FIELDS})
    tokenizer = build_tokenizer(tok_cfg, vocab_size)
    prefixes = [f"{output_prefix}_{key}_document" for key in keys]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            check_output_file(prefix + suffix, f"--output-prefix {output_prefix}", inputs)
    writers, folder = [], os.path.dirname(os.path.abspath(output_prefix))
    try:  # a full disk: one line naming --output-prefix; on any error the partial files are removed
        with space_errors_named(f"--output-prefix {output_prefix}", folder):
            for prefix in prefixes:
                writers.append(IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size)))
            stats, text_tokens = _write(inputs, writers, tokenizer, keys, append_eod, workers, quiet, log_interval)
            _check_written(inputs, stats, keys, text_tokens)
            for writer in writers:
                writer.finalize()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    stats.outputs = prefixes
    return stats


def pool_size(workers: int, total_bytes: int, cores: Optional[int] = None) -> int:
    """Tokenizer processes worth starting for --workers: no more than the input's chunks of
    CHUNK_BYTES (an extra process would get no work) nor than this machine's usable cores (it would
    only take turns on them, holding its own tokenizer): ``--workers 100000`` started 100000
    processes for a 30 KiB file and ran for half an hour."""
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(workers, -(-total_bytes // CHUNK_BYTES), cores))


def _write(inputs, writers, tokenizer, keys, append_eod, workers, quiet, log_interval=None) -> tuple:
    """Tokenize every record into the writers → (stats, per-key count of text tokens)."""
    stats = PreprocessStats()
    start = time.perf_counter()
    total = sum(text_bytes_bound(p) for p in inputs)  # the bytes of text; a bound of them for a .gz
    used = pool_size(workers, total)
    if used < workers and not quiet:
        print(f"preprocess: note: --workers {workers}: using {used} tokenizer process(es), as many as the input's "
              f"{-(-total // CHUNK_BYTES)} chunk(s) of {CHUNK_BYTES >> 20} MiB and this machine's cores allow",
              file=sys.stderr, flush=True)
    workers = used
    progress, task = _progress(None if any(p.endswith(".gz") for p in inputs) else total, quiet)
    text_tokens = [0] * len(keys)
    lines = log_interval if log_interval and not quiet and progress.disable else None
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context().Pool(workers, _init_worker, (tokenizer, keys, append_eod, True))
        results = pool.imap(_encode_chunk, _chunks(iter_records(inputs)))
    else:
        _init_worker(tokenizer, keys, append_eod)
        results = map(_encode_chunk, _chunks(iter_records(inputs)))
    try:
        with progress:
            for good, bad, nbytes, chunk_tokens in results:
                text_tokens = [t + c for t, c in zip(text_tokens, chunk_tokens)]
                for ids in good:
                    for writer, doc in zip(writers, ids):
                        if doc:
                            writer.add_document(doc)
                        else:
                            writer.add_empty_document()
                    stats.tokens += len(ids[0])
                stats.documents += len(good)
                stats.bad.add(bad)
                stats.bytes_read += nbytes
                dt = max(time.perf_counter() - start, 1e-9)
                progress.update(task, advance=nbytes, docs=stats.documents, dps=stats.documents / dt,
                                tps=stats.tokens / dt)
                if lines and stats.documents // lines > (stats.documents - len(good)) // lines:
                    print(f"preprocess: {stats.documents:,} documents, {stats.documents / dt:,.0f} docs/s, "
                          f"{stats.tokens / dt:,.0f} tokens/s", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.terminate()
    stats.seconds = time.perf_counter() - start
    return stats, text_tokens


def _check_written(inputs, stats: PreprocessStats, keys, text_tokens) -> None:
    """DataError when no record was usable, or every usable record was empty for some key."""
    if stats.documents == 0:
        first = stats.bad.messages[0] if stats.bad.messages else "the inputs are empty"
        raise DataError(f"--input {' '.join(inputs)}: no usable record ({stats.bad.count} bad); first: {first}")
    empty_keys = [key for key, t in zip(keys, text_tokens) if t == 0]
    if empty_keys:
        raise DataError(f"--input {' '.join(inputs)}: 0 tokens written: every record's "
                        f"{', '.join(repr(k) for k in empty_keys)} was empty, so nothing was written; "
                        f"give files with text (or other --json-keys)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshlm preprocess`` (Megatron's tools/preprocess_data.py names)."""
    parser.add_argument("--input", nargs="+", action="extend", required=True,
                        help="jsonl files (one JSON object per line: *.jsonl, *.json or a first line that is one) or "
                             "plain-text files (one document each)")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--json-keys", nargs="+", action="extend", default=None,
                        help="jsonl fields to tokenize (default: text)")
    parser.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None,
                        help="tokenizer.json, SentencePiece .model or tiktoken vocabulary .json")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="NullTokenizer vocabulary size; TikTokenizer's (default 131072)")
    parser.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                        help="TikTokenizer split pattern (default v2)")
    parser.add_argument("--tiktoken-num-special-tokens", type=int, default=DataConfig.tiktoken_num_special_tokens,
                        help="TikTokenizer: ids 0..N-1 are special tokens")
    parser.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                        help="TikTokenizer: the first special tokens")
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=None,
                        help="documents between progress lines when stderr is not a terminal (a terminal "
                             "shows a progress bar) [default: no lines]")
    parser.add_argument("--partitions", type=int, default=1,
                        help="accepted with no effect: meshlm reads the inputs once and spreads the "
                             "tokenizing over --workers processes, writing one .bin/.idx per key")
    parser.add_argument("--keep-newlines", action="store_true",
                        help="accepted with no effect: it only matters with --split-sentences (each "
                             "document's text is tokenized as it is, newlines kept)")
    parser.add_argument("--split-sentences", action="store_true",
                        help="refused: meshlm does not split documents into sentences")
    parser.add_argument("--lang", default="english",
                        help="accepted with no effect: the sentence splitter's language (no --split-sentences here)")
    parser.add_argument("--keep-sequential-samples", action="store_true",
                        help="accepted with no effect: documents are always written in input order")


def report(stats: PreprocessStats) -> None:
    """Print the bad records shown (stderr) and the summary line (stdout)."""
    stats.bad.print()
    rate = stats.tokens / max(stats.seconds, 1e-9)
    print(f"preprocessed {stats.documents:,} documents, {stats.tokens:,} tokens in {stats.seconds:.1f} s "
          f"({rate:,.0f} tokens/s), skipped {stats.bad.count:,} bad records → "
          f"{', '.join(p + '.bin/.idx' for p in stats.outputs)}")


def run(args: argparse.Namespace) -> int:
    """``meshlm preprocess``: returns 0 when a dataset was written (DataError otherwise).
    Raises ConfigError for --split-sentences (Megatron's sentence splitting, which meshlm lacks) and a
    --partitions below 1."""
    if args.split_sentences:
        raise ConfigError("--split-sentences: meshlm does not split documents into sentences; drop it to "
                          "tokenize each document whole (split the text into sentences first if you need them)")
    if args.partitions < 1:  # Megatron's own domain; the value changes nothing here beyond that
        raise ConfigError(f"--partitions {args.partitions}: use 1 or more (meshlm reads the inputs once "
                          f"whatever the value; drop the flag)")
    from .tokenizer import half_gpt2_problem, ignored_tokenizer_files, ignored_vocab_size
    half = half_gpt2_problem(args)
    if half:
        raise ConfigError(half)
    for ignored in (ignored_vocab_size(args, args.vocab_size), ignored_tokenizer_files(args, args.vocab_size)):
        if ignored:
            print(f"meshlm: note: {ignored}", file=sys.stderr, flush=True)
    stats = preprocess_files(args.input, args.output_prefix, args, args.vocab_size, args.json_keys,
                             args.append_eod, args.workers, log_interval=args.log_interval)
    report(stats)
    return 0
