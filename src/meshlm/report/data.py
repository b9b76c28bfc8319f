"""Reading a run for the report: its metrics.jsonl records, its config.yaml, its pipeline timeline.

A run directory is what ``meshlm pretrain`` writes: ``config.yaml`` and ``logs/metrics.jsonl``
(MetricsLogger: one JSON object per line, non-finite floats as metrics_json.py writes them; a
training record has ``iter_ms``, an evaluation record ``val_loss``, a checkpoint record ``checkpoint``). ``load_run`` also takes the logs folder
or the metrics.jsonl file itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import DataError


@dataclass
class RunData:
    """One run as the report sees it.

    train: training records in iteration order; evals: validation records; config: the run's
    config.yaml as a nested dict ({} when absent); metrics: the metrics.jsonl read; seq_length: tokens per sample (config, else 1
    so "tokens" falls back to samples).
    """

    name: str
    path: str
    train: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    metrics: str = ""

    @property
    def seq_length(self) -> int:
        return int(self.config.get("model", {}).get("seq_length") or 1)

    def tokens(self, record: dict) -> float:
        """Training tokens consumed when ``record`` was written (consumed samples × seq length)."""
        return float(record["consumed_samples"]) * self.seq_length

    def series(self, key: str, x: str = "tokens", records: Optional[list] = None) -> list:
        """[(x, value)] of ``key`` over the training records (or ``records``) that have it; x is
        "tokens", "iteration" or "time" (seconds since the first step: the sum of iter_ms over the
        logged intervals, each record standing for the iterations since the one before)."""
        rows = self.train if records is None else records
        clock, last_it, out = 0.0, 0, []
        for r in rows:
            if x == "time" and "iter_ms" in r:
                clock += r["iter_ms"] * (r["iteration"] - last_it) / 1000.0
                last_it = r["iteration"]
            if r.get(key) is None:
                continue
            where = {"tokens": lambda: self.tokens(r), "iteration": lambda: float(r["iteration"]),
                     "time": lambda: clock}[x]()
            out.append((where, float(r[key])))
        return out

    def last_timeline(self) -> Optional[dict]:
        """The last logged iteration's pipeline timeline: {"iteration", "events", "bubble"} or None
        (a run without pipeline parallelism logs none)."""
        for r in reversed(self.train):
            if r.get("pipeline_timeline"):
                return {"iteration": r["iteration"], "events": r["pipeline_timeline"],
                        "bubble": r.get("bubble_fraction")}
        return None

    @property
    def pipeline(self) -> dict:
        """{"pp", "v"}: pipeline ranks and model chunks per rank, from the config (1 when absent)."""
        p = self.config.get("parallel", {})
        return {"pp": int(p.get("pipeline_model_parallel_size") or 1),
                "v": int(p.get("virtual_pipeline_model_parallel_size") or 1)}


def metrics_path(path: str) -> str:
    """The metrics.jsonl of ``path``: a run directory (its config's log_dir, else logs/), a logs
    folder, or the file itself. DataError naming the path when there is none."""
    if os.path.isfile(path):
        return path
    candidates = [os.path.join(path, "logs", "metrics.jsonl"), os.path.join(path, "metrics.jsonl")]
    log_dir = _read_config(path).get("logging", {}).get("log_dir")
    if log_dir:
        candidates.insert(0, os.path.join(log_dir, "metrics.jsonl"))
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise DataError(f"{path}: no logs/metrics.jsonl here; give the run directory `meshlm pretrain` "
                    f"named in its first line (--run-dir), or its metrics.jsonl")


def _read_config(run_dir: str) -> dict:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    from ..config import SECTIONS, value_problem
    from ..folders import read_yaml_mapping
    return read_yaml_mapping(path, DataError, SECTIONS, value_problem)


def load_run(path: str, name: Optional[str] = None) -> RunData:
    """Read the run at ``path`` (see metrics_path). name: its label in legends (default: the run
    directory's name). DataError naming the file and line of a record that is not JSON, or the file
    when none of its records is meshlm's (another jsonl, e.g. a corpus)."""
    metrics = metrics_path(path)
    logs = os.path.dirname(os.path.abspath(metrics))
    run_dir = os.path.dirname(logs) if os.path.basename(logs) == "logs" else logs
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.yaml")):
        run_dir = path
    run = RunData(name=name or os.path.basename(os.path.normpath(os.path.abspath(run_dir))),
                  path=run_dir, config=_read_config(run_dir), metrics=metrics)
    from ..folders import read_jsonl
    from ..metrics_json import decode, record_problem
    records = [decode(r) for r in read_jsonl(metrics, DataError, "a metrics.jsonl that `meshlm pretrain` wrote")]
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, dict) or not ("val_loss" in rec or "iter_ms" in rec):
            continue
        missing = [key for key in ("iteration", "consumed_samples") if not isinstance(rec.get(key), int)]
        kind = "validation" if "val_loss" in rec else "training"
        if missing:  # the charts' x axes: a KeyError traceback before
            raise DataError(f"{metrics}: record {n} (a {kind} record) has no integer {' or '.join(missing)}; give "
                            f"the metrics.jsonl `meshlm pretrain` wrote")
        wrong = record_problem(rec)
        if wrong:
            raise DataError(f"{metrics}: record {n} (a {kind} record): {wrong}; give the metrics.jsonl `meshlm "
                            f"pretrain` wrote")
        (run.evals if "val_loss" in rec else run.train).append(rec)
    if records and not any(isinstance(rec, dict) and "iteration" in rec for rec in records):
        raise DataError(f"{metrics}: not a meshlm metrics file (none of its records has an "
                        f"\"iteration\"); give a run directory or the metrics.jsonl `meshlm pretrain` wrote")
    run.train.sort(key=lambda r: r["iteration"])
    run.evals.sort(key=lambda r: r["iteration"])
    return run


def distinct_runs(runs: list, given: list) -> tuple:
    """(runs without repeats, one note per repeat): a run given twice (the same metrics.jsonl,
    as a folder or as the file) is shown once. given: the paths on the command line, in order."""
    kept, notes, first = [], [], {}
    for run, path in zip(runs, given):
        key = os.path.realpath(run.metrics)
        if key in first:
            notes.append(f"{path} is the run {first[key]} already given (the same {run.metrics}); shown once")
            continue
        first[key] = path
        kept.append(run)
    return kept, notes


def unique_names(runs: list) -> None:
    """Give runs with the same name a " (2)", " (3)" … suffix so every legend entry is distinct."""
    seen: dict = {}
    for run in runs:
        n = seen[run.name] = seen.get(run.name, 0) + 1
        if n > 1:
            run.name = f"{run.name} ({n})"


# The first characters of meshlm report's own outputs: an existing file that starts so may be replaced.
OWN_OUTPUT = {"report": '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>meshlm report',
              "trace": '{"traceEvents": '}


def _starts_with(path: str, prefix: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(len(prefix)) == prefix
    except OSError:
        return False


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def overwrite_problem(flag: str, path: str, runs: list, kind: str, example: str) -> Optional[str]:
    """None unless ``path`` is an existing file meshlm report must not replace: any file but an
    empty one or an earlier output of the report's own ``kind`` ("report" or "trace", see
    OWN_OUTPUT), named as a file of one of ``runs`` (anything in its run directory or its
    metrics.jsonl's folder: metrics.jsonl, config.yaml, worker logs, checkpoints, …), a GPU profile
    the report reads, or any other file (another run's metrics.jsonl, a checkpoint's tracker, a
    corpus: each was replaced); else one line naming ``flag``, the file and the fix (``example``: a
    file name to suggest)."""
    if not os.path.isfile(path) or _starts_with(path, OWN_OUTPUT[kind]):
        return None
    from ..planner.gpus import profile_dir
    for run in runs:
        for folder in (run.path, os.path.dirname(os.path.abspath(run.metrics or run.path))):
            if _inside(path, folder):
                what = "the metrics.jsonl the report reads" if run.metrics and os.path.exists(run.metrics) and \
                    os.path.samefile(path, run.metrics) else f"a file of the run {run.path}"
                return (f"{flag} {path} is {what}, not an earlier meshlm {kind}: refusing to overwrite it; "
                        f"give another file (e.g. {os.path.join(run.path, example)})")
    if _inside(path, profile_dir()):
        return (f"{flag} {path} is a GPU profile the report reads: refusing to overwrite it; "
                f"give another file (e.g. {example})")
    if os.path.getsize(path):  # another run's metrics, a tracker, a corpus: nothing a report may replace
        return (f"{flag} {path} exists and is not an earlier meshlm {kind}: refusing to overwrite it; "
                f"give another file (e.g. {example}), or remove it first")
    return None
