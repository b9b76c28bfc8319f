"""Compute-dtype rules shared by the model, the loss and the optimizer.

Reductions and the optimizer run in fp32 when params are bf16/fp16 ("at least fp32") and keep the
params' own dtype when it is wider: the parity tests train in float64, where a cast to fp32 would
add rounding of 1e-7 relative, far above the 1e-10 they check (DESIGN.md, "Correctness rule").
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def wide(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16, else dtype itself (fp32 or float64)."""
    return torch.float32 if dtype in HALF else dtype


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 when it is bf16/fp16, else x itself (no copy)."""
    return x.float() if x.dtype in HALF else x
