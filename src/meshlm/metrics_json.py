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


# Keys of a record read as numbers (or null), as {kind: number} maps, or as lists of numbers; of those,
# the ones that count or time something are never negative.
NUMBERS = ("iter_ms", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "mem_allocated_gb",
           "mem_max_allocated_gb", "mem_total_gb", "val_loss", "val_ppl", "bubble_fraction", "exposed_comm_share",
           "loss_scale", "skipped_iters", "nan_iters", "global_batch_size", "world_size")
NUMBER_MAPS = ("comm_s", "comm_share")
NUMBER_LISTS = ("rank_iter_s",)
NOT_NEGATIVE = ("iter_ms", "tokens_per_sec", "mem_allocated_gb", "mem_max_allocated_gb", "mem_total_gb",
                "bubble_fraction", "exposed_comm_share", "skipped_iters", "nan_iters", "global_batch_size",
                "world_size", "comm_s", "comm_share", "rank_iter_s")
EVENT_INTS = ("stage", "mb", "chunk")  # a pipeline_timeline event's indices; "start", "end" in seconds


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def record_problem(rec: dict):
    """The first key of a decoded record whose value is not of its kind, in words ("key is x, not a
    number"), or None: numbers (or null), maps and lists of numbers, never negative where they count or
    time something; a training record's ``iter_ms`` a number; ``device`` a string, ``layout`` a map,
    ``loss_spike`` true/false; ``pipeline_timeline`` a list of events {"stage", "mb", "chunk": integers
    from 0 (stage below the layout's "pp"), "kind": "F" or "B", "start" ≤ "end": finite seconds}.
    analyze and report compute with them: each of these was a TypeError/KeyError traceback, and a
    stage of 10**6 a report of a million timeline rows."""
    for key in NUMBERS:
        if rec.get(key) is not None and not _number(rec[key]):
            return f"{key} is {rec[key]!r}, not a number"
    if "iter_ms" in rec and rec["iter_ms"] is None:
        return "iter_ms is null, not a number (a training record's step time)"
    for key in NUMBER_MAPS:
        v = rec.get(key)
        if v is not None and not (isinstance(v, dict) and all(_number(x) for x in v.values())):
            return f"{key} is {v!r}, not a map of numbers"
    for key in NUMBER_LISTS:
        v = rec.get(key)
        if v is not None and not (isinstance(v, list) and all(_number(x) for x in v)):
            return f"{key} is {v!r}, not a list of numbers"
    for key in NOT_NEGATIVE:
        v = rec.get(key)
        values = v.values() if isinstance(v, dict) else v if isinstance(v, list) else [v]
        if any(x is not None and x < 0 for x in values):
            return f"{key} is {v!r}: a negative count or time"
    for key, kind, words in (("device", str, "a device name"), ("layout", dict, "a map of the layout's sizes"),
                             ("loss_spike", bool, "true or false")):
        if rec.get(key) is not None and not isinstance(rec[key], kind):
            return f"{key} is {rec[key]!r}, not {words}"
    return _timeline_problem(rec.get("pipeline_timeline"), rec.get("layout") or {})


def _timeline_problem(events, layout: dict):
    """The first pipeline_timeline event that is not of its form (record_problem), in words, or None."""
    if events is None:
        return None
    if not isinstance(events, list):
        return f"pipeline_timeline is {events!r}, not a list of events"
    stages = layout.get("pp") if _number(layout.get("pp")) else None
    for n, e in enumerate(events, 1):
        wrong = not isinstance(e, dict) or any(
            not isinstance(e.get(k), int) or isinstance(e.get(k), bool) or e[k] < 0 for k in EVENT_INTS) \
            or e.get("kind") not in ("F", "B") or not all(_number(e.get(k)) and math.isfinite(e[k]) for k in
                                                          ("start", "end")) or e["end"] < e["start"]
        if wrong or (stages is not None and e["stage"] >= stages):
            return (f"pipeline_timeline event {n} is {e!r}, not {{\"stage\", \"mb\", \"chunk\": integers from 0"
                    f"{f' (stage below pp {stages})' if stages is not None else ''}, \"kind\": \"F\" or \"B\", "
                    f"\"start\" <= \"end\": seconds}}")
    return None
