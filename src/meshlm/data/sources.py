"""Which flags name the training data, as in Megatron-LM's ``get_blend_and_blend_per_split``.

One source of data per run:

- ``--data-path`` (or ``--data-args-path FILE``, the same tokens read from a file): one blend,
  cut into train/valid/test by ``--split`` (default 969,30,1, Megatron's legacy default);
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (or
  ``--per-split-data-args-path FILE``, a JSON object with keys "train", "valid", "test"): a blend
  per split, each over whole datasets; ``--split`` is then an error (Megatron refuses it too) and a
  split without a blend is not built (no evaluation without valid data);
- ``--mock-data``.

Every blend has --data-path's form (``A``, ``A B``, ``0.7 A 0.3 B``; see blend.py).
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from .blend import is_number, parse_data_path

DEFAULT_SPLIT = "969,30,1"
SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def split_string(d) -> str:
    """The --split in effect for DataConfig ``d``: given, else :data:`DEFAULT_SPLIT`."""
    return d.split if d.split is not None else DEFAULT_SPLIT


def _per_split_paths(d) -> list:
    return [d.train_data_path, d.valid_data_path, d.test_data_path]


def _split_flags(d) -> str:
    """The --train/valid/test-data-path flags given, as one name: "--train-data-path/--valid-data-path"."""
    return "/".join(f for f, p in zip(SPLIT_FLAGS, _per_split_paths(d)) if p)


def given_sources(d) -> list:
    """The data flags set in DataConfig ``d`` (--train/valid/test-data-path count as one)."""
    flags = [("--mock-data", d.mock_data), ("--data-path", bool(d.data_path)),
             ("--data-args-path", d.data_args_path is not None), (_split_flags(d), any(_per_split_paths(d))),
             ("--per-split-data-args-path", d.per_split_data_args_path is not None)]
    return [flag for flag, on in flags if on]


def per_split(d) -> bool:
    """True when each split has its own blend (--train/valid/test-data-path or its JSON file)."""
    return any(_per_split_paths(d)) or d.per_split_data_args_path is not None


def source_problems(d) -> list:
    """Megatron's rules on the data flags (no file access): one source; --split only with one
    blend; per-split data needs training data. One line per problem."""
    problems = []
    given = given_sources(d)
    if len(given) > 1:
        problems.append(f"{' and '.join(given)} are exclusive: give one source of data")
    if per_split(d) and d.split is not None:
        flag = _split_flags(d) or "--per-split-data-args-path"
        problems.append(f"--split {d.split} with {flag}: each split already has its own data "
                        f"(Megatron-LM refuses this too); drop --split")
    if any(_per_split_paths(d)) and not d.train_data_path:
        problems.append(f"{_split_flags(d)} without --train-data-path: give the training data too")
    return problems


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(f"{flag} {path}: cannot read it ({why}); give a readable UTF-8 file") from None


def _per_split_file(path: str) -> list:
    """The three token lists (None where absent) of a --per-split-data-args-path JSON file."""
    flag = "--per-split-data-args-path"
    try:
        data = json.loads(_read(path, flag))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {path}: not JSON ({e.msg}, line {e.lineno}); give an object with keys "
                          f"\"train\", \"valid\", \"test\"") from None
    missing = [k for k in ("train", "valid", "test") if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"{flag} {path}: no key {', '.join(repr(k) for k in missing)}; give an object with "
                          f"keys \"train\", \"valid\", \"test\" (null for a split without data)")
    extra = sorted(set(data) - {"train", "valid", "test"})
    if extra:  # a typo ("validation") would otherwise leave that split without data, unsaid
        raise ConfigError(f"{flag} {path}: unknown key {', '.join(repr(k) for k in extra)}; the keys are "
                          f"\"train\", \"valid\", \"test\"")
    out = []
    for key in ("train", "valid", "test"):
        value = data[key]
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list) and all(isinstance(v, (str, int, float))
                                                                      for v in value)):
            raise ConfigError(f"{flag} {path}: \"{key}\" is neither a string, a list of --data-path tokens "
                              f"nor null")
        out.append([str(v) for v in value] if value else None)
    return out


def _data_args_tokens(d) -> list:
    """The --data-path tokens in the --data-args-path file; ConfigError for a JSON or empty file."""
    flag = f"--data-args-path {d.data_args_path}"
    text = _read(d.data_args_path, "--data-args-path")
    if text.lstrip()[:1] in ("{", "["):  # each JSON word would be named as a bad prefix
        raise ConfigError(f"{flag}: the file is JSON; --data-args-path takes the --data-path tokens as "
                          f"plain text (0.7 data/a_text_document 0.3 data/b_text_document), and a JSON "
                          f"file of train/valid/test blends is --per-split-data-args-path")
    if not text.split():
        raise ConfigError(f"{flag}: the file holds no dataset prefix; write the --data-path tokens into it "
                          f"(e.g. 0.7 data/a_text_document 0.3 data/b_text_document)")
    return text.split()


def weighted(d) -> bool:
    """Whether --data-path / --data-args-path gives weights ("1.0 A", not "A"): Megatron blends one
    weighted prefix too (its dataset built with the 0.5 % surplus) and builds one bare prefix directly."""
    tokens = d.data_path or (_data_args_tokens(d) if d.data_args_path is not None else [])
    return bool(tokens) and is_number(tokens[0])


def blends(d) -> list:
    """The data of DataConfig ``d`` as [(flag, blend)] where blend is [(weight, prefix), ...]
    (weights sum to 1) and flag names where it came from in messages: one entry for --data-path /
    --data-args-path (all splits, cut by --split), three (train, valid, test; blend None where that
    split has no data) under per-split data, none under --mock-data or without data.

    Raises ConfigError naming the flag for a malformed blend or an unreadable / malformed file.
    """
    if d.data_path:
        return [("--data-path", parse_data_path(d.data_path))]
    if d.data_args_path is not None:
        flag = f"--data-args-path {d.data_args_path}"
        return [(flag, parse_data_path(_data_args_tokens(d), flag))]
    if d.per_split_data_args_path is not None:
        path = d.per_split_data_args_path
        flags = [f"--per-split-data-args-path {path} ({key})" for key in ("train", "valid", "test")]
        return [(flag, parse_data_path(tokens or [], flag) or None)
                for flag, tokens in zip(flags, _per_split_file(path))]
    if any(_per_split_paths(d)):
        return [(flag, parse_data_path(tokens, flag) or None) for flag, tokens in zip(SPLIT_FLAGS, _per_split_paths(d))]
    return []


def prefixes(data: list) -> list:
    """Every dataset prefix in ``data`` (from :func:`blends`), as (flag, prefix), in flag order,
    each once."""
    seen = {}
    for flag, blend in data:
        for _, prefix in blend or []:
            seen.setdefault(prefix, flag)
    return [(flag, prefix) for prefix, flag in seen.items()]
