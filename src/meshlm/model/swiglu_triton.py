"""The Triton kernel of ``swiglu``'s backward (model/swiglu.py; imported on CUDA only, where Triton is).

Each program takes a tile of BLOCK_R rows × BLOCK_C pair columns j of y [rows, 2f]: it reads
gate[:, j], up[:, j] = y[:, f + j] and dz[:, j] once and writes dy[:, j] and dy[:, f + j]
(10 bytes a pair in bf16), in fp32 with one rounding to y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _backward(y_ptr, dz_ptr, dy_ptr, rows, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None].to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < f)
    at = r * (2 * f) + c
    gate = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + at + f, mask=mask, other=0.0).to(tl.float32)
    dz = tl.load(dz_ptr + r * f + c, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dz * up * s * (1.0 + gate * (1.0 - s))
    d_up = dz * gate * s
    tl.store(dy_ptr + at, d_gate.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + at + f, d_up.to(dy_ptr.dtype.element_ty), mask=mask)


def swiglu_backward(y: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """dy [..., 2f] (contiguous) of silu(gate) · up at y [..., 2f] for dz [..., f]."""
    y, dz = y.contiguous(), dz.contiguous()
    f = dz.shape[-1]
    rows = dz.numel() // f if f else 0
    dy = torch.empty_like(y)
    if rows == 0 or f == 0:
        return dy
    block_c = min(512, triton.next_power_of_2(f))
    block_r = max(1, 2048 // block_c)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(f, block_c))
    _backward[grid](y, dz, dy, rows, f, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return dy
