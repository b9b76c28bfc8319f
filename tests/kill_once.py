"""Test-only torchrun entry point: ``meshlm`` with workers killed at chosen moments, in float64.

KILL_AT="RANK:ITERATION:WHERE,..." with MARKERS=<folder>: the job's k-th kill is the first whose
marker file ``<folder>/kill<k>`` did not exist when this worker started (so one attempt of the job
does at most one kill, and a restarted attempt the next one). That rank SIGKILLs itself in that
iteration, after creating the marker: WHERE "step" right after the iteration's step (before any
save), "save" inside that iteration's checkpoint save, once its own files are written (the save
never completes). KILL_ONCE="RANK:ITERATION:MARKER" is one "step" kill with its own marker file.
FLOAT64=1 trains in float64 (the CLI's CPU default is fp32), for comparisons across layouts.
"""

import os
import signal
import sys

import torch

from meshlm.checkpoint import dist as ckpt
from meshlm.cli import main
from meshlm.training import trainer


def _pending_kill():
    """(rank, iteration, where, marker) of this attempt's kill, or None."""
    if os.environ.get("KILL_ONCE"):
        rank, iteration, marker = os.environ["KILL_ONCE"].split(":", 2)
        return (None if os.path.exists(marker) else (int(rank), int(iteration), "step", marker))
    for k, spec in enumerate(filter(None, os.environ.get("KILL_AT", "").split(","))):
        marker = os.path.join(os.environ["MARKERS"], f"kill{k}")
        if not os.path.exists(marker):
            rank, iteration, where = spec.split(":")
            return int(rank), int(iteration), where, marker
    return None


def _die(marker):
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(rank, iteration, where, marker):
    step, write = trainer.launch_step, ckpt.write
    at = {}

    def launch_step(run, state):
        loss = step(run, state)
        at["rank"], at["iteration"] = run.ps.rank, state.iteration
        if where == "step" and (run.ps.rank, state.iteration) == (rank, iteration):
            _die(marker)
        return loss

    def write_then_die(tmp, state, **kw):
        files = write(tmp, state, **kw)
        if where == "save" and (at.get("rank"), at.get("iteration")) == (rank, iteration):
            _die(marker)
        return files
    trainer.launch_step, ckpt.write = launch_step, write_then_die


if __name__ == "__main__":
    kill = _pending_kill()
    if kill:
        _arm(*kill)
    if os.environ.get("FLOAT64") == "1":
        trainer.params_dtype = lambda cfg, device: torch.float64
    sys.exit(main(sys.argv[1:]))
