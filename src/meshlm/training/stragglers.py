"""Stragglers: every rank's own step time, gathered at log intervals, and the rank that lags.

Collectives make every rank's wall-clock step equally long (the fast ones wait for the slow one),
so a straggler shows only in the time a rank spends *outside* collectives: its own work. Each rank
adds up, per iteration, its step's seconds less the seconds it waited inside collectives
(parallel/watchdog.py's ``waited_s``); at each log iteration one all_gather over the world of one
float per rank gives every rank's mean over the interval, in rank order — metrics.jsonl's
``rank_iter_s``. A rank whose value exceeds ``FACTOR`` × the median of all ranks (and the median
by at least ``MIN_EXCESS_S``) for ``CONSECUTIVE`` log intervals in a row is a straggler: rank 0
prints one line naming it, its time and the median when it becomes one, and one line when it is
back within the bound; nothing in between (a state change, not a line per interval).

When a node runs more CPU (gloo) workers than it has cores, every rank's time is a share of the
same cores and tells nothing about the rank: rank 0 says so in one line at start and straggler
lines are off (``rank_iter_s`` is still recorded).

On CUDA the collectives return before they finish, so the host-side measure sees little of the
wait and a slow GPU is not told apart this way (Megatron's --log-straggler times kernels instead).
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from ..parallel import watchdog
from ..parallel.mesh import usable_cores
from ..straggler_rule import CONSECUTIVE, FACTOR, MIN_EXCESS_S


def shared_cores(ps) -> str:
    """One line when this node's CPU workers (LOCAL_WORLD_SIZE, else the world) outnumber its
    usable cores (gloo on CPU only); "" otherwise."""
    if ps.device.type != "cpu":
        return ""
    workers = int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size))
    cores = usable_cores()
    if workers <= cores:
        return ""
    return (f"meshlm: note: {workers} workers on {cores} CPU cores: they take turns on the cores, so step "
            f"times are shared-core times; straggler detection is off")


class StragglerWatch:
    """This rank's own-work seconds of the interval's iterations, and every rank's lag streak.
    Rank 0 prints ``shared_cores``'s line at construction when there is one (detection then off)."""

    def __init__(self, ps):
        self.ps = ps
        self.own_s, self.iters = 0.0, 0
        self.streak = [0] * ps.world_size
        self.flagged = [False] * ps.world_size  # named as a straggler, not yet said to be back
        note = shared_cores(ps)
        self.detect = not note
        if note and ps.rank == 0:
            print(note, flush=True)

    def add(self, iter_s: float, waited_s: float) -> None:
        """One iteration of ``iter_s`` seconds, ``waited_s`` of them inside collectives."""
        self.own_s += max(0.0, iter_s - waited_s)
        self.iters += 1

    def gather(self) -> list:
        """Every rank's mean own-work seconds per iteration since the last call (rank order);
        prints the straggler line on rank 0. Collective over the world (log iterations only)."""
        own = self.own_s / max(self.iters, 1)
        self.own_s, self.iters = 0.0, 0
        if self.ps.world_size == 1:  # no device round trip: its read would drain the GPU's queued step
            return [own]
        mine = torch.tensor([own], dtype=torch.float64, device=self.ps.device)
        parts = [torch.empty_like(mine) for _ in range(self.ps.world_size)]
        watchdog.call("all_gather of the step times", None, dist.all_gather, parts, mine)
        times = [float(p.item()) for p in parts]
        median = statistics.median(times)
        for r, t in enumerate(times if self.detect else ()):
            lags = t > FACTOR * median and t - median > MIN_EXCESS_S
            self.streak[r] = self.streak[r] + 1 if lags else 0
            line = None
            if lags and self.streak[r] == CONSECUTIVE:
                self.flagged[r] = True
                line = (f"straggler: rank {r} took {1000 * t:.1f} ms per iteration outside collectives, "
                        f"> {FACTOR}× the median {1000 * median:.1f} ms of all {len(times)} ranks, "
                        f"for {CONSECUTIVE} log intervals in a row (said again only if it recovers)")
            elif not lags and self.flagged[r]:
                self.flagged[r] = False
                line = (f"straggler: rank {r} recovered: {1000 * t:.1f} ms per iteration outside collectives, "
                        f"the median of all {len(times)} ranks {1000 * median:.1f} ms")
            if line and self.ps.rank == 0:
                print(line, flush=True)
        return times
