"""One AdamW step (Loshchilov & Hutter 2019) over lists of flat tensors, torch.optim.AdamW's arithmetic.

Per element, with step t (1-based), decoupled weight decay wd on the ``decay`` lists only:
    p ← p · (1 − lr · wd)
    m ← m + (1 − β1)(g − m)            (lerp, as torch's single-tensor AdamW)
    v ← β2 v + (1 − β2) g²
    p ← p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

Three implementations of the same update: ``fused`` runs ``torch._fused_adamw_`` (one multi-tensor
kernel that reads and writes each tensor once; torch.optim.AdamW(fused=True)'s kernel), otherwise
foreach kernels do the passes one at a time (the CPU and eager path, bitwise equal to per-tensor
ops). The tensors are fragment views of the optimizer's flat shards (optim/optimizer.py), grouped
into a decayed and a non-decayed list, so one call covers every shard.

``flat_adamw_`` (the fast path on CUDA) updates *runs*: maximal ranges of a shard whose fragments
share the decay and LR multiplier, all in one compiled call (``flat_steps`` under torch.compile,
dynamic sizes: one host call a step, however many runs), each run one element-wise kernel
(``flat_step``) that reads master, grad and moments once, writes them once, and
writes the new master into the bf16/fp16 params too (the publish of ``optimizer.step`` fused in:
28 + 2 bytes an element, against the multi-tensor kernel's 28 plus the publish's 4 + 2). Its
arithmetic is the fused kernel's (torch's fused_adam_utils.cuh, ADAMW mode): p ← p − lr·wd·p;
m ← β1 m + (1 − β1) g; v ← β2 v + (1 − β2) g²; p ← p − lr / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε),
with g the grad ÷ grad_scale (the grad itself left as it is).

Under --use-precision-aware-optimizer the moments may be stored in bf16 (--exp-avg-dtype,
--exp-avg-sq-dtype; Megatron-LM's precision-aware optimizer, as DeepSeek-V3 trains, §3.3.3): every
implementation reads them widened to the masters' dtype, updates in that dtype (the new params use
the unrounded moments), and stores them rounded to nearest: 4 + 4 bytes an element less to hold and
to move each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Group:
    """Parallel lists of same-shaped tensors: params (updated), grads, exp_avgs, exp_avg_sqs;
    ``decay``: whether weight decay applies; ``lr_mult``: the group's LR is lr × this (μP's
    hidden matrices, meshlm/mup.py); ``decoupled``: its LR is --decoupled-lr's schedule instead of
    --lr's (the word embedding and output layer: ``group_lr``)."""

    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    decay: bool
    lr_mult: float = 1.0
    decoupled: bool = False


def group_lr(g, lr: float, decoupled_lr: Optional[float]) -> float:
    """The LR of a Group or Run: (the decoupled LR for a ``decoupled`` one, else lr) × its lr_mult."""
    return (decoupled_lr if g.decoupled else lr) * g.lr_mult


