"""FP8 GEMMs of the routed experts: the rowwise recipe, one grouped FP8 GEMM per projection and pass.

An expert's linear y = x W_eᵀ (x [N_e, k], W_e [n, k]) runs three GEMMs, each one
``torch._scaled_grouped_mm`` over all local experts (offsets: the cumulative rows per expert), with
rowwise scales (torchao's float8 "rowwise" recipe, per-token activations and per-channel weights;
the same saturating cast and margin as parallel/fp8.py, scale = fp8_max / amax / 2^margin):

    forward  y  = x8 @ W8ᵀ     x: a scale per row (token, amax over k); W_e: per output channel (over k)
    dgrad    dx = dy8 @ W8'    dy: per row (over n); W_e: per input channel (amax over n), a second cast
    wgrad    dW_e = Σ_b dy8_bᵀ @ x8_b   per block b of rows: dy per (b, output channel), x per (b, input
                                        channel), amax over the block's rows

A row is one token, whole on the rank that holds it, and an expert's weight is one tensor (expert
TP 1, gathered before use under ZeRO-3), so the forward and dgrad scales are the same whatever the
layout: no reduction. The weight gradient contracts over tokens, so its scales run along the rows,
and an expert's rows depend on the layout (at EP > 1 it sees the rows of every EP rank's
micro-batch at once, one process sees them one micro-batch at a time). So its rows come in *blocks*,
one per source micro-batch: one per expert at EP = 1; at EP > 1 one per (local expert, source EP
rank), expert-major, as parallel/experts.py lays them out. A block's column amax is max-reduced over
the token group (the ranks that split one micro-batch's tokens, TP under SP), so it is the one
process's amax for that expert and micro-batch; the grouped GEMM then runs one group per block (2d ×
2d, the offsets along the contraction; each block's rows moved to a multiple of 16, zero rows
between, which the op needs: 40 rows failed its device assertion on the H200) and each expert sums
its blocks.

All operands are E4M3, under ``hybrid`` too: ``torch._scaled_grouped_mm`` takes E4M3 only (torch
2.11), and a per-row or per-block scale gives a gradient the range E5M2 would. Rows past the last
offset (slots the capacity dropped) take no part and their outputs are undefined (the caller masks
them). On the GPU the output is bf16 (the op's only output); other dtypes, and CPU, run the
emulation: each operand dequantized to the caller's dtype (float64 in the parity tests), then each
group's matmul, the rows selected with ``torch.where`` (the same products per row, no host read).
At EP = 1 nothing reads the host, so the fast path compiles it with the layer; at EP > 1 the blocks
are host integers already (the all-to-all's split sizes) and it runs eagerly (``fast.eager``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dtypes import wide
from ..fast import eager
from . import comm
from .fp8 import E4M3, Fp8Recipe, quantize, scale_of

ALIGN = 16  # the 2d × 2d grouped GEMM: each group's rows (its contraction) a multiple of 16 bytes


def _rowwise(t: torch.Tensor, dim: int, margin: int) -> tuple:
    """(t8, scale): t in E4M3, scaled so each slice along ``dim`` has its amax at the max (keepdim)."""
    s = scale_of(t.abs().amax(dim, keepdim=True).to(wide(t.dtype)), E4M3, margin)
    return quantize(t, s, E4M3), s


def _group_of_rows(offs: torch.Tensor, n: int) -> torch.Tensor:
    """[n] each row's group (offs: cumulative ends); rows past the last offset get len(offs)."""
    return torch.searchsorted(offs, torch.arange(n, device=offs.device, dtype=offs.dtype), right=True)


def _aligned(t: torch.Tensor, offs: torch.Tensor) -> tuple:
    """(t', offs'): t [N, c]'s rows moved so that each group of rows (ends offs [G]) starts at a
    multiple of ALIGN, zero rows between (the rows past the offsets last); t' has the static
    length N + (ALIGN − 1)·G rounded up to ALIGN, offs' the moved ends."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (sizes + ALIGN - 1) // ALIGN * ALIGN
    ends = padded.cumsum(0).to(offs.dtype)
    shift = torch.cat([(ends - padded) - (offs - sizes), ends[-1:] - offs[-1:]])  # [G + 1] moved − old start
    rows = torch.arange(t.shape[0], device=t.device, dtype=offs.dtype)
    dest = (rows + shift[_group_of_rows(offs, t.shape[0])]).to(torch.int64)
    n = -(-(t.shape[0] + (ALIGN - 1) * offs.shape[0]) // ALIGN) * ALIGN
    return t.new_zeros(n, t.shape[1]).index_copy(0, dest, t), ends


def _block_scales(t: torch.Tensor, offs: torch.Tensor, margin: int, group) -> torch.Tensor:
    """[G, c] the scale of each (block, column) of t [N, c]: amax over the block's rows (0 rows: 1),
    max-reduced over ``group``."""
    ends = torch.cat([offs, offs.new_full((1,), t.shape[0])]).to(torch.int64)
    lengths = torch.diff(ends, prepend=ends.new_zeros(1))  # the last: the rows past the offsets, dropped
    a = torch.segment_reduce(t.abs(), "max", lengths=lengths, axis=0, unsafe=True, initial=0)[:-1]
    a = a.to(wide(t.dtype)).contiguous()
    if group is not None and comm.group_size(group) > 1:
        comm.all_reduce(a, group, dist.ReduceOp.MAX)
    return scale_of(a, E4M3, margin)


def _grouped(a8, sa, b8, sb, offs, out_dtype, emulate: bool) -> torch.Tensor:
    """Σ_k a[i, k] b[g(i), k, j] / (sa[i] sb[g(i), j]): a8 [N, K] row-major, sa [N, 1]; b8 [G, K, M]
    column-major, sb [G, 1, M]; g(i) the group of row i by offs [G] → [N, M] in out_dtype."""
    if not emulate:
        return torch._scaled_grouped_mm(a8, b8, sa.reciprocal().flatten(), sb.reciprocal().flatten(1), offs=offs,
                                        out_dtype=out_dtype)
    dt = wide(out_dtype)
    a, b = a8.to(dt) / sa.to(dt), b8.to(dt) / sb.to(dt)
    rows = _group_of_rows(offs, a.shape[0]).unsqueeze(1)
    y = a.new_zeros(a.shape[0], b.shape[2])
    for g in range(b.shape[0]):
        y = torch.where(rows == g, a @ b[g], y)
    return y.to(out_dtype)


def _grouped_wgrad(a8, sa, b8, sb, offs, out_dtype, emulate: bool) -> torch.Tensor:
    """[G, M, P]: group g's a[:, rows_g] @ b[rows_g] / (sa[g, m] sb[g, p]); a8 [M, N] row-major,
    b8 [N, P] column-major, sa [G, M], sb [G, P], the groups' rows by offs [G] (2d × 2d)."""
    if not emulate:
        return torch._scaled_grouped_mm(a8, b8, sa.reciprocal().flatten(), sb.reciprocal().flatten(), offs=offs,
                                        out_dtype=out_dtype)
    dt = wide(out_dtype)
    rows = _group_of_rows(offs, b8.shape[0])
    out = []
    for g in range(sa.shape[0]):
        keep = (rows == g).to(dt)
        out.append((a8.to(dt) * keep / sa[g].to(dt).unsqueeze(1)) @ (b8.to(dt) / sb[g].to(dt)))
    return torch.stack(out).to(out_dtype)


