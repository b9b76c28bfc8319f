"""SentencePiece and tiktoken tokenizers, with the semantics of Megatron-LM's current tokenizers
(``megatron.core.tokenizers``: what ``--tokenizer-type`` builds since Megatron removed its legacy
tokenizer module; megatron-core 0.16.1 behaves the same and is the peer in the tests).

- ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer`` (one tokenizer under
  three names, as in Megatron): ``--tokenizer-model`` is a SentencePiece ``.model`` file. The ids
  are the model's pieces (vocab size = its piece count), ``encode`` adds neither BOS nor EOS, and
  the end-of-document id is the model's EOS id. (Megatron's removed legacy classes differed: its
  Llama2Tokenizer prepended BOS, its SentencePieceTokenizer appended <CLS>/<SEP>/<EOD>/<MASK> ids.)
- ``TikTokenizer``: ``--tokenizer-model`` is Megatron's JSON vocabulary — a list whose entry i is
  ``{"rank": i, "token_bytes": base64 of the token's bytes, "token_str": text}``, entries 0..255
  the single bytes 0..255, ranks in merge order. The vocabulary is ``--vocab-size`` ids (default
  2**17): ids 0..N−1 are the special tokens (N = ``--tiktoken-num-special-tokens``, default 1000;
  ``--tokenizer-special-tokens`` first, default <unk> <s> </s> <mask> <pad> <cls> <sep>, then
  ``<SPECIAL_k>`` fillers), id N + r is the entry of rank r (the JSON is cut to vocab − N entries
  and must hold that many). Text is split by ``--tiktoken-pattern`` v1 or v2 (default v2); special
  tokens written in the text are encoded as their ids; no BOS/EOS is added; eod = the id of </s>.

The libraries are optional: asking for one of these types without its package is a ConfigError
naming the package.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Optional

from ..errors import ConfigError, DataError
from .tokenizer_base import SENTENCEPIECE_TYPES, Tokenizer, file_digest, require_path

# Megatron's split patterns (megatron.core.tokenizers.text.libraries.tiktoken_tokenizer)
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2 ** 17


def _library(name: str, kind: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"--tokenizer-type {kind} needs the {name} package: pip install {name}") from None


def _readable(path: str, kind: str) -> str:
    """--tokenizer-model path (of --tokenizer-type ``kind``) when it is a file this process can read;
    ConfigError when not given, DataError otherwise."""
    path = require_path(path, "--tokenizer-model", kind)
    if os.path.isdir(path):
        raise DataError(f"--tokenizer-model {path}: is a folder; give the model file in it")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise DataError(f"--tokenizer-model {path}: cannot read it ({e.strerror})") from None
    return path


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model: ids = its pieces, eod = its EOS id, no BOS/EOS added by encode."""

    def __init__(self, path: str, kind: str = "SentencePieceTokenizer"):
        spm = _library("sentencepiece", kind)
        path = _readable(path, kind)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            hint = " (a tokenizer.json is read by --tokenizer-type HuggingFaceTokenizer)" \
                if path.endswith(".json") else ""
            raise DataError(f"--tokenizer-model {path}: not a SentencePiece model ({str(e)[:120]}); "
                            f"{kind} reads the .model file SentencePiece training writes{hint}") from None
        eos = self._sp.eos_id()
        if eos < 0:
            raise DataError(f"--tokenizer-model {path}: the SentencePiece model has no EOS piece, which "
                            f"{kind} uses as the end-of-document id; train it with an eos_id")
        super().__init__(self._sp.get_piece_size(), eos, f"SP:{os.path.basename(path)}:{file_digest(path)}")
        self.bos, self.pad = self._sp.bos_id(), self._sp.pad_id()  # pad -1: none (Megatron's pad)

    def encode(self, text: str) -> list:
        return self._sp.encode(text)

    def encode_batch(self, texts: list) -> list:
        return self._sp.encode(list(texts))

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def _special_tokens(special: Optional[list], num_special: int, vocab_size: int) -> list:
    """All N special tokens in id order (given ones, then fillers); ConfigError on Megatron's rules."""
    special = list(special) if special else list(TIKTOKEN_SPECIAL_TOKENS)
    dup = sorted({t for t in special if special.count(t) > 1})
    if dup:
        raise ConfigError(f"--tokenizer-special-tokens: {' '.join(dup)} given twice; each token once")
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
    if missing:
        raise ConfigError(f"--tokenizer-special-tokens must include {' '.join(TIKTOKEN_SPECIAL_TOKENS)} "
                          f"(as Megatron's TikTokenizer); add {' '.join(missing)}")
    if not len(special) <= num_special < vocab_size:
        raise ConfigError(f"--tiktoken-num-special-tokens {num_special}: needs at least the {len(special)} "
                          f"special tokens and fewer than --vocab-size {vocab_size}")
    return special + [f"<SPECIAL_{i}>" for i in range(len(special), num_special)]


