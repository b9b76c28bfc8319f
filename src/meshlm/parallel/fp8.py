"""FP8 GEMMs for the tensor-parallel linears: tensorwise (current) scaling, with the amax reduced
over the TP group so that TP = k quantizes exactly as TP = 1.

The formats are those of Micikevicius et al. 2022, "FP8 Formats for Deep Learning": E4M3 (max 448)
for forward tensors and, under ``hybrid``, E5M2 (max 57344) for gradients (§3; Transformer Engine's
and Megatron's --fp8-format hybrid). A tensor t is scaled before the cast so that its largest
magnitude lands at the format's max, less a margin (Transformer Engine's scaling rule):

    amax = max |t|        scale = fp8_max / amax / 2^margin   (1 where amax = 0)
    t8 = cast(clamp(t · scale, ±fp8_max))                      t ≈ t8 / scale

and a GEMM of two scaled tensors is ``(a8 @ b8) / (scale_a · scale_b)`` with fp32 accumulation:
``torch._scaled_mm`` on the GPU (Hopper's FP8 tensor cores), or emulated (dequantize, then matmul
in the caller's dtype: float64 in the parity tests). The emulation and the GPU path share every
step but the matmul, so they agree to the rounding of the accumulation.

A linear y = x Wᵀ runs three FP8 GEMMs (Micikevicius et al. 2022, §4.1), on x [T, in], W [out, in]
and dy [T, out] (T = s·b tokens):

    forward   y  = x8  @ W8ᵀ        (E4M3 × E4M3)
    backward  dx = dy8 @ W8         (E5M2 or E4M3 × E4M3)
              dW = dy8ᵀ @ x8        (E5M2 or E4M3 × E4M3)

Backward keeps x8 (one byte an element) instead of x in bf16, and re-casts W with the forward's
scale (the same FP8 values) rather than keep an FP8 copy of every weight until backward. Under
--fp8-param-gather the weight arrives already in FP8 with its scale (``w8``, ``sw``: cast from the
fp32 master by the optimizer and all-gathered in FP8, optim/fp8_gather.py); the GEMMs take them as
they are, forward and backward, and the high-precision weight is not read.

Tensor parallelism: a tensor split over TP has its amax all-reduced (max) over ``group`` before
the scale is taken, so every rank scales by the amax of the full tensor. The weight is split in
both linears; in a column-parallel linear dy is split (its output columns) and x replicated (or
all-gathered from SP first), in a row-parallel one x is split (its input columns) and dy
replicated. With the same scales, the quantized values of a shard are those of the full tensor,
and TP = k computes the TP = 1 function (tests/test_fp8.py).

Under --fp8-recipe delayed the three scales come from a linear's amax histories instead
(parallel/fp8_delayed.py, ``state``): nothing is reduced at GEMM time, each operand's local amax
is recorded for the step's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..dtypes import wide
from . import comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings one linear needs (from --fp8-format, --fp8-margin).

    fmt: "e4m3" or "hybrid" (E5M2 gradients). margin: scale = max / amax / 2^margin.
    emulate: quantize → dequantize → matmul instead of ``torch._scaled_mm`` (True off CUDA).
    delayed: --fp8-recipe delayed, with its --fp8-amax-history-len and --fp8-amax-compute-algo
    (parallel/fp8_delayed.py).
    """

    fmt: str
    margin: int = 0
    emulate: bool = False
    delayed: bool = False
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    @classmethod
    def of(cls, t, device: torch.device) -> Optional["Fp8Recipe"]:
        """The recipe of TrainingConfig ``t`` (None without --fp8-format); emulated off CUDA."""
        if not t.fp8_format:
            return None
        return cls(t.fp8_format, t.fp8_margin, emulate=torch.device(device).type != "cuda",
                   delayed=t.fp8_recipe == "delayed", amax_history_len=t.fp8_amax_history_len,
                   amax_compute_algo=t.fp8_amax_compute_algo)


def amax(t: torch.Tensor, group=None) -> torch.Tensor:
    """max |t| as a 0-dim tensor in at least fp32, all-reduced (max) over group when given."""
    a = t.abs().amax().to(wide(t.dtype))
    if group is not None and comm.group_size(group) > 1:
        comm.all_reduce(a, group, dist.ReduceOp.MAX)
    return a


