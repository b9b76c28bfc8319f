"""Tokenizers by Megatron's ``--tokenizer-type``, and byte-level BPE training.

- ``HuggingFaceTokenizer``: a ``tokenizer.json`` (or a folder holding one) via the ``tokenizers``
  library; the end-of-document id is the ``eos_token`` of a ``tokenizer_config.json`` beside it,
  else the first of :data:`EOD_CANDIDATES` in the vocabulary.
- ``GPT2BPETokenizer``: GPT-2's ``vocab.json`` + ``merges.txt`` as a byte-level BPE; eod is
  ``<|endoftext|>``.
- ``NullTokenizer``: text is whitespace-separated integer ids in [0, vocab_size); eod =
  vocab_size − 1 (Megatron's null tokenizer instead adds one id past ``--vocab-size``).
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer`` and
  ``TikTokenizer``: in :mod:`.tokenizers_extra` (optional libraries sentencepiece, tiktoken).

``encode`` applies the tokenizer's own post-processor (e.g. a Llama BOS), as Megatron's
HuggingFaceTokenizer does; it never appends eod (preprocess ``--append-eod`` does).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from ..config import TOKENIZER_TYPES, Config
from ..errors import ConfigError, DataError
from ..folders import space_errors_named
from .outputs import check_output_file, replacing
from .records import BadRecords, check_inputs, check_json_keys, iter_texts, text_bytes_bound
from .tokenizer_base import MODEL_FILE, SENTENCEPIECE_TYPES, Tokenizer, file_digest, missing_files, require_path
from .tokenizers_extra import build_extra

EOD = "<|endoftext|>"
EOD_CANDIDATES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
EXTRA_TYPES = SENTENCEPIECE_TYPES + ("TikTokenizer",)
# what --tokenizer-model is, for the types that read it
_GPT2_VOCAB = 50257  # GPT-2's vocabulary: vocab_of's assumption for GPT2BPETokenizer without its files
# the DataConfig fields a tokenizer is built from
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "tiktoken_pattern",
                    "tiktoken_num_special_tokens", "tokenizer_special_tokens")


class HFTokenizer(Tokenizer):
    """Wraps a ``tokenizers.Tokenizer`` (HuggingFaceTokenizer and GPT2BPETokenizer). vocab_size is
    the largest id + 1: a tokenizer.json may leave ids unused (an added token at 70000 over 4 tokens),
    and its token count was then too small for the embedding and for the .bin dtype (preprocess ended
    in an OverflowError traceback)."""

    def __init__(self, tok, eod: int, identity: str):
        super().__init__(max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1, eod, identity)
        self._tok = tok

    def encode(self, text: str) -> list:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list) -> list:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer(Tokenizer):
    """Text is already ids: ``"5 17 3"`` ↔ [5, 17, 3], ids in [0, vocab_size).

    eod: the end-of-document id, default vocab_size − 1 (Megatron-LM's --null-tokenizer-eod-id;
    megatron-core 0.16.1's NullTokenizer had eod = vocab_size and vocab_size + 1 ids: its data
    loads here with --vocab-size N+1). pad: --null-tokenizer-pad-id (-1: none).
    """

    def __init__(self, vocab_size: int, eod: Optional[int] = None, pad: int = -1):
        eod = vocab_size - 1 if eod is None else eod
        identity = f"NullTokenizer:{vocab_size}" + (f":eod{eod}" if eod != vocab_size - 1 else "")
        super().__init__(vocab_size, eod, identity)
        self.pad = pad

    def encode(self, text: str) -> list:
        """The ids of text; ValueError naming the first word that is not an id in [0, vocab_size)."""
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise ValueError(f"{word[:20]!r} is not an integer token id") from None
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            ids.append(i)
        return ids

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _config_eos(config: str) -> Optional[str]:
    """The ``eos_token`` of a tokenizer_config.json (None if it names none); DataError naming the
    file when it is not a JSON object or eos_token is neither a string nor {"content": string}."""
    fix = "fix it or remove it"
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{config}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}") from None
    except UnicodeDecodeError:
        raise DataError(f"{config}: not UTF-8 text; {fix}") from None
    except OSError as e:
        raise DataError(f"{config}: cannot read it ({e.strerror}); {fix}") from None
    if not isinstance(data, dict):
        raise DataError(f"{config}: expected a JSON object, got {type(data).__name__}; {fix}")
    eos = data.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is not None and not isinstance(eos, str):
        raise DataError(f"{config}: eos_token must be a string or {{\"content\": string}}, "
                        f"not {type(eos).__name__}; {fix}")
    return eos or None


def _hf_eod(tok, json_path: str) -> int:
    config = os.path.join(os.path.dirname(json_path), "tokenizer_config.json")
    names = list(EOD_CANDIDATES)
    eos = _config_eos(config) if os.path.isfile(config) else None
    if eos is not None:
        if tok.token_to_id(eos) is None:
            raise DataError(f"{config}: eos_token {eos!r} is not in the vocabulary of {json_path}; "
                            f"fix eos_token or remove it")
        names.insert(0, eos)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"--tokenizer-model {json_path}: no end-of-document token found "
                    f"(looked for {', '.join(EOD_CANDIDATES)}); add one to the tokenizer")


def special_tokens_problem(kind: str, special: Optional[list]) -> Optional[str]:
    """Why ``--tokenizer-special-tokens`` cannot be used with ``--tokenizer-type kind`` (None if it can)."""
    if not special or kind == "TikTokenizer":
        return None
    if kind in SENTENCEPIECE_TYPES:
        return (f"--tokenizer-special-tokens with --tokenizer-type {kind}: Megatron takes them only under "
                f"--tokenizer-sentencepiece-legacy, which meshlm does not support; put the special tokens "
                f"in the SentencePiece model when training it, and drop the flag")
    return (f"--tokenizer-special-tokens is read only by --tokenizer-type TikTokenizer here; drop it"
            + (f" for {kind}" if kind else ""))


def implied_tokenizer_type(data_cfg, vocab_size: Optional[int] = None) -> Optional[str]:
    """--tokenizer-type, or the one implied by the given files: tokenizer.json → HuggingFace,
    vocab+merges → GPT2BPE, only --vocab-size → Null; None if nothing is given."""
    if data_cfg.tokenizer_type:
        return data_cfg.tokenizer_type
    if data_cfg.tokenizer_model:
        return "HuggingFaceTokenizer"
    if data_cfg.vocab_file and data_cfg.merge_file:
        return "GPT2BPETokenizer"
    return "NullTokenizer" if vocab_size else None


def resolve_tokenizer_type(data_cfg, vocab_size: Optional[int] = None) -> str:
    """:func:`implied_tokenizer_type`; ConfigError if nothing is given."""
    kind = implied_tokenizer_type(data_cfg, vocab_size)
    if kind is None:
        raise ConfigError("no tokenizer: set --tokenizer-type with --tokenizer-model (tokenizer.json), "
                          "--vocab-file/--merge-file, or --vocab-size for NullTokenizer")
    return kind


def ignored_vocab_size(data_cfg, vocab_size: Optional[int]) -> Optional[str]:
    """The note for a --vocab-size that a file-based tokenizer ignores (its file gives the
    vocabulary, as in Megatron), or None: only NullTokenizer and TikTokenizer take it."""
    kind = implied_tokenizer_type(data_cfg)
    if not vocab_size or kind in (None, "NullTokenizer", "TikTokenizer"):
        return None
    return (f"--vocab-size {vocab_size} ignored with {kind} (as in Megatron): the vocabulary is its file's; drop "
            f"--vocab-size (`meshlm plan` uses it only where the tokenizer file is absent)")


_FILE_FLAGS = (("tokenizer_model", "--tokenizer-model"), ("vocab_file", "--vocab-file"), ("merge_file", "--merge-file"))


def half_gpt2_problem(data_cfg) -> Optional[str]:
    """The error for --vocab-file or --merge-file given alone with no --tokenizer-type and no
    --tokenizer-model (None otherwise): GPT2BPETokenizer is implied by the two together, so the one
    file was silently dropped and the run trained on NullTokenizer ids (with --vocab-size)."""
    vocab, merges = getattr(data_cfg, "vocab_file", None), getattr(data_cfg, "merge_file", None)
    if data_cfg.tokenizer_type or data_cfg.tokenizer_model or bool(vocab) == bool(merges):
        return None
    given, path, missing = ("--vocab-file", vocab, "--merge-file") if vocab else ("--merge-file", merges, "--vocab-file")
    return (f"{given} {path} without {missing}: GPT2BPETokenizer reads both; give {missing} too (or "
            f"--tokenizer-type NullTokenizer --vocab-size N to train on token ids without it)")


def ignored_tokenizer_files(data_cfg, vocab_size: Optional[int] = None) -> Optional[str]:
    """The note naming the tokenizer file flags the run's tokenizer type does not read
    (``--tokenizer-type NullTokenizer --tokenizer-model x``, a tokenizer.json with --vocab-file),
    or None. Megatron ignores them as silently; here a misspelt path is at least named."""
    kind = implied_tokenizer_type(data_cfg, vocab_size)
    if kind is None or half_gpt2_problem(data_cfg):
        return None
    reads = ("vocab_file", "merge_file") if kind == "GPT2BPETokenizer" else \
        ("tokenizer_model",) if kind in MODEL_FILE else ()
    unread = [f"{flag} {getattr(data_cfg, name)}" for name, flag in _FILE_FLAGS
              if getattr(data_cfg, name, None) and name not in reads]
    if not unread:
        return None
    return f"{', '.join(unread)} ignored with {kind}, which does not read {'it' if len(unread) == 1 else 'them'}; drop " \
           f"{'it' if len(unread) == 1 else 'them'} or give the --tokenizer-type that does"


def null_ids_problem(data_cfg, vocab_size: Optional[int]) -> Optional[str]:
    """Why --null-tokenizer-eod-id / --null-tokenizer-pad-id do not fit --vocab-size (None when they do)."""
    eod, pad = getattr(data_cfg, "null_tokenizer_eod_id", None), getattr(data_cfg, "null_tokenizer_pad_id", -1)
    if vocab_size and eod is not None and not 0 <= eod < vocab_size:
        return (f"--null-tokenizer-eod-id {eod} is not an id of --vocab-size {vocab_size} (0..{vocab_size - 1}); "
                f"with eod {eod} give --vocab-size {eod + 1}" if eod >= vocab_size else
                f"--null-tokenizer-eod-id {eod} must be an id ≥ 0")
    if vocab_size and pad is not None and pad != -1 and not 0 <= pad < vocab_size:
        return (f"--null-tokenizer-pad-id {pad} is not an id of --vocab-size {vocab_size}; give -1 (no pad) "
                f"or an id below it")
    return None


def build_tokenizer(data_cfg, vocab_size: Optional[int] = None) -> Tokenizer:
    """Build the tokenizer named by ``data_cfg`` (a DataConfig or any object with its fields).

    vocab_size: needed by NullTokenizer only. Raises ConfigError for a missing flag and
    DataError for a missing or unusable file.
    """
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers

    kind = resolve_tokenizer_type(data_cfg, vocab_size)
    problem = special_tokens_problem(kind, getattr(data_cfg, "tokenizer_special_tokens", None))
    if problem:
        raise ConfigError(problem)
    if kind in EXTRA_TYPES:
        return build_extra(kind, data_cfg, vocab_size)
    if kind == "NullTokenizer":
        if not vocab_size:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        if vocab_size < 1:
            raise ConfigError(f"--vocab-size {vocab_size}: NullTokenizer needs a positive vocabulary size")
        problem = null_ids_problem(data_cfg, vocab_size)
        if problem:
            raise ConfigError(problem)
        return NullTokenizer(vocab_size, getattr(data_cfg, "null_tokenizer_eod_id", None),
                             getattr(data_cfg, "null_tokenizer_pad_id", -1))
    if kind == "HuggingFaceTokenizer":
        path = require_path(data_cfg.tokenizer_model, "--tokenizer-model", kind)
        if os.path.isdir(path):
            path = require_path(os.path.join(path, "tokenizer.json"), "--tokenizer-model", kind)
        try:
            tok = HFTok.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"--tokenizer-model {path}: not a tokenizer.json ({str(e)[:120]})") from None
        return HFTokenizer(tok, _hf_eod(tok, path), f"HF:{os.path.basename(path)}:{file_digest(path)}")
    if kind == "GPT2BPETokenizer":
        vocab = require_path(data_cfg.vocab_file, "--vocab-file", kind)
        merges = require_path(data_cfg.merge_file, "--merge-file", kind)
        try:
            tok = HFTok(models.BPE.from_file(vocab, merges))
        except Exception as e:
            raise DataError(f"--vocab-file {vocab} / --merge-file {merges}: unreadable ({str(e)[:120]})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        eod = tok.token_to_id(EOD)
        if eod is None:
            raise DataError(f"--vocab-file {vocab}: has no {EOD} token")
        return HFTokenizer(tok, eod, f"GPT2BPE:{file_digest(vocab, merges)}")
    raise ConfigError(f"--tokenizer-type {kind!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}")


def vocab_of(cfg: Config) -> tuple:
    """(vocabulary size, how it was found): the tokenizer's (its files read where they exist),
    --vocab-size, or an assumption (GPT-2's 50257 for GPT2BPETokenizer without its files).
    Raises DataError (one line) for a tokenizer file that does not read."""
    d = cfg.data
    kind = implied_tokenizer_type(d)  # the type build_tokenizer takes, --tokenizer-type or the files'
    if kind in (*EXTRA_TYPES, "HuggingFaceTokenizer") and d.tokenizer_model:  # one-line errors
        return build_tokenizer(d, cfg.model.vocab_size).vocab_size, d.tokenizer_model
    if kind == "GPT2BPETokenizer" and all(p and os.path.isfile(p) for p in (d.vocab_file, d.merge_file)):
        return build_tokenizer(d).vocab_size, d.vocab_file
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "--vocab-size"
    if kind == "GPT2BPETokenizer":
        return _GPT2_VOCAB, "GPT-2"
    return 32000, "assumed: the tokenizer is not known yet"


def train_bpe(source, vocab_size: int, output_path: str, json_keys=("text",),
              bad: Optional[BadRecords] = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style: byte alphabet, GPT-2 split regex) with the special
    token ``<|endoftext|>`` as eod, and save it as a tokenizer.json at output_path (atomically).

    source: an iterable of texts, or a list of files (jsonl read through json_keys, other files as
    one text each; bad records are skipped and counted in ``bad``). Returns the trained tokenizer
    as a HuggingFaceTokenizer, of at most vocab_size ids (fewer when the text has no more merges;
    the trainer is asked for no more than the text can give, ``_learnable``). Raises DataError, and
    writes nothing, when the source holds no non-empty text.
    """
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    if isinstance(source, (list, tuple)) and source and all(
            isinstance(p, (str, os.PathLike)) and os.path.isfile(p) for p in source):
        bad = BadRecords() if bad is None else bad
        where = (" ".join(str(p) for p in source) + " (every record empty, unusable or without "
                 f"--json-keys {' '.join(json_keys)})")
        most = _learnable(sum(text_bytes_bound(str(p)) for p in source))
        source = iter_texts([str(p) for p in source], json_keys, bad)
    else:
        where = "the given texts"
        most = _learnable(sum(len(t.encode("utf-8")) for t in source)) if isinstance(source, (list, tuple)) else None
    seen = [0]  # non-empty texts the trainer consumed

    def counted(texts):
        for text in texts:
            seen[0] += bool(text)
            yield text

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, most or vocab_size), special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(counted(source), trainer=trainer)
    if not seen[0]:
        first = f" ({bad.count} bad records; first: {bad.messages[0]})" if bad and bad.messages else ""
        raise DataError(f"no text to train on in {where}{first}; give inputs with non-empty text")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with replacing(output_path) as tmp:
        tok.save(tmp)
    return HFTokenizer(tok, tok.token_to_id(EOD), f"HF:{os.path.basename(output_path)}:{file_digest(output_path)}")


