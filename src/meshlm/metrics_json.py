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
