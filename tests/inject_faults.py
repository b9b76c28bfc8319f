"""Test-only faults, injected into one rank by monkeypatching (``inject(spec)`` in-process, or as a
torchrun entry point: ``FAULT=<spec> torchrun … inject_faults.py pretrain <flags>``). Specs:

  hang:RANK:ITERATION   that rank sleeps 120 s at the start of the DP gradient reduction of that
                        iteration (the others wait in the bucket's all-reduce)
  nan:RANK:ITERATION    that rank's first model chunk outputs NaN in that iteration's forward
  slow:RANK:SECONDS     that rank sleeps SECONDS before every step's forward-backward
"""

import os
import sys
import time

import torch

from meshlm.cli import main
from meshlm.parallel.data import DistributedDataParallel
from meshlm.training import trainer

_iteration = [0]  # the iteration in flight (set by the wrapped launch_step)


def _count_iterations():
    launch = trainer.launch_step

    def launch_step(run, state):
        _iteration[0] = state.iteration + 1
        return launch(run, state)
    trainer.launch_step = launch_step


def _hang(rank: int, iteration: int):
    real = DistributedDataParallel.finish_grad_sync

    def finish_grad_sync(self):
        if self.ps.rank == rank and _iteration[0] == iteration:
            time.sleep(120.0)
        return real(self)
    DistributedDataParallel.finish_grad_sync = finish_grad_sync


def _nan(rank: int, iteration: int):
    real = trainer.forward_backward

    def forward_backward(chunks, *args, ps, **kwargs):
        hook = None
        if ps.rank == rank and _iteration[0] == iteration and kwargs.get("forward_only") is not True:
            hook = chunks[0].register_forward_hook(lambda module, inputs, out: out * float("nan"))
        try:
            return real(chunks, *args, ps=ps, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
    trainer.forward_backward = forward_backward


def _slow(rank: int, seconds: float):
    real = trainer.forward_backward

    def forward_backward(chunks, *args, ps, **kwargs):
        if ps.rank == rank and kwargs.get("forward_only") is not True:
            time.sleep(seconds)
        return real(chunks, *args, ps=ps, **kwargs)
    trainer.forward_backward = forward_backward


def inject(spec: str) -> None:
    """Apply one fault spec (module doc) to this process."""
    kind, rank, value = spec.split(":")
    _count_iterations()
    {"hang": lambda: _hang(int(rank), int(value)), "nan": lambda: _nan(int(rank), int(value)),
     "slow": lambda: _slow(int(rank), float(value))}[kind]()


def weights(run) -> torch.Tensor:
    """Every parameter of this rank, flattened into one float64 vector (to compare steps)."""
    return torch.cat([p.detach().reshape(-1).double().cpu() for c in run.chunks for p in c.parameters()])


if __name__ == "__main__":
    if os.environ.get("FAULT"):
        inject(os.environ["FAULT"])
    sys.exit(main(sys.argv[1:]))
