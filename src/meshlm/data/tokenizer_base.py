"""The tokenizer interface, and the file checks every tokenizer module shares.

:class:`Tokenizer` is what data/tokenizer.py and data/tokenizers_extra.py build; ``require_path``
and ``file_digest`` check and name the files they read.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from ..errors import ConfigError, DataError

# built by .tokenizers_extra (one SentencePiece tokenizer under three names, as in Megatron)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


class Tokenizer:
    """A text ↔ id mapping. ``vocab_size`` is the largest id + 1 (added tokens included); ``eod`` is the
    end-of-document id; ``identity`` is a short string naming the tokenizer (used in cache names);
    ``pad`` the padding id whose labels the loss leaves out (-1: none; data/packing.py)."""

    pad = -1

    def __init__(self, vocab_size: int, eod: int, identity: str):
        self.vocab_size = vocab_size
        self.eod = eod
        self.identity = identity

    def encode(self, text: str) -> list:
        """Token ids of text (no eod appended)."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of a sequence of ids."""
        raise NotImplementedError

    def encode_batch(self, texts: list) -> list:
        """Encode many texts; subclasses may parallelise."""
        return [self.encode(t) for t in texts]


def file_digest(*paths: str) -> str:
    """12 hex digits of the MD5 of the files' bytes (names a tokenizer in cache identities)."""
    h = hashlib.md5(usedforsecurity=False)
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def require_path(path: Optional[str], flag: str) -> str:
    """path, if given (else ConfigError naming flag) and present (else DataError)."""
    if not path:
        raise ConfigError(f"{flag} is required by this --tokenizer-type")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: no such file")
    return path
