"""The delayed FP8 recipe (--fp8-recipe delayed; Transformer Engine's delayed scaling, Megatron's
--fp8-amax-history-len and --fp8-amax-compute-algo): the three operands of an FP8 linear (x, W, dy)
are scaled by an amax taken from a history of earlier steps' amaxes instead of their current one.

Per FP8 linear and operand k ∈ (x, W, dy), with L = --fp8-amax-history-len:

    history_k [L]   the amaxes of the last L steps, newest first (zeros before the first step)
    scale_k         fmax_k / a / 2^margin, a = max(history_k) (``max``) or history_k[0]
                    (``most_recent``); where a is 0 (or NaN) the scale stays as it was
    amax_k          the running max of |operand| over this step's GEMM calls

so the GEMMs of step t > 1 use scales computed from steps 1 … t − 1, and step t's amax is pushed into the history after it (``end_step``, called by the trainer once the gradients are
reduced): the running amaxes of every FP8 linear of the rank, one [linears × 3] vector, are
max-reduced over TP and DP × CP (as Megatron's amax reduction group), so every rank of a pipeline
stage holds the same histories and scales and every layout computes the one-process function
(tests/test_fp8.py: TP 2, DP 2, PP 2 against one process in float64). The running max makes the
count of GEMM calls irrelevant: micro-batches and the forward that recompute runs again add nothing
new. A forward without autograd (evaluation) records nothing. Values beyond a delayed scale's
range saturate at ±fmax (parallel/fp8.py's ``quantize``).

The first step has no history: its GEMMs scale each operand by its current amax (the tensorwise
rule, reduced over TP), as torchao's delayed scaling initialises from the first iteration;
Transformer Engine starts from scale 1 instead, which is not exact across layouts: the loss's
gradient per rank is DP times one process's per micro-batch (each rank averages fewer
micro-batches), and only a scale that follows the amax absorbs that power of two.

The histories are not checkpointed: a resumed run starts them at zero, its first step scaling by
the current amaxes as a new run's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import watchdog


class DelayedState:
    """One FP8 linear's delayed-scaling state (module doc): ``history`` [3, L], ``scale`` [3] (the
    scales this step's GEMMs use, x, W, dy), ``amax`` [3] (this step's running max, local), in
    ``dtype`` (the linear's wide dtype: fp32, float64 in tests)."""

    def __init__(self, recipe, dtype: torch.dtype, device):
        self.algo, self.margin = recipe.amax_compute_algo, recipe.margin
        self.history = torch.zeros(3, recipe.amax_history_len, dtype=dtype, device=device)
        self.scale = torch.ones(3, dtype=dtype, device=device)
        self.amax = torch.zeros(3, dtype=dtype, device=device)
        self.steps = 0  # histories pushed
        # whether a history exists (False: the first step scales by the current amaxes); a bool, which
        # compiled code may read: it changes once, where the count would recompile the layers every step
        self.started = False
        fmax = [torch.finfo(d).max for d in (recipe.forward_dtype, recipe.forward_dtype, recipe.grad_dtype)]
        self.fp8_max = torch.tensor(fmax, dtype=dtype, device=device)

    def record(self, k: int, t: torch.Tensor) -> None:
        """amax_k = max(amax_k, max |t|) (this rank's part of the operand: reduced in ``end_step``)."""
        self.amax[k] = torch.maximum(self.amax[k], t.detach().abs().amax().to(self.amax.dtype))

    def push(self, amax: torch.Tensor) -> None:
        """Step end: amax [3] (reduced) enters the history, the scales follow it, the running max restarts."""
        self.history.copy_(torch.cat([amax[:, None], self.history[:, :-1]], 1))
        a = self.history.amax(1) if self.algo == "max" else self.history[:, 0]
        self.scale.copy_(torch.where(a > 0, self.fp8_max / a / 2.0 ** self.margin, self.scale))
        self.amax.zero_()
        self.steps += 1
        self.started = True


def delayed_states(chunks) -> list:
    """The DelayedState of every FP8 linear of ``chunks`` (set by model.chunks.apply_fp8), in module order."""
    return [m.fp8_state for c in chunks for m in c.modules() if getattr(m, "fp8_state", None) is not None]


def end_step(states: list, groups) -> None:
    """Push this step's amaxes into every history (module doc). groups: the TP and DP × CP groups
    (None entries skipped); collective over them: every rank of the stage calls it once a step."""
    if not states:
        return
    amax = torch.stack([s.amax for s in states])
    for g in groups:
        if g is not None:
            watchdog.call("all_reduce of the FP8 amaxes", g, dist.all_reduce, amax, op=dist.ReduceOp.MAX, group=g)
    for s, a in zip(states, amax):
        s.push(a)
