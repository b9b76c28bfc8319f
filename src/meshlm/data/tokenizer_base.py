"""The tokenizer interface, and the file checks every tokenizer module shares.

:class:`Tokenizer` is what data/tokenizer.py and data/tokenizers_extra.py build; ``require_path``
and ``file_digest`` check and name the files they read, ``missing_files`` the ones a type lacks.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from ..errors import ConfigError, DataError

# built by .tokenizers_extra (one SentencePiece tokenizer under three names, as in Megatron)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# the --tokenizer-model file each type reads, in words
MODEL_FILE = {"HuggingFaceTokenizer": "a tokenizer.json", "TikTokenizer": "Megatron's tiktoken vocabulary .json",
              **{kind: "a SentencePiece .model" for kind in SENTENCEPIECE_TYPES}}


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


def missing_files(kind: str) -> str:
    """The one line for --tokenizer-type ``kind`` given without the files it reads (pretrain's
    checks and every command that builds a tokenizer say the same)."""
    if kind == "GPT2BPETokenizer":
        return "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
    return f"--tokenizer-type {kind} needs --tokenizer-model ({MODEL_FILE[kind]})"


def require_path(path: Optional[str], flag: str, kind: str) -> str:
    """path, if given (else ConfigError: ``missing_files(kind)``) and present (else DataError naming flag)."""
    if not path:
        raise ConfigError(missing_files(kind))
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: no such file")
    return path
