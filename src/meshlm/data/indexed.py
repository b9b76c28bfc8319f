"""Megatron's indexed dataset: token ids in ``{prefix}.bin``, their layout in ``{prefix}.idx``.

``.bin`` holds the ids of every sequence back to back (one dtype, no header). ``.idx`` is, all
little-endian: the magic ``MMIDIDX\\0\\0`` (9 bytes), uint64 version 1, uint8 dtype code, uint64 N
(sequences), uint64 D (documents + 1), then int32[N] sequence lengths (tokens), int64[N] byte
offsets into .bin, int64[D] document index (document k = sequences [di[k], di[k+1])).
Files written here open with megatron-core's ``IndexedDataset`` and vice versa.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from typing import Optional

import numpy as np

from ..errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def _malformed(path: str, why: str) -> DataError:
    """The one-line error for a .bin/.idx that cannot be used as it is."""
    return DataError(f"{path} {why}: not a valid Megatron indexed dataset; "
                     f"re-run `meshlm preprocess` to rebuild it")


def token_dtype(vocab_size: int) -> type:
    """Megatron's preprocessing convention: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Stream documents into ``{prefix}.bin/.idx``; one document is one sequence, an empty one
    (:meth:`add_empty_document`) none.

    The files appear under their final names only in ``finalize()`` (written as ``*.tmp``, then
    renamed), so a crash never leaves a half-written dataset that looks complete.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self._lengths = array("q")  # 8 bytes a document, not a Python int's 36: 10^8 documents fit in RAM
        self._documents = array("q", [0])  # document k is sequences [_documents[k], _documents[k + 1])

    def add_document(self, ids) -> None:
        """Append one document as one sequence (a list or array of token ids; an empty one makes a
        sequence of length 0)."""
        arr = np.asarray(ids, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)
        self._documents.append(len(self._lengths))

    def add_empty_document(self) -> None:
        """Append a document without tokens as Megatron's preprocess_data.py does: an entry in the
        document index, no sequence (and no appended eod)."""
        self._documents.append(len(self._lengths))

    def abort(self) -> None:
        """Drop everything written so far: no temporary file is left behind (safe to call twice,
        or after a failed ``finalize``)."""
        self._bin.close()
        for tmp in (self.prefix + ".bin.tmp", self.prefix + ".idx.tmp"):
            if os.path.exists(tmp):
                os.remove(tmp)

    def finalize(self) -> None:
        """Write the .idx and move both files to their final names."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, np.int64).astype(np.int32)
        n = lengths.size
        pointers = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._documents, np.int64)
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", n))
            f.write(struct.pack("<Q", documents.size))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")


class IndexedDataset:
    """Read-only view of ``{prefix}.bin/.idx`` through numpy memory maps.

    ``len(ds)`` = number of sequences; ``ds[i]`` = sequence i as a numpy array of the file's
    dtype. Attributes: ``sequence_lengths`` int32[N] (tokens), ``sequence_pointers`` int64[N]
    (bytes), ``document_indices`` int64[D], ``dtype``. Raises a one-line DataError naming the file
    if either file is missing, unreadable, empty, truncated or not an indexed dataset, or if the
    .bin size (bytes) differs from the end of the last sequence the .idx points at.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        for ext in (".idx", ".bin"):
            if not os.path.isfile(prefix + ext):
                raise DataError(f"{prefix + ext} does not exist (run `meshlm preprocess` to make it)")
        try:
            self._read_index(prefix + ".idx")
            nbytes = os.path.getsize(prefix + ".bin")
            self._check_bin(prefix + ".bin", nbytes)
            self._bin = np.memmap(prefix + ".bin", dtype=np.uint8, mode="r") if nbytes else np.zeros(0, np.uint8)
        except OSError as e:
            raise DataError(f"{e.filename}: cannot read it ({e.strerror})") from None

    def _read_index(self, path: str) -> None:
        """Memory-map and validate the .idx; set dtype and the three index arrays."""
        size = os.path.getsize(path)
        if size == 0:
            raise _malformed(path, "is empty")
        with open(path, "rb") as f:
            head = f.read(_HEADER)
        if head[:len(MAGIC)] != MAGIC[:len(head)]:
            raise _malformed(path, "has a bad magic (expected MMIDIDX)")
        if size < _HEADER:
            raise _malformed(path, f"is truncated ({size} bytes, shorter than the {_HEADER}-byte header)")
        idx = np.memmap(path, dtype=np.uint8, mode="r")
        version, code, n, d = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION or code not in DTYPE_CODES:
            raise _malformed(path, f"has unsupported version {version} or dtype code {code}")
        expected = _HEADER + 12 * n + 8 * d
        if size != expected:
            what = "is truncated" if size < expected else "is longer than its header says"
            raise _malformed(path, f"{what} ({size} bytes; {n} sequences and {d} document bounds need {expected})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_lengths = np.frombuffer(idx, np.int32, n, _HEADER)
        self.sequence_pointers = np.frombuffer(idx, np.int64, n, _HEADER + 4 * n)
        self.document_indices = np.frombuffer(idx, np.int64, d, _HEADER + 12 * n)
        if n and (self.sequence_lengths.min() < 0 or self.sequence_pointers.min() < 0):
            raise _malformed(path, "has a negative sequence length or pointer")
        di = self.document_indices
        if d == 0 or di[0] != 0 or di[-1] != n or (np.diff(di) < 0).any():
            raise _malformed(path, f"has a document index that does not cover sequences [0, {n}) in order")

    def _check_bin(self, path: str, nbytes: int) -> None:
        """The .bin must end exactly where the last-ending sequence of the .idx ends (bytes)."""
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        need = int(ends.max()) if ends.size else 0
        if nbytes == need:
            return
        if nbytes == 0:
            raise _malformed(path, f"is empty but its .idx points at {need} bytes")
        what = "is truncated" if nbytes < need else "is longer than its .idx says"
        raise _malformed(path, f"{what} ({nbytes} bytes, the .idx needs {need}): .bin and .idx do not match")

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start) if length else np.zeros(0, self.dtype)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    @property
    def num_tokens(self) -> int:
        """Tokens in all sequences."""
        return int(self.sequence_lengths.sum(dtype=np.int64))


