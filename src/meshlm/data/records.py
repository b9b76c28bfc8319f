"""The records of corpus files, as ``meshlm preprocess`` and ``meshlm tokenizer train`` read them.

``*.jsonl`` / ``*.json`` files, and any file whose first non-blank line is a JSON object (Megatron
reads every --input so: ``xaa`` from ``split -l``, ``*.ndjson``), hold one JSON object per line
(blank lines are ignored), each key of ``--json-keys`` a string; any other file is plain text and
is ONE record (the whole file). A file's leading UTF-8 byte order mark is dropped. A ``*.gz`` file is
read decompressed (Megatron's preprocess_data.py reads gzip inputs too), named by its name without .gz.
A record that cannot be used (bytes that are not UTF-8, invalid JSON, not an object, a missing
key, a non-string value, a lone surrogate such as ``"\\ud800"``) raises :class:`BadRecord`; the
commands skip it, count it in :class:`BadRecords` and report it as ``file:line: reason``.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from ..errors import ConfigError, DataError

SHOW_BAD = 10  # bad records printed one by one; the rest are only counted
JSON_EXTS = (".jsonl", ".json")
GZIP_RATIO = 1032  # deflate's largest compression ratio: a .gz file's text is at most this × its size
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


class BadRecord(ValueError):
    """A record that cannot be used; the message is the reason."""


@dataclass
class BadRecords:
    """The bad records of a run: how many, and the first :data:`SHOW_BAD` as ``file:line: reason``."""

    count: int = 0
    messages: list = field(default_factory=list)

    def add(self, messages: list) -> None:
        """Count these messages; keep them while fewer than SHOW_BAD are kept."""
        self.count += len(messages)
        self.messages.extend(messages[:SHOW_BAD - len(self.messages)])

    def print(self) -> None:
        """Print the kept messages and how many more there were, on stderr."""
        for msg in self.messages:
            print(f"bad record: {msg}", file=sys.stderr)
        if self.count > len(self.messages):
            print(f"... and {self.count - len(self.messages):,} more bad records", file=sys.stderr)


def check_inputs(paths) -> None:
    """DataError naming the first --input that is not an existing file."""
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--input {path} is a directory; give the files in it")
        if not os.path.isfile(path):
            raise DataError(f"--input {path}: no such file")


def check_json_keys(keys) -> tuple:
    """--json-keys as a tuple (None: the flag not given, ("text",)); ConfigError when a key is named
    twice."""
    keys = ("text",) if keys is None else keys
    twice = [k for k, n in Counter(keys).items() if n > 1]
    if twice:
        raise ConfigError(f"--json-keys {' '.join(keys)}: {twice[0]!r} is named twice; name each key once")
    return tuple(keys)


def _json_lines(f, path: str) -> bool:
    """Whether the open file ``f`` holds JSON lines: its name says so, or its first non-blank line
    is a JSON object (read only when it starts with "{"). Leaves ``f`` where it was."""
    if path.removesuffix(".gz").endswith(JSON_EXTS):
        return True
    start = f.tell()
    line = b""
    for line in f:
        if line.strip():
            break
    f.seek(start)
    if not line.lstrip().startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def iter_records(paths):
    """Yield (path, line number, raw bytes, is_json) for every record of the inputs, in order.

    A UTF-8 byte order mark at the start of a file (Windows editors write one) is not part of its
    first record. Raises DataError naming the file when one cannot be read.
    """
    for path in paths:
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
                if f.read(len(BOM)) != BOM:
                    f.seek(0)
                if not _json_lines(f, path):
                    yield path, 1, f.read(), False
                    continue
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield path, n, line, True
        except (OSError, EOFError) as e:  # EOFError, gzip.BadGzipFile: a damaged .gz
            raise DataError(f"--input {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def text_bytes_bound(path: str) -> int:
    """An upper bound of the bytes of text in ``path``: its size, or GZIP_RATIO × that for a .gz."""
    return os.path.getsize(path) * (GZIP_RATIO if path.endswith(".gz") else 1)


def _check_unicode(text: str, key: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord(f"{key!r} holds a lone surrogate {text[e.start]!r} at character {e.start}, "
                        f"which is not valid Unicode") from None
    return text


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
        texts.append(_check_unicode(obj[key], key))
    return texts


def iter_texts(paths, keys=("text",), bad: BadRecords | None = None):
    """Every good text of the inputs, in order: the BPE trainer's feed. Bad records are skipped and
    added to ``bad`` when given."""
    for path, line, raw, is_json in iter_records(paths):
        try:
            yield from parse_record(raw, is_json, keys)
        except BadRecord as e:
            if bad is not None:
                bad.add([f"{path}:{line}: {e}"])
