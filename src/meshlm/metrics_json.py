"""metrics.jsonl's JSON: every record is valid JSON, non-finite floats included.

JSON has no NaN or infinity, and Python's ``json.dumps`` writes them as the bare tokens ``NaN``,
``Infinity`` and ``-Infinity``, which other JSON readers (jq, JavaScript, pandas' strict mode)
refuse. meshlm writes each non-finite float, at any depth of a record, as the *string* of that
token instead: ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (``{"val_loss": "NaN"}``). Readers use
:func:`loads` / :func:`decode`, which turn those three strings back into floats and also read the
bare tokens of files written before this form (so ``val_loss`` is a float again either way).
No other value of a record is one of those three strings (paths and device names are never that).
"""

from __future__ import annotations

import json
import math

_TOKENS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode(value):
    """``value`` with every non-finite float (in dicts and lists, at any depth) replaced by its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value):
    """``value`` with the strings "NaN", "Infinity", "-Infinity" (at any depth) back as floats."""
    if isinstance(value, str):
        return _TOKENS.get(value, value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` of ``value`` in this form (valid JSON whatever floats it holds)."""
    return json.dumps(encode(value), allow_nan=False, **kwargs)


def loads(text: str):
    """One record (a line of metrics.jsonl), new form or old bare tokens; JSONDecodeError if not JSON."""
    return decode(json.loads(text))


# Keys of a record read as numbers (or null), as {kind: number} maps, or as lists of numbers.
NUMBERS = ("iter_ms", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "mem_allocated_gb",
           "mem_max_allocated_gb", "mem_total_gb", "val_loss", "val_ppl", "bubble_fraction", "exposed_comm_share",
           "loss_scale", "skipped_iters", "nan_iters", "global_batch_size", "world_size")
NUMBER_MAPS = ("comm_s", "comm_share")
NUMBER_LISTS = ("rank_iter_s",)


def record_problem(rec: dict):
    """The first key of a decoded record whose value is not of its kind (a number or null; a map or
    list of numbers), as "key 'x'" words, or None: analyze and report compute with them (a string
    there was a TypeError traceback)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    for key in NUMBERS:
        if rec.get(key) is not None and not number(rec[key]):
            return f"{key} is {rec[key]!r}, not a number"
    for key in NUMBER_MAPS:
        v = rec.get(key)
        if v is not None and not (isinstance(v, dict) and all(number(x) for x in v.values())):
            return f"{key} is {v!r}, not a map of numbers"
    for key in NUMBER_LISTS:
        v = rec.get(key)
        if v is not None and not (isinstance(v, list) and all(number(x) for x in v)):
            return f"{key} is {v!r}, not a list of numbers"
    return None
