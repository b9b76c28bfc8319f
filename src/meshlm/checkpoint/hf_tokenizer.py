"""The tokenizer of `meshlm convert`: a run's tokenizer → the files of a Hugging Face folder, and back.

Export (``export_tokenizer``), so that ``transformers.AutoTokenizer.from_pretrained(folder)`` gives
the ids meshlm's tokenizer gives:

- HuggingFaceTokenizer: its tokenizer.json, and the tokenizer_config.json beside it; without one,
  a tokenizer_config.json naming ``PreTrainedTokenizerFast`` (transformers then takes the
  tokenizer.json as it is) and the end-of-document token as ``eos_token``.
- SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer: the model as
  tokenizer.model, the same model as a tokenizer.json (data/sp_to_hf.py; transformers ≥ 5 would
  otherwise need protobuf to read the .model, and its LlamaTokenizer rebuilds the pre-tokenizer,
  which changes the ids of text with leading or repeated spaces), and a tokenizer_config.json:
  ``PreTrainedTokenizerFast``, bos/eos/unk/pad the model's pieces, ``add_bos_token`` and
  ``add_eos_token`` false and ``split_special_tokens`` true (meshlm, as Megatron, adds neither
  and reads ``<s>`` in text as text). A model the tokenizer.json cannot express gets
  tokenizer.model and ``LlamaTokenizer`` with a note.
- GPT2BPETokenizer: vocab.json, merges.txt and ``GPT2Tokenizer`` (eos/bos/unk ``<|endoftext|>``,
  no prefix space, ``split_special_tokens``: meshlm's BPE reads ``<|endoftext|>`` in text as text).
- TikTokenizer and NullTokenizer: nothing, with a note.

The ids transformers reads besides the tokenizer: ``bos_token_id`` / ``eos_token_id`` (eos = the
end-of-document id) go into config.json and generation_config.json (``generate`` stops there).

Import (``import_tokenizer``): a folder's tokenizer.json (HuggingFaceTokenizer), else its
tokenizer.model (Llama2Tokenizer for Llama-like models, else SentencePieceTokenizer), else its
vocab.json + merges.txt (GPT2BPETokenizer) is copied into the checkpoint folder when its vocabulary
is the model's; otherwise the checkpoint uses NullTokenizer, with a note.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from .. import config as C
from ..errors import ConfigError, DataError

HF_JSON, HF_CONFIG, SP_MODEL, GPT2_VOCAB, GPT2_MERGES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
GENERATION = "generation_config.json"


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)


def _build(data: C.DataConfig, vocab_size: int):
    from ..data.tokenizer import build_tokenizer
    return build_tokenizer(data, vocab_size)


# ----------------------------------------------------------------------------- export

def _export_hf_json(data: C.DataConfig, tok, out: str) -> list:
    path = data.tokenizer_model
    path = os.path.join(path, HF_JSON) if os.path.isdir(path) else path
    shutil.copyfile(path, os.path.join(out, HF_JSON))
    beside = os.path.join(os.path.dirname(path), HF_CONFIG)
    if os.path.isfile(beside):
        shutil.copyfile(beside, os.path.join(out, HF_CONFIG))
    else:
        _write_json(os.path.join(out, HF_CONFIG), {"tokenizer_class": "PreTrainedTokenizerFast",
                                                   "eos_token": tok._tok.id_to_token(tok.eod)})
    return [HF_JSON, HF_CONFIG]


def _export_sentencepiece(data: C.DataConfig, tok, out: str) -> tuple:
    from ..data.sp_to_hf import to_tokenizers
    shutil.copyfile(data.tokenizer_model, os.path.join(out, SP_MODEL))
    sp = tok._sp
    piece = (lambda i: sp.id_to_piece(i) if i >= 0 else None)
    settings = {"bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()), "unk_token": piece(sp.unk_id()),
                "pad_token": piece(sp.pad_id()), "add_bos_token": False, "add_eos_token": False,
                "split_special_tokens": True}
    try:
        to_tokenizers(data.tokenizer_model).save(os.path.join(out, HF_JSON))
    except DataError as e:
        _write_json(os.path.join(out, HF_CONFIG), {"tokenizer_class": "LlamaTokenizer", "legacy": False, **settings})
        return [SP_MODEL, HF_CONFIG], [f"{e}: wrote tokenizer.model with LlamaTokenizer, which transformers "
                                       f"converts itself (its ids may differ from meshlm's)"]
    _write_json(os.path.join(out, HF_CONFIG), {"tokenizer_class": "PreTrainedTokenizerFast", **settings})
    return [SP_MODEL, HF_JSON, HF_CONFIG], []


def _export_gpt2(data: C.DataConfig, out: str) -> list:
    from ..data.tokenizer import EOD
    shutil.copyfile(data.vocab_file, os.path.join(out, GPT2_VOCAB))
    shutil.copyfile(data.merge_file, os.path.join(out, GPT2_MERGES))
    _write_json(os.path.join(out, HF_CONFIG), {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOD, "eos_token": EOD,
                                               "unk_token": EOD, "add_prefix_space": False, "add_bos_token": False,
                                               "split_special_tokens": True})
    return [GPT2_VOCAB, GPT2_MERGES, HF_CONFIG]


def export_tokenizer(data: C.DataConfig, out: str, vocab_size: int) -> tuple:
    """Write the tokenizer of a run's data settings ``data`` into the HF folder ``out``; return
    (files written, notes, {"bos_token_id": id or None, "eos_token_id": id or None}).

    vocab_size: the model's (unpadded) vocabulary. A tokenizer that does not load (a file moved
    since the run) or gives another number of ids (a file replaced) is a note, not an error: the
    weights are still exported.
    """
    from ..data.tokenizer import SENTENCEPIECE_TYPES, resolve_tokenizer_type
    no_ids = {"bos_token_id": None, "eos_token_id": None}
    try:
        kind = resolve_tokenizer_type(data, vocab_size)
        tok = _build(data, vocab_size)
    except (ConfigError, DataError) as e:
        return [], [f"no tokenizer exported: the run's tokenizer does not load ({e})"], no_ids
    from .state import changed_tokenizer
    changed = changed_tokenizer(data, tok.vocab_size, vocab_size)
    if changed:
        return [], [f"no tokenizer exported: {changed}"], no_ids
    if kind == "NullTokenizer":
        return [], ["no tokenizer exported: the run used NullTokenizer (token ids as text)"], no_ids
    ids = {"bos_token_id": getattr(tok, "bos", None), "eos_token_id": tok.eod}
    if kind == "TikTokenizer":
        return [], ["TikTokenizer not exported: transformers has no reader for Megatron's tiktoken JSON "
                    "vocabulary and its special-token layout; ship the .json with the model"], ids
    if kind == "HuggingFaceTokenizer":
        files = _export_hf_json(data, tok, out)
        bos = _config_token(os.path.join(out, HF_CONFIG), "bos_token")
        return files, [], {"bos_token_id": tok._tok.token_to_id(bos) if bos else None, "eos_token_id": tok.eod}
    if kind in SENTENCEPIECE_TYPES:
        files, notes = _export_sentencepiece(data, tok, out)
        ids["bos_token_id"] = tok.bos if tok.bos >= 0 else None
        return files, notes, ids
    ids["bos_token_id"] = tok.eod  # GPT-2: <|endoftext|> begins and ends
    return _export_gpt2(data, out), [], ids


def _config_token(path: str, key: str) -> Optional[str]:
    """A special token (``"<s>"`` or ``{"content": "<s>"}``) of a tokenizer_config.json, or None."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def write_generation_config(out: str, ids: dict) -> list:
    """generation_config.json with the bos/eos ids (none when both are unknown); the files written."""
    if ids["eos_token_id"] is None and ids["bos_token_id"] is None:
        return []
    _write_json(os.path.join(out, GENERATION), ids)
    return [GENERATION]