SCAN_CHUNK_BYTES = 64 << 20  # token_range reads a .bin in pieces of this size


def _range_record(ds: "IndexedDataset", cache_dir: Optional[str]) -> str:
    """Where ``token_range`` keeps ds's id range: the index cache (default beside the data,
    ``<folder>/cache/GPTDataset_indices``), under a key of the .bin's path, size and modification time."""
    path = os.path.abspath(ds.prefix + ".bin")
    st = os.stat(path)
    key = hashlib.md5(f"{path}|{st.st_size}|{st.st_mtime_ns}|{ds.dtype}".encode(), usedforsecurity=False).hexdigest()
    folder = cache_dir or os.path.join(os.path.dirname(path), "cache", "GPTDataset_indices")
    return os.path.join(folder, f"{key}-token-range.json")


def recorded_range(ds: "IndexedDataset", cache_dir: Optional[str] = None) -> Optional[tuple]:
    """(smallest, largest) id of ds's .bin as an earlier scan recorded it, or None."""
    try:
        with open(_range_record(ds, cache_dir)) as fh:
            saved = json.load(fh)
        return int(saved["min"]), int(saved["max"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_range(ds: "IndexedDataset", found: tuple, cache_dir: Optional[str] = None) -> None:
    """Keep ``found`` for the next start (atomically); a cache folder that cannot be written keeps none."""
    record = _range_record(ds, cache_dir)
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        tmp = f"{record}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"bin": os.path.abspath(ds.prefix + ".bin"), "min": found[0], "max": found[1]}, fh)
        os.replace(tmp, record)
    except OSError:
        pass


def scan_range(ds: "IndexedDataset", part: int = 0, parts: int = 1) -> tuple:
    """(smallest, largest) id over the ``part``-th of ``parts`` interleaved shares of ds's .bin
    (pieces of SCAN_CHUNK_BYTES: piece i goes to share i mod parts), so that the ranks of a job read
    a corpus together; (iinfo max, iinfo min) of int64 for a share with no piece."""
    data = np.frombuffer(ds._bin, ds.dtype, ds._bin.size // ds.dtype.itemsize)
    chunk = SCAN_CHUNK_BYTES // ds.dtype.itemsize
    ranges = [(int(data[i:i + chunk].min()), int(data[i:i + chunk].max()))
              for i in range(part * chunk, data.size, parts * chunk)]
    big = np.iinfo(np.int64)
    return min((r[0] for r in ranges), default=big.max), max((r[1] for r in ranges), default=big.min)


def token_range(ds: "IndexedDataset", cache_dir: Optional[str] = None) -> tuple:
    """(smallest, largest) token id of ds's .bin ((0, -1) when empty): the recorded range, else one
    scan, then recorded (``record_range``), so a start reads a terabyte of tokens once, not every time."""
    found = recorded_range(ds, cache_dir)
    if found is None:
        lo, hi = scan_range(ds)
        found = (0, -1) if hi < lo else (lo, hi)
        record_range(ds, found, cache_dir)
    return found


def check_token_ids(prefixes, vocab_size: int, null_tokenizer: bool = False, sized_by_flag: bool = False,
                    cache_dir: Optional[str] = None, ranges: Optional[dict] = None) -> None:
    """Raise DataError naming the .bin file and its largest id if any id is ≥ vocab_size, or its
    smallest if any id is negative (an int32 file holding -1 or -100 pads trained on them silently:
    the vocabulary-parallel embedding maps an id outside its rows to a zero vector).

    prefixes: indexed-dataset prefixes (without .bin/.idx). Reads each .bin in 64 MiB chunks, once:
    ``token_range`` keeps the result in ``cache_dir`` (--data-cache-path) for the next start.
    ranges: {prefix: (smallest, largest)} already found (the trainer's ranks scan shares together).
    null_tokenizer: the run's NullTokenizer: a largest id of exactly vocab_size is data made by
    megatron-core 0.16.1's NullTokenizer (eod = --vocab-size, one id more), and the line says so.
    sized_by_flag: the vocabulary is --vocab-size's (NullTokenizer, TikTokenizer), so a larger one is a
    fix the line may name; other tokenizers' files fix their vocabulary (--vocab-size changes nothing).
    A tokenizer file with more ids than the .bin's dtype holds (uint16 for 128,256 ids) is a DataError
    too: preprocessing with it writes int32 (:func:`token_dtype`), so the data is another tokenizer's
    even when every id is in range (GPT-2 ids read by a Llama 3 tokenizer trained without a word).
    """
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        most = np.iinfo(ds.dtype).max if ds.dtype.kind in "iu" else None
        if not (null_tokenizer or sized_by_flag) and most is not None and vocab_size - 1 > most:
            raise DataError(f"{prefix}.bin stores token ids as {ds.dtype} (at most {most:,}) but the tokenizer has "
                            f"{vocab_size:,} ids: the data was made by another tokenizer (preprocessing with this "
                            f"one writes int32); preprocess it with the run's tokenizer")
        smallest, largest = ranges[prefix] if ranges and prefix in ranges else token_range(ds, cache_dir)
        if smallest < 0:
            raise DataError(f"{prefix}.bin holds token id {smallest}, a negative id (no token has one; a padding "
                            f"or ignore label?); write the data with `meshlm preprocess` or without such ids")
        if null_tokenizer and largest == vocab_size:
            raise DataError(f"{prefix}.bin holds token id {largest} = --vocab-size: data made by megatron-core "
                            f"0.16.1's NullTokenizer (end-of-document id {vocab_size}, {vocab_size + 1} ids); "
                            f"Megatron-LM's current convention and meshlm's has ids 0..{vocab_size - 1} (eod "
                            f"{vocab_size - 1}): load it with --vocab-size {vocab_size + 1}")
        if largest >= vocab_size:
            raise DataError(f"{prefix}.bin holds token id {largest} but the vocabulary has {vocab_size} "
                            f"ids; use the tokenizer the data was preprocessed with" +
                            (f" (or --vocab-size {largest + 1} or more)" if null_tokenizer or sized_by_flag else ""))
