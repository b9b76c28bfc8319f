"""The run's log files: where each rank's log goes, and a fresh run into a run directory that already
holds a run's logs sets them aside first.

A resumed run (``--load`` given) keeps its logs: the trainer trims ``metrics.jsonl`` to the loaded
checkpoint and the rank logs append (training/metrics.py ``MetricsLogger.begin``). A fresh run (no
``--load``) would instead overwrite the earlier run's ``metrics.jsonl``, rank logs and ``config.yaml``,
so :func:`set_aside_old_logs` renames them (never deletes): the log folder ``logs`` →
``logs.<YYYYmmdd-HHMMSS>`` and ``config.yaml`` → ``config.<YYYYmmdd-HHMMSS>.yaml``. It runs in the
process that resolves the config (the launcher, or rank 0 under torchrun / Slurm), after the run
directory's lock is taken and before anything of the new run is written.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Optional

LOG_FILES = ("metrics.jsonl", "rank*.log", "launcher.log")  # what a run writes into its log folder


def worker_log_path(cfg, rank: int) -> str:
    """``<log dir>/rank<R>.log`` of a Config: a copy of that worker's stdout and stderr (launch.py
    writes it, the trainer's heartbeats go there)."""
    log_dir = cfg.logging.log_dir or os.path.join(cfg.logging.run_dir or ".", "logs")
    return os.path.join(log_dir, f"rank{rank}.log")


def _free(stem: str, ext: str = "") -> str:
    """``stem + ext``, or ``stem-N + ext`` for the first N that does not exist."""
    out, n = stem + ext, 1
    while os.path.lexists(out):
        out, n = f"{stem}-{n}{ext}", n + 1
    return out


def set_aside_old_logs(run_dir: str, log_dir: str) -> Optional[str]:
    """Rename a previous run's logs in ``log_dir`` and ``run_dir/config.yaml`` out of the way of a
    fresh run; the one note line to print naming where they went, or None when there were none.

    A log folder that is the run directory itself (or holds it) cannot be renamed: its log files
    are moved into a new ``logs.<timestamp>`` folder inside it instead. Raises OSError when a
    rename fails (the caller's one-line error)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    old = [p for pattern in LOG_FILES for p in glob.glob(os.path.join(glob.escape(log_dir), pattern))]
    moved = []
    if old:
        log_real, run_real = os.path.realpath(log_dir), os.path.realpath(run_dir)
        if run_real == log_real or run_real.startswith(log_real + os.sep):
            dest = _free(os.path.join(log_dir, f"logs.{stamp}"))
            os.mkdir(dest)
            for p in old:
                os.rename(p, os.path.join(dest, os.path.basename(p)))
        else:
            dest = _free(f"{log_dir.rstrip(os.sep)}.{stamp}")
            os.rename(log_dir, dest)
        moved.append(f"logs to {dest}")
    config = os.path.join(run_dir, "config.yaml")
    if os.path.exists(config):
        dest = _free(os.path.join(run_dir, f"config.{stamp}"), ".yaml")
        os.rename(config, dest)
        moved.append(f"config.yaml to {dest}")
    if not moved:
        return None
    return (f"{run_dir} holds an earlier run and this one starts fresh (no --load): moved its "
            f"{' and '.join(moved)} (give --load to resume that run instead)")