class _Fp8Grouped(torch.autograd.Function):
    """y [N, n] = x [N, k] times its expert's weightᵀ, w [E, n, k] (module doc). offs [E] the experts'
    row ends, block_offs [E·per] the blocks' (per blocks an expert, expert-major; None: offs, a block
    per expert — not offs itself: dynamo refuses a tensor passed twice to one apply)."""

    @staticmethod
    def forward(ctx, x, w, offs, block_offs, per, margin, emulate, group):
        x8, sx = _rowwise(x, 1, margin)                       # [N, k], [N, 1]
        x8 = x8.contiguous()  # row-major operands (the op's rule): a cast can keep a permuted input's strides
        w8, sw = _rowwise(w, 2, margin)                       # [E, n, k], [E, n, 1]
        ctx.save_for_backward(x, w, offs, block_offs)
        ctx.meta = per, margin, emulate, group
        return _grouped(x8, sx, w8.transpose(1, 2), sw.transpose(1, 2), offs, x.dtype, emulate)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, block_offs = ctx.saved_tensors
        per, margin, emulate, group = ctx.meta
        block_offs = offs if block_offs is None else block_offs
        g8, sg = _rowwise(dy, 1, margin)                      # [N, n], [N, 1]
        wt8, swt = _rowwise(w.transpose(1, 2), 2, margin)     # [E, k, n] per input channel
        dx = _grouped(g8.contiguous(), sg, wt8.contiguous().transpose(1, 2), swt.transpose(1, 2), offs, x.dtype,
                      emulate)
        (dyp, ends), (xp, _) = _aligned(dy, block_offs), _aligned(x, block_offs)  # zero rows between blocks
        sgb, sxb = _block_scales(dyp, ends, margin, group), _block_scales(xp, ends, margin, group)
        rows = _group_of_rows(ends, xp.shape[0])
        g8b = quantize(dyp, torch.cat([sgb, sgb.new_ones(1, sgb.shape[1])])[rows], E4M3)  # [N', n]
        x8b = quantize(xp, torch.cat([sxb, sxb.new_ones(1, sxb.shape[1])])[rows], E4M3)   # [N', k]
        dw = _grouped_wgrad(g8b.t().contiguous(), sgb, x8b.t().contiguous().t(), sxb, ends, w.dtype, emulate)
        if per > 1:
            dw = dw.to(wide(w.dtype)).view(w.shape[0], per, *w.shape[1:]).sum(1).to(w.dtype)
        return dx, dw, None, None, None, None, None, None


def fp8_expert_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, blocks, recipe: Fp8Recipe,
                      group) -> torch.Tensor:
    """x W_eᵀ for each expert's rows by grouped FP8 GEMMs, the rowwise recipe (no bias; module doc).

    x [N, k]: rows sorted by local expert; w [E_local, n, k]: the local experts' stacked weights;
    counts [E_local] int64: rows per expert (a device tensor, never read on the host); blocks: None
    (EP = 1: a block per expert) or the expert-major host sizes of the (local expert, source EP rank)
    blocks (E_local · EP of them); group: the token group (None: one rank). Returns [N, n] in x's
    dtype, undefined past Σ counts. Collective over group in backward (two [blocks, width] max
    all-reduces). Emulated off CUDA and for dtypes other than bf16.
    """
    emulate = recipe.emulate or x.dtype != torch.bfloat16
    offs = counts.cumsum(0).to(torch.int32)
    if blocks is None:
        return _Fp8Grouped.apply(x, w, offs, None, 1, recipe.margin, emulate, group)
    return _blocked(x, w, offs, blocks, recipe.margin, emulate, group)


@eager
def _blocked(x, w, offs, blocks, margin, emulate, group):
    """EP > 1: the blocks' offsets from their host sizes (eager: the sizes change every step)."""
    block_offs = torch.tensor(blocks, device=x.device).cumsum(0).to(torch.int32)
    return _Fp8Grouped.apply(x, w, offs, block_offs, len(blocks) // w.shape[0], margin, emulate, group)