def load_tiktoken_vocab(path: str, max_entries: int) -> dict:
    """Megatron's TikTokenizer JSON vocabulary, cut to its first ``max_entries`` entries, as
    {token bytes: rank}. DataError naming the file and the first bad entry: not a JSON list, an
    entry without exactly the keys rank/token_bytes/token_str, a rank that is not its index, bad
    base64, entry i < 256 other than the byte i, a token given twice, or fewer than max_entries."""
    path = _readable(path, "TikTokenizer")
    what = (f"TikTokenizer reads Megatron's JSON vocabulary (a list of {{\"rank\", \"token_bytes\", "
            f"\"token_str\"}}), not")
    if not path.endswith(".json"):
        raise DataError(f"--tokenizer-model {path}: {what} this file (Megatron needs a .json name)")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"--tokenizer-model {path}: {what} this ({str(e)[:80]})") from None
    if not isinstance(vocab, list):
        raise DataError(f"--tokenizer-model {path}: {what} a JSON {type(vocab).__name__}")
    ranks = {}
    for i, entry in enumerate(vocab[:max_entries]):
        where = f"--tokenizer-model {path}: entry {i}"
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"}:
            raise DataError(f"{where} is not {{\"rank\", \"token_bytes\", \"token_str\"}}")
        if entry["rank"] != i:
            raise DataError(f"{where} has rank {entry['rank']!r}; entry i must have rank i")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise DataError(f"{where}: token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise DataError(f"{where} must be the single byte {i} (entries 0..255 are the bytes)")
        if token in ranks:
            raise DataError(f"{where} repeats the token of entry {ranks[token]}")
        ranks[token] = i
    if len(ranks) < max_entries:
        raise DataError(f"--tokenizer-model {path}: holds {len(vocab)} tokens, fewer than the "
                        f"{max_entries} that --vocab-size less --tiktoken-num-special-tokens asks for; "
                        f"lower --vocab-size to {len(vocab)} + the special tokens")
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer (module docstring): special tokens at ids 0..N−1, BPE ranks from N."""

    def __init__(self, path: str, vocab_size: Optional[int] = None, pattern: Optional[str] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[list] = None):
        tiktoken = _library("tiktoken", "TikTokenizer")
        vocab_size = vocab_size or TIKTOKEN_DEFAULT_VOCAB
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise ConfigError(f"--tiktoken-pattern {pattern}: use v1 or v2")
        special = _special_tokens(special_tokens, num_special_tokens, vocab_size)
        ranks = load_tiktoken_vocab(path, vocab_size - num_special_tokens)
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
                                      mergeable_ranks=shifted, special_tokens={t: i for i, t in enumerate(special)})
        identity = (f"TikToken:{os.path.basename(path)}:{file_digest(path)}:{pattern}:{vocab_size}:"
                    f"{num_special_tokens}:{','.join(special_tokens or [])}")
        super().__init__(vocab_size, special.index("</s>"), identity)
        self.bos, self.pad = special.index("<s>"), special.index("<pad>")  # Megatron's pad: <pad>

    def encode(self, text: str) -> list:
        return self._enc.encode(text, allowed_special="all")

    def encode_batch(self, texts: list) -> list:
        return self._enc.encode_batch(list(texts), allowed_special="all")

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def build_extra(kind: str, data_cfg, vocab_size: Optional[int]) -> Tokenizer:
    """The tokenizer of a SentencePiece or tiktoken ``--tokenizer-type`` (flags read from
    ``data_cfg``; absent fields take their defaults). ConfigError / DataError as the classes raise."""
    special = getattr(data_cfg, "tokenizer_special_tokens", None)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(data_cfg.tokenizer_model, kind)
    num_special = getattr(data_cfg, "tiktoken_num_special_tokens", None)
    return TikTokenizer(data_cfg.tokenizer_model, vocab_size, getattr(data_cfg, "tiktoken_pattern", None),
                        **({} if num_special is None else {"num_special_tokens": num_special}),
                        special_tokens=special)


__all__ = ["SentencePieceTokenizer", "TikTokenizer", "build_extra", "load_tiktoken_vocab", "TIKTOKEN_PATTERNS", "TIKTOKEN_SPECIAL_TOKENS"]