# ----------------------------------------------------------------------------- import

def _candidate(src: str, arch: str) -> Optional[tuple]:
    """(data settings pointing into ``src``, the files to copy) for the folder's tokenizer, or None."""
    def has(name):
        return os.path.isfile(os.path.join(src, name))
    if has(HF_JSON):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": HF_JSON}, [HF_JSON, HF_CONFIG]
    if has(SP_MODEL):
        kind = "SentencePieceTokenizer" if arch == "gpt2" else "Llama2Tokenizer"
        return {"tokenizer_type": kind, "tokenizer_model": SP_MODEL}, [SP_MODEL, HF_CONFIG]
    if has(GPT2_VOCAB) and has(GPT2_MERGES):
        return ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": GPT2_VOCAB, "merge_file": GPT2_MERGES},
                [GPT2_VOCAB, GPT2_MERGES, HF_CONFIG])
    return None


def import_tokenizer(src: str, save: str, vocab_size: int, arch: str) -> tuple:
    """(data settings, notes): the HF folder's tokenizer (see the module docstring) copied into
    ``save`` when its vocabulary is the model's (``vocab_size`` rows), else NullTokenizer."""
    null = {"tokenizer_type": "NullTokenizer"}
    found = _candidate(src, arch)
    if found is None:
        return null, [f"{src} has no tokenizer.json, tokenizer.model or vocab.json + merges.txt: the checkpoint "
                      f"uses NullTokenizer (token ids as text)"]
    settings, files = found
    kind = settings["tokenizer_type"]

    def at(folder):  # the settings with their files in ``folder``
        return {k: v if k == "tokenizer_type" else os.path.abspath(os.path.join(folder, v))
                for k, v in settings.items()}
    try:
        tok = _build(C.DataConfig(**at(src)), vocab_size)
    except (DataError, ConfigError) as e:
        return null, [f"the tokenizer of {src} is not used ({e}): the checkpoint uses NullTokenizer"]
    if tok.vocab_size != vocab_size:
        return null, [f"the {kind} of {src} has {tok.vocab_size} tokens, the model {vocab_size} rows: the "
                      f"checkpoint uses NullTokenizer; pass --tokenizer-model yourself"]
    for name in files:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(save, name))
    notes = []
    if kind != "HuggingFaceTokenizer" and _adds_bos(os.path.join(src, HF_CONFIG), kind):
        notes.append(f"{src}: transformers' tokenizer adds a BOS token; meshlm's {kind} does not (as "
                     f"Megatron's): data preprocessed by meshlm has none")
    return at(save), notes


def _adds_bos(config: str, kind: str) -> bool:
    """Whether transformers' tokenizer of the folder prepends BOS: ``add_bos_token`` of its
    tokenizer_config.json (LlamaTokenizer's default is true, GPT2Tokenizer's false)."""
    try:
        with open(config, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    return bool(cfg.get("add_bos_token", kind != "GPT2BPETokenizer"))