def adamw_(groups: list, *, step: int, lr: float, betas: tuple, eps: float, weight_decay: float,
           fused: bool, grad_scale: float = 1.0, decoupled_lr: Optional[float] = None) -> None:
    """Update every group in place. grad_scale: the grads are used divided by it (gradient
    clipping folded into the update on the fused path; the foreach path expects it to be 1); a
    float, or a 0-dim fp32 device tensor (the optimizer's deferred step: no host read).
    decoupled_lr: the LR of ``decoupled`` groups (--decoupled-lr's schedule)."""
    b1, b2 = betas
    for g in groups:
        if not g.params:
            continue
        if g.exp_avgs[0].dtype != g.params[0].dtype or g.exp_avg_sqs[0].dtype != g.params[0].dtype:
            _narrow_moments(g, step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                            grad_scale=grad_scale, decoupled_lr=decoupled_lr)
            continue
        wd, lr_g = (weight_decay if g.decay else 0.0), group_lr(g, lr, decoupled_lr)
        if fused:
            device = g.params[0].device
            steps = [torch.full((), float(step), device=device)] * len(g.params)
            scale = grad_scale if isinstance(grad_scale, torch.Tensor) else \
                None if grad_scale == 1.0 else torch.full((), grad_scale, device=device)
            torch._fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, [], steps, lr=lr_g, beta1=b1,
                                beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                                grad_scale=scale)
            continue
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            raise ValueError("the foreach AdamW takes grads already scaled (grad_scale must be 1)")
        if wd:
            torch._foreach_mul_(g.params, 1 - lr_g * wd)
        torch._foreach_lerp_(g.exp_avgs, g.grads, 1 - b1)
        torch._foreach_mul_(g.exp_avg_sqs, b2)
        torch._foreach_addcmul_(g.exp_avg_sqs, g.grads, g.grads, value=1 - b2)
        denom = torch._foreach_sqrt(g.exp_avg_sqs)
        torch._foreach_div_(denom, (1 - b2 ** step) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(g.params, g.exp_avgs, denom, value=-lr_g / (1 - b1 ** step))


def _narrow_moments(g: Group, **kw) -> None:
    """``adamw_`` of a group whose moments are stored narrower than its params (bf16 under
    --use-precision-aware-optimizer): updated on copies in the params' dtype, stored back rounded
    to nearest, as the flat kernel does."""
    wide = Group(g.params, g.grads, [m.to(g.params[0].dtype) for m in g.exp_avgs],
                 [v.to(g.params[0].dtype) for v in g.exp_avg_sqs], g.decay, g.lr_mult, g.decoupled)
    adamw_([wide], **kw)
    torch._foreach_copy_(g.exp_avgs, wide.exp_avgs)
    torch._foreach_copy_(g.exp_avg_sqs, wide.exp_avg_sqs)


@dataclass
class Run:
    """One contiguous range of a shard: master [n] fp32 (updated), grad [n], exp_avg and exp_avg_sq
    [n] fp32, out [n] the model params to publish into (bf16/fp16; None when the master is the
    param), decay, lr_mult and decoupled as in ``Group``."""

    master: torch.Tensor
    grad: Optional[torch.Tensor]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: Optional[torch.Tensor]
    decay: bool
    lr_mult: float = 1.0
    decoupled: bool = False


def flat_step(p, g, m, v, out, lr_wd: float, b1: float, b2: float, step_size: float, bc2_sqrt: float,
              eps: float, grad_scale: float) -> None:
    """One AdamW update of flat tensors p, m, v in place (and out ← p when out is not None); the
    fused kernel's arithmetic (module doc). All [n]; m and v may be narrower than p (bf16: read
    widened, the update computed in p's dtype, stored rounded to nearest); scalars as Python
    floats, grad_scale a float or a 0-dim fp32 tensor."""
    g = g.to(p.dtype) / grad_scale
    p_new = p - lr_wd * p
    m_new = b1 * m.to(p.dtype) + (1 - b1) * g  # bf16 moments (--use-precision-aware-optimizer) widened
    v_new = b2 * v.to(p.dtype) + (1 - b2) * g * g
    p_new = p_new - step_size * m_new / (v_new.sqrt() / bc2_sqrt + eps)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    if out is not None:
        out.copy_(p_new)


def flat_steps(masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, outs: list, lr_wds: list,
               step_sizes: list, b1: float, b2: float, bc2_sqrt: float, eps: float, grad_scale) -> None:
    """``flat_step`` of every run, in one call: lists with one entry a run (outs: None where the master
    is the param; lr_wds, step_sizes: the run's floats), the rest shared. Compiled (the optimizer, on
    CUDA) it is one host call a step whatever the number of runs, one kernel a run, and one graph
    while the runs stay the same: the floats are graph inputs, not constants."""
    for p, g, m, v, out, lr_wd, step_size in zip(masters, grads, exp_avgs, exp_avg_sqs, outs, lr_wds, step_sizes):
        flat_step(p, g, m, v, out, lr_wd, b1, b2, step_size, bc2_sqrt, eps, grad_scale)


def flat_adamw_(runs: list, *, step: int, lr: float, betas: tuple, eps: float, weight_decay: float,
                grad_scale: float = 1.0, kernel=flat_steps, decoupled_lr: Optional[float] = None) -> None:
    """Update every run in place with one call of ``kernel`` (``flat_steps``, compiled by the optimizer
    on CUDA); the grads used ÷ grad_scale; each run's params published when it has ``out``."""
    if not runs:
        return
    b1, b2 = betas
    bc1 = 1 - b1 ** step
    bc2_sqrt = (1 - b2 ** step) ** 0.5
    lrs = [group_lr(r, lr, decoupled_lr) for r in runs]
    kernel([r.master for r in runs], [r.grad for r in runs], [r.exp_avg for r in runs],
           [r.exp_avg_sq for r in runs], [r.out for r in runs],
           [lr_r * (weight_decay if r.decay else 0.0) for lr_r, r in zip(lrs, runs)], [lr_r / bc1 for lr_r in lrs],
           b1, b2, bc2_sqrt, eps, grad_scale)
