"""Numerical faults of a step: which rank a NaN/inf came from, and loss spikes.

**Origin of a NaN/inf.** The trainer's check is global (the loss after the DP reduction, the grad
norm after the TP/PP/DP reductions), so once it fails every rank sees the fault and none knows
where it arose. Each rank keeps two local facts that cost no communication: its own micro-batch
losses (the last pipeline stage; nothing is computed until asked) and, under
--check-for-nan-in-loss-and-grad (Megatron's default, off with --no-check-for-nan-in-loss-and-grad),
one sum per gradient bucket taken before the bucket's DP reduction (parallel/data.py: a NaN or
inf element makes it non-finite; one reduction kernel per bucket, no host sync). Only when the
global check fails does ``nan_origin`` gather them (one all_gather_object over the world) and name
the ranks, with their (dp, tp, pp, cp) coordinates. Megatron checks the same two places
(pretrain_gpt.py loss_func, param_and_grad_buffer.py before the DP collective) with a host sync each.

**Loss spikes** (--loss-spike-threshold FACTOR, 0 off): a step whose loss exceeds FACTOR × the
mean of the last ``WINDOW`` finite losses (after at least ``WARMUP`` of them) is a spike;
metrics.jsonl's record of that interval gets ``"loss_spike": true``, and the trainer prints one
line when the losses start spiking and one when they are back below the bound (``LossSpikes.
report``), not a line per spiking step (a spike is kept out of the mean, so a loss that stays high
would otherwise print every iteration).
Megatron's --check-for-spiky-loss compares the local loss with 10 × the largest of its first 100
values instead (a fixed reference); a running mean follows the falling loss of a real run.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel import watchdog

WINDOW = 20
WARMUP = 5


def nan_origin(ps, outputs: list, local_grads_finite: Optional[bool]) -> str:
    """The ranks where the step's NaN/inf arose, in words (collective over the world: every rank
    calls it when the global check fails). outputs: this rank's forward_backward results (its
    micro-batch losses, on the last stage); local_grads_finite: whether this rank's gradients were
    finite before the DP reduction (None when --no-check-for-nan-in-loss-and-grad)."""
    loss_ok = None if not outputs else bool(all(torch.isfinite(d["lm_loss"]).all() for d in outputs))
    mine = {"rank": ps.rank, "at": f"dp={ps.dp_rank} tp={ps.tp_rank} pp={ps.pp_rank} cp={ps.cp_rank}",
            "loss_ok": loss_ok, "grads_ok": local_grads_finite}
    every = [mine]
    if ps.world_size > 1:
        every = [None] * ps.world_size
        watchdog.call("all_gather of the NaN/inf origins", None, dist.all_gather_object, every, mine)
    bad_loss = [f"{e['rank']} ({e['at']})" for e in every if e["loss_ok"] is False]
    bad_grads = [f"{e['rank']} ({e['at']})" for e in every if e["grads_ok"] is False]
    parts = []
    if bad_loss:
        parts.append(f"local loss non-finite on rank(s) {', '.join(bad_loss)}")
    if bad_grads:
        parts.append(f"local gradients non-finite before the DP reduction on rank(s) {', '.join(bad_grads)}")
    if not parts:
        unchecked = any(e["grads_ok"] is None for e in every)
        return ("every rank's local loss was finite; local gradients not checked "
                "(--no-check-for-nan-in-loss-and-grad)" if unchecked else
                "every rank's local loss and gradients were finite: the reductions overflowed")
    return "; ".join(parts)


class LossSpikes:
    """Running-mean spike test of --loss-spike-threshold (see module doc). factor 0: never a spike."""

    def __init__(self, factor: float):
        self.factor = factor
        self.recent: deque = deque(maxlen=WINDOW)
        self.spiking = 0  # spiking steps in a row, up to the last reported one

    def check(self, loss: Optional[float]) -> Optional[float]:
        """Record a step's loss (None or non-finite: ignored); return the running mean it exceeded
        ``factor`` times, None when it is no spike. A spike is kept out of the mean."""
        if not self.factor or loss is None or not math.isfinite(loss):
            return None
        if len(self.recent) >= WARMUP:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return mean
        self.recent.append(loss)
        return None

    def report(self, iteration: int, loss: Optional[float], mean: Optional[float]) -> Optional[str]:
        """The line to print after ``check`` returned ``mean`` for this step's ``loss``: one when a
        run of spikes starts, one when the first step after it is none; None otherwise (a skipped
        or NaN step, None loss, changes nothing)."""
        if loss is None or not math.isfinite(loss):
            return None
        if mean is not None:
            self.spiking += 1
            if self.spiking > 1:
                return None
            return (f"loss spike at iteration {iteration}: lm loss {loss:.6E} > {self.factor:g} × the mean "
                    f"{mean:.6E} of the last {len(self.recent)} losses (--loss-spike-threshold); "
                    f"said again when the losses are back below it")
        if not self.spiking:
            return None
        steps, self.spiking = self.spiking, 0
        return (f"loss back below {self.factor:g} × the running mean at iteration {iteration} "
                f"({loss:.6E}) after {steps} spiking step(s) (--loss-spike-threshold)")
