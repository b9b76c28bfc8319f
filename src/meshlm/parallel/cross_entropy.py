"""Vocab-parallel cross-entropy (Shoeybi et al. 2019, "Megatron-LM", §3): the full logits are never
gathered; the max, the sum of exponentials and the target logit are all-reduced over TP.

Memory-lean: forward saves only the logits it was given (bf16 under --bf16, never an fp32 copy) and
the log-sum-exp per token; backward recomputes softmax − one-hot from them, in the logits' own
buffer when the caller hands them over (``inplace``). Arithmetic runs in at least fp32
(``dtypes.at_least_fp32``: float64 stays float64). On the fast path the two element-wise passes
(statistics in forward, gradient in backward) are compiled into one kernel each, so no
logits-sized temporary exists.
"""

from __future__ import annotations

import functools

import torch

from ..dtypes import at_least_fp32
from ..fast import compile_fn
from . import comm


def _statistics(logits, logits_max, local, outside):
    """(Σ exp(logits − max), logits[target] − max (0 where the target is on another rank)), [...]."""
    shifted = at_least_fp32(logits) - logits_max.unsqueeze(-1)
    predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return shifted.exp().sum(dim=-1), predicted


def _gradient(logits, lse, local, outside, grad_loss):
    """(softmax − one-hot(target)) · grad_loss on this rank's slice, in the logits' dtype."""
    softmax = (at_least_fp32(logits) - lse.unsqueeze(-1)).exp()
    columns = torch.arange(logits.shape[-1], device=logits.device)
    hit = (columns == local.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return ((softmax - hit.to(softmax.dtype)) * grad_loss.unsqueeze(-1)).to(logits.dtype)


def _gradient_(logits, lse, local, outside, grad_loss):
    """_gradient written over logits (their buffer becomes the gradient); returns logits."""
    return logits.copy_(_gradient(logits, lse, local, outside, grad_loss))


@functools.lru_cache(maxsize=None)
def _kernels(fast: bool) -> tuple:
    """(statistics, gradient, in-place gradient): compiled on the fast path, else eager."""
    fns = (_statistics, _gradient, _gradient_)
    return tuple(compile_fn(f) for f in fns) if fast else fns


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, fast, inplace):
        statistics, gradient, gradient_ = _kernels(fast)
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        logits_max = comm.all_reduce(at_least_fp32(logits.amax(dim=-1)), group, op=torch.distributed.ReduceOp.MAX)
        sum_exp, predicted = statistics(logits, logits_max, local, outside)
        comm.all_reduce(predicted, group)
        comm.all_reduce(sum_exp, group)
        log_sum_exp = sum_exp.log()
        ctx.save_for_backward(logits, logits_max + log_sum_exp, local, outside)
        ctx.gradient = gradient_ if inplace else gradient
        return log_sum_exp - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local, outside = ctx.saved_tensors
        return ctx.gradient(logits, lse, local, outside, grad_loss), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group, *,
                                 fast: bool = False, inplace: bool = False) -> torch.Tensor:
    """Per-token loss −log softmax(logits)[target], shape of target, dtype at_least_fp32(logits).

    logits: [..., V_padded/tp], this rank's vocabulary slice starting at vocab_start, with padded
    vocabulary columns already −inf (zero probability, zero grad). target: int64, [...].
    fast: compiled element-wise passes (meshlm/fast.py). inplace: backward overwrites ``logits``
    with their gradient (for a caller that made them and reads them no more): no logits-sized
    allocation in backward.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, fast, inplace)
