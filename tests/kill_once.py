"""Test-only torchrun entry point: ``meshlm`` with one worker killed once. KILL_ONCE="RANK:ITERATION:MARKER"
makes that rank SIGKILL itself right after that iteration's step (before its save), unless the
MARKER file exists; it creates MARKER first, so the restarted job runs through."""

import os
import signal
import sys

from meshlm.cli import main
from meshlm.training import trainer


def _kill_once(spec: str):
    rank, iteration, marker = spec.split(":", 2)
    step = trainer.train_step

    def train_step(run, state):
        loss = step(run, state)
        if run.ps.rank == int(rank) and state.iteration == int(iteration) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return loss
    return train_step


if __name__ == "__main__":
    if os.environ.get("KILL_ONCE"):
        trainer.train_step = _kill_once(os.environ["KILL_ONCE"])
    sys.exit(main(sys.argv[1:]))