def _learnable(nbytes: int) -> int:
    """The most ids BPE can learn from ``nbytes`` bytes of text (a file's size bounds its text's
    UTF-8 bytes): the 256 byte tokens, <|endoftext|> and one merge per adjacent pair of bytes at
    most. The trainer sizes its tables by the vocabulary asked, so asking more only costs memory
    (--vocab-size 10**9 asked the tokenizers library for 70 GB and aborted the process)."""
    return 257 + nbytes


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshlm tokenizer train``."""
    parser.add_argument("--input", nargs="+", action="extend", required=True,
                        help="jsonl files (field --json-keys; *.jsonl, *.json or a first line that is a JSON object) or "
                             "plain-text files (one text each)")
    parser.add_argument("--json-keys", nargs="+", action="extend", default=None,
                        help="jsonl fields to train on (default: text)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="target vocabulary size")
    parser.add_argument("--output", required=True, help="tokenizer.json to write")


def run_train(args: argparse.Namespace) -> int:
    """``meshlm tokenizer train``: train a byte-level BPE on the inputs; returns the exit status."""
    check_inputs(args.input)
    if args.vocab_size < 257:
        raise ConfigError(f"--vocab-size {args.vocab_size} is below the 256 byte tokens + {EOD}; use ≥ 257")
    keys = check_json_keys(args.json_keys)
    check_output_file(args.output, f"--output {args.output}", args.input)
    from ..folders import foreign_file_problem
    problem = foreign_file_problem("--output", args.output, "tokenizer.json", ("model", "added_tokens"))
    if problem:
        raise ConfigError(problem)
    bad = BadRecords()
    with space_errors_named(f"--output {args.output}", os.path.dirname(os.path.abspath(args.output))):
        tok = train_bpe(list(args.input), args.vocab_size, args.output, keys, bad)  # no file left on error
    bad.print()
    print(f"wrote {args.output}: byte-level BPE, vocab {tok.vocab_size}, eod {EOD} = {tok.eod}; "
          f"skipped {bad.count:,} bad records")
    if tok.vocab_size < args.vocab_size:
        print(f"meshlm: note: --vocab-size {args.vocab_size:,} asked, but the input gives only {tok.vocab_size:,} "
              f"tokens (every merge it has); train on more text for a larger vocabulary")
    return 0


__all__ = ["Tokenizer", "HFTokenizer", "NullTokenizer", "build_tokenizer", "train_bpe",
           "add_train_arguments", "run_train", "resolve_tokenizer_type", "EOD", "EXTRA_TYPES",
           "MODEL_FILE", "SENTENCEPIECE_TYPES", "TOKENIZER_FIELDS", "file_digest", "missing_files", "require_path",
           "special_tokens_problem", "half_gpt2_problem", "ignored_tokenizer_files"]

