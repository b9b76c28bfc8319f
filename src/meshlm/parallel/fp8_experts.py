"""FP8 GEMMs of the routed experts: tensorwise scaling per expert and source micro-batch.

An expert's linear y = x W_eᵀ runs the three FP8 GEMMs of a dense FP8 linear (parallel/fp8.py:
forward, dgrad, wgrad; same formats, margin and saturating cast), over the rows routed to it. The
scales must not depend on the layout (the parity rule), and an expert's rows do: at EP > 1 the
expert sees the rows of every EP rank's micro-batch at once, one process sees them one micro-batch
at a time. So the rows of an expert come in *blocks*, one per source micro-batch (one block per
expert at EP = 1; at EP > 1 one per (local expert, source EP rank), expert-major, as
parallel/experts.py lays them out), and each block is one tensorwise-scaled tensor:

    amax_b = max |x_b|  (max-reduced over the token group: the ranks that split one micro-batch's
                         tokens, TP under SP; their block tables line up, same experts and sources)
    x8_b = cast(x_b · scale_b)        y_b = (x8_b @ W8_eᵀ) / (scale_b · scale_W_e)

with W_e scaled by its own amax (experts are not split over TP). A block is then exactly the
tensor one process quantizes for that expert and micro-batch, whatever EP, DP and TP are. The
output gradient dy is scaled by blocks the same way; dx_b = dy8_b @ W8_e, and the weight gradient
sums the blocks' GEMMs, dW_e = Σ_b dy8_bᵀ @ x8_b / (scale_dy_b · scale_x_b) (a block's scales
cannot be taken out of a sum over the rows of several blocks).

On the GPU each block is one ``torch._scaled_mm`` (tensorwise scales; its rows padded with zeros to a
multiple of 16 where they are the contraction dimension, cuBLASLt's FP8 rule); emulated (dequantize,
then matmul in the caller's dtype) on CPU, as the dense path. The block sizes are host integers (one
host read of the counts per layer), so under torch.compile this function runs eagerly
(``fast.eager``): the experts' FP8 GEMMs are a graph break, the rest of the layer compiles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..dtypes import wide
from ..fast import eager
from . import comm
from .fp8 import Fp8Recipe, _column_major, amax, quantize, scale_of, scaled_mm

ALIGN = 16  # torch._scaled_mm's rule for the contraction dimension


def _block_amax(t: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """[B] max |rows| of each block of t [N, k] (0 for an empty block), max-reduced over group."""
    a = torch.stack([b.abs().amax() if b.shape[0] else b.new_zeros(()) for b in t.split(sizes)]).to(wide(t.dtype))
    if group is not None and comm.group_size(group) > 1:
        comm.all_reduce(a, group, dist.ReduceOp.MAX)
    return a


def _row_scales(scales: torch.Tensor, sizes: list) -> torch.Tensor:
    """[N, 1]: each row's block scale."""
    return scales.repeat_interleave(torch.tensor(sizes, device=scales.device)).unsqueeze(1)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t [n, k] with zero rows appended up to a multiple of ALIGN."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % ALIGN)) if t.shape[0] % ALIGN else t


class _Fp8Blocks(torch.autograd.Function):
    """y [N, out] = each block's rows of x [N, in] times its expert's weightᵀ (module doc)."""

    @staticmethod
    def forward(ctx, x, sizes, owner, recipe, group, *weights):
        fwd, emulate = recipe.forward_dtype, recipe.emulate
        sx = scale_of(_block_amax(x, sizes, group), fwd, recipe.margin)
        sw = [scale_of(amax(w), fwd, recipe.margin) for w in weights]
        x8 = quantize(x, _row_scales(sx, sizes), fwd).contiguous()
        w8 = [quantize(w, s, fwd) for w, s in zip(weights, sw)]
        out = [scaled_mm(xb, sx[b], w8[owner[b]].t(), sw[owner[b]], x.dtype, emulate)
               for b, xb in enumerate(x8.split(sizes)) if sizes[b]]
        ctx.save_for_backward(x8, sx, *weights)
        ctx.meta, ctx.sw, ctx.x_dtype = (sizes, owner, recipe, group), sw, x.dtype
        return torch.cat(out) if out else x.new_zeros((0, weights[0].shape[0]))

    @staticmethod
    def backward(ctx, dy):
        x8, sx, *weights = ctx.saved_tensors
        sizes, owner, recipe, group = ctx.meta
        gd, emulate = recipe.grad_dtype, recipe.emulate
        sg = scale_of(_block_amax(dy, sizes, group), gd, recipe.margin)
        g8 = quantize(dy, _row_scales(sg, sizes), gd).contiguous()
        w8 = [_column_major(quantize(w, s, recipe.forward_dtype)) for w, s in zip(weights, ctx.sw)]
        dx, dw = [], [torch.zeros(w.shape, dtype=wide(w.dtype), device=w.device) for w in weights]
        for b, (gb, xb) in enumerate(zip(g8.split(sizes), x8.split(sizes))):
            if not sizes[b]:
                continue
            e = owner[b]
            dx.append(scaled_mm(gb, sg[b], w8[e], ctx.sw[e], ctx.x_dtype, emulate))
            dw[e] += scaled_mm(_padded(gb).t().contiguous(), sg[b], _column_major(_padded(xb)), sx[b],
                               dw[e].dtype, emulate)
        dx = torch.cat(dx) if dx else dy.new_zeros((0, weights[0].shape[1]))
        return (dx, None, None, None, None, *(g.to(w.dtype) for g, w in zip(dw, weights)))


def blocks_of(counts: torch.Tensor, blocks) -> tuple:
    """(sizes, owner) host lists: the rows of each block and its local expert. counts [E_local]:
    rows per local expert; blocks: None (a block per expert: EP = 1) or the expert-major sizes of
    the (local expert, source EP rank) blocks (EP > 1: E_local · EP of them)."""
    if blocks is None:
        sizes = counts.tolist()  # the host read
        return sizes, list(range(len(sizes)))
    per_expert = len(blocks) // counts.shape[0]
    return list(blocks), [b // per_expert for b in range(len(blocks))]


@eager
def fp8_expert_linear(x: torch.Tensor, weights: list, counts: torch.Tensor, blocks, recipe: Fp8Recipe,
                      group) -> torch.Tensor:
    """x W_eᵀ for each block of rows by FP8 GEMMs (no bias; module doc).

    x [N, in]: rows sorted by local expert, in the blocks of ``blocks_of(counts, blocks)``;
    weights: the local experts' [out, in]; group: the token group (None: one rank). Returns
    [N, out] in x's dtype. Collective over group (one [B] all-reduce forward, one backward).
    """
    sizes, owner = blocks_of(counts, blocks)
    return _Fp8Blocks.apply(x, sizes, owner, recipe, group, *weights)
