"""Test-only entry point for examples/slurm/train.sbatch (its TRAIN_SCRIPT): ``meshlm`` whose ranks
wait inside iteration STOP_AT until their stop signal came, in the job's first attempt only
(SLURM_RESTART_COUNT unset or 0). Rank 0 prints "waiting for the stop signal at iteration N" there,
so a test knows when to send the pre-emption warning: the job then stops after exactly that
iteration, however slow the machine."""

import os
import sys
import time

from meshlm.cli import main
from meshlm.training import stop_signal, trainer

WAIT_S = 60.0


def _wait_for_the_signal_at(stop_at: int):
    step, handle = trainer.launch_step, stop_signal.SignalFlag._handle
    came = []

    def record(self, signum, frame):
        came.append(signum)
        handle(self, signum, frame)

    def launch_step(run, state):
        loss = step(run, state)
        if state.iteration == stop_at:
            if run.ps.rank == 0:
                print(f"waiting for the stop signal at iteration {stop_at}", flush=True)
            deadline = time.monotonic() + WAIT_S
            while not came and time.monotonic() < deadline:
                time.sleep(0.05)
        return loss

    stop_signal.SignalFlag._handle = record
    trainer.launch_step = launch_step


if __name__ == "__main__":
    if os.environ.get("STOP_AT") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        _wait_for_the_signal_at(int(os.environ["STOP_AT"]))
    sys.exit(main(sys.argv[1:]))
