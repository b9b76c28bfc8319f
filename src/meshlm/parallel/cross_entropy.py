"""Vocab-parallel cross-entropy (Shoeybi et al. 2019, "Megatron-LM", §3): the full logits are never
gathered; the max, the sum of exponentials and the target logit are all-reduced over TP.

Memory-lean: forward saves only the logits it was given (bf16 under --bf16, never an fp32 copy) and
the log-sum-exp per token; backward recomputes softmax − one-hot from them, in the logits' own
buffer when the caller hands them over (``inplace``). Arithmetic runs in at least fp32
(``dtypes.at_least_fp32``: float64 stays float64). On the fast path the two element-wise passes
(statistics in forward, gradient in backward) are compiled into one kernel each, so no
logits-sized temporary exists. Vocabulary padding is excluded inside those passes (``valid``), so
the padded columns cost no masking pass over the logits of their own.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..dtypes import at_least_fp32
from ..fast import compile_fn
from . import comm


def _statistics(logits, logits_max, local, outside, valid: int):
    """(Σ exp(logits − max) over the first ``valid`` columns, logits[target] − max (0 where the
    target is on another rank)), [...]."""
    shifted = at_least_fp32(logits) - logits_max.unsqueeze(-1)
    predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    exp = shifted.exp()
    if valid < logits.shape[-1]:
        exp = exp.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= valid, 0.0)
    return exp.sum(dim=-1), predicted


def _gradient(logits, lse, local, outside, grad_loss, valid: int):
    """(softmax − one-hot(target)) · grad_loss on this rank's slice (0 on padded columns), in the
    logits' dtype."""
    softmax = (at_least_fp32(logits) - lse.unsqueeze(-1)).exp()
    columns = torch.arange(logits.shape[-1], device=logits.device)
    if valid < logits.shape[-1]:
        softmax = softmax.masked_fill(columns >= valid, 0.0)
    hit = (columns == local.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return ((softmax - hit.to(softmax.dtype)) * grad_loss.unsqueeze(-1)).to(logits.dtype)


def _gradient_(logits, lse, local, outside, grad_loss, valid: int):
    """_gradient written over logits (their buffer becomes the gradient); returns logits."""
    return logits.copy_(_gradient(logits, lse, local, outside, grad_loss, valid))


@functools.lru_cache(maxsize=None)
def _kernels(fast: bool) -> tuple:
    """(statistics, gradient, in-place gradient): compiled on the fast path, else eager."""
    fns = (_statistics, _gradient, _gradient_)
    return tuple(compile_fn(f) for f in fns) if fast else fns


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, fast, inplace, valid):
        statistics, gradient, gradient_ = _kernels(fast)
        local = target - vocab_start
        outside = (local < 0) | (local >= valid)
        local = local.masked_fill(outside, 0)
        # a rank holding only padding (valid 0) contributes −inf to the max and 0 to the sums
        real = logits[..., :valid] if valid else torch.full_like(logits[..., :1], float("-inf"))
        logits_max = comm.all_reduce(at_least_fp32(real.amax(dim=-1)), group, op=torch.distributed.ReduceOp.MAX)
        sum_exp, predicted = statistics(logits, logits_max, local, outside, valid)
        comm.all_reduce(predicted, group)
        comm.all_reduce(sum_exp, group)
        log_sum_exp = sum_exp.log()
        ctx.save_for_backward(logits, logits_max + log_sum_exp, local, outside)
        ctx.gradient, ctx.valid = (gradient_ if inplace else gradient), valid
        return log_sum_exp - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, outside = ctx.saved_tensors
        return ctx.gradient(logits, lse, local, outside, grad_loss, ctx.valid), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group, *,
                                 valid: Optional[int] = None, fast: bool = False,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss −log softmax(logits)[target], shape of target, dtype at_least_fp32(logits).

    logits: [..., V_padded/tp], this rank's vocabulary slice starting at vocab_start. valid: how
    many of its columns are real vocabulary (default all); the rest are padding, whatever their
    values: zero probability, zero gradient. target: int64, [...], in the real vocabulary.
    fast: compiled element-wise passes (meshlm/fast.py). inplace: backward overwrites ``logits``
    with their gradient (for a caller that made them and reads them no more): no logits-sized
    allocation in backward.
    """
    valid = logits.shape[-1] if valid is None else valid
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, fast, inplace, valid)
