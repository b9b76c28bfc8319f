"""SwiGLU's activation with a one-pass backward: y [..., 2f] = [gate | up] → silu(gate) · up [..., f].

Autograd of ``F.silu(gate) * up`` on ``y.chunk(2)`` gives the two halves' gradients as two
expressions joined by the chunk's backward (a ``cat``); Inductor emits that as one kernel whose
every output element picks its half by index, so each of gate, up and the incoming gradient is
read once per half it feeds (14 bytes a gate/up pair in bf16 where 10 suffice). ``swiglu``'s
backward computes both halves of a pair from one read of gate, up and dz:
    s = sigmoid(gate)
    d_gate = dz · up · s · (1 + gate · (1 − s))      (d silu(x)/dx = s + x·s·(1 − s))
    d_up   = dz · gate · s
On CUDA in bf16/fp16/fp32 one Triton kernel (``meshlm::swiglu_backward``, a custom op: opaque to
torch.compile, no graph break; fp32 arithmetic, one rounding to the output dtype), elsewhere (CPU,
float64: the parity tests) the same formula in torch ops. The forward stays plain torch ops, which
the fast path's compile fuses with its neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of y [..., 2f] = [gate | up] → [..., f] (module doc)."""
    return _SwiGLU.apply(y)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dz):
        (y,) = ctx.saved_tensors
        if y.is_cuda and y.dtype in _TRITON_DTYPES:
            return torch.ops.meshlm.swiglu_backward(y, dz)
        return swiglu_backward_reference(y, dz)


def swiglu_backward_reference(y: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """dy [..., 2f] of ``swiglu`` at y [..., 2f] for dz [..., f], in torch ops (module doc's formula)."""
    gate, up = y.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    return torch.cat([dz * up * s * (1 + gate * (1 - s)), dz * gate * s], dim=-1)


@torch.library.custom_op("meshlm::swiglu_backward", mutates_args=(), device_types="cuda")
def _swiglu_backward_cuda(y: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """dy [..., 2f] for y [..., 2f], dz [..., f] on CUDA: one Triton kernel (model/swiglu_triton.py)."""
    from .swiglu_triton import swiglu_backward
    return swiglu_backward(y, dz)


@_swiglu_backward_cuda.register_fake
def _(y, dz):
    return torch.empty_like(y, memory_format=torch.contiguous_format)