def scale_of(a: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2^margin, 1 where amax is 0 (a zero tensor needs no scale). a: 0-dim."""
    fp8_max = torch.finfo(dtype).max
    return torch.where(a > 0, fp8_max / a / 2.0 ** margin, torch.ones_like(a))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t · scale, saturated to ±fp8_max and rounded to dtype (E4M3/E5M2, round to nearest even)."""
    fp8_max = torch.finfo(dtype).max
    return (t.to(scale.dtype) * scale).clamp(-fp8_max, fp8_max).to(dtype)


def scaled_mm(a8: torch.Tensor, scale_a: torch.Tensor, b8: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a8 @ b8) / (scale_a · scale_b) in out_dtype. a8 [M, K] row-major, b8 [K, N] column-major
    (``torch._scaled_mm``'s layout rule; the emulation takes any layout). Emulated: each operand
    dequantized to wide(out_dtype), then one matmul."""
    if emulate:
        dt = wide(out_dtype)
        return ((a8.to(dt) / scale_a.to(dt)) @ (b8.to(dt) / scale_b.to(dt))).to(out_dtype)
    return torch._scaled_mm(a8, b8, scale_a=scale_a.float().reciprocal(), scale_b=scale_b.float().reciprocal(),
                            out_dtype=out_dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column (a copy unless it is already so)."""
    return t.t().contiguous().t()


class _Fp8Matmul(torch.autograd.Function):
    """y = x Wᵀ by FP8 GEMMs (see the module doc). x [T, in], weight [out, in] → y [T, out] in
    x's dtype. x_split: x is split over ``group`` (row-parallel); dy then is not, and the other
    way round (column-parallel). The weight is split whenever the group has more than one rank."""

    @staticmethod
    def forward(ctx, x, weight, w8, sw, state, record, group, x_split, fwd_dtype, grad_dtype, margin, emulate):
        delayed = state is not None and state.started  # the first step has no history: current scaling
        if state is not None and record:  # delayed: the amaxes recorded for the step's end
            state.record(0, x)
            state.record(1, weight)
        if delayed:  # the scales from the histories
            sx, sw = state.scale[0], state.scale[1]
        else:
            sx = scale_of(amax(x, group if x_split else None), fwd_dtype, margin)
        # row-major operands (torch._scaled_mm's rule): a cast can keep a permuted input's strides
        x8 = quantize(x, sx, fwd_dtype).contiguous()
        ctx.given, ctx.state, ctx.delayed = w8 is not None, state, delayed
        if ctx.given:  # --fp8-param-gather: the gathered FP8 weight and its scale, kept for backward
            ctx.save_for_backward(x8, sx, w8, sw)
        else:  # the weight is re-cast in backward: no FP8 copy kept
            if not delayed:
                sw = scale_of(amax(weight, group), fwd_dtype, margin)
            w8 = quantize(weight, sw, fwd_dtype).contiguous()
            ctx.save_for_backward(x8, sx, weight, sw)
        ctx.fwd_dtype = fwd_dtype
        ctx.group, ctx.dy_split, ctx.grad_dtype, ctx.margin, ctx.emulate = group, not x_split, grad_dtype, margin, emulate
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return scaled_mm(x8, sx, w8.t(), sw, x.dtype, emulate)

    @staticmethod
    def backward(ctx, dy):
        x8, sx, w, sw = ctx.saved_tensors
        if ctx.state is not None:
            ctx.state.record(2, dy)
        if ctx.delayed:
            sg = ctx.state.scale[2]
        else:
            sg = scale_of(amax(dy, ctx.group if ctx.dy_split else None), ctx.grad_dtype, ctx.margin)
        g8 = quantize(dy, sg, ctx.grad_dtype).contiguous()
        # the forward's FP8 weight: as gathered, or cast again (same scale, same values)
        w8 = w if ctx.given else quantize(w, sw, ctx.fwd_dtype)
        dx = scaled_mm(g8, sg, _column_major(w8), sw, ctx.x_dtype, ctx.emulate)
        dw = scaled_mm(g8.t().contiguous(), sg, _column_major(x8), sx, ctx.w_dtype, ctx.emulate)
        return dx, dw, None, None, None, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, group, x_split: bool,
               state=None) -> torch.Tensor:
    """x Wᵀ by FP8 GEMMs (no bias). x [s, b, in] (any leading dims), weight [out, in] → [s, b, out].
    group: the TP group the weight (and x, if x_split, else the output) is split over. A weight with
    ``fp8_data`` (E4M3 [out, in]) and ``fp8_scale`` (0-dim) set by --fp8-param-gather
    (parallel/data.py) is used in FP8 as it is; its gradient still goes to ``weight``. state: the
    linear's DelayedState under --fp8-recipe delayed (parallel/fp8_delayed.py; amaxes recorded only
    when autograd is on)."""
    lead = x.shape[:-1]
    w8, sw = getattr(weight, "fp8_data", None), getattr(weight, "fp8_scale", None)
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, w8, sw, state, torch.is_grad_enabled(), group,
                         x_split, recipe.forward_dtype,
                         recipe.grad_dtype, recipe.margin, recipe.emulate)
    return y.reshape(*lead, y.shape[-1])
