"""The router's logits GEMM on CUDA half inputs: x [T, h] · Wᵀ [h, E] → [T, E] fp32, on tensor cores.

The router runs in fp32 (Megatron's --moe-router-dtype fp32 semantics): the logits, softmax and top-k
in fp32. Written as ``F.linear(x.float(), W.float())`` cuBLAS takes SIMT fp32 kernels for E of 8–64
columns: ~200 µs of GPU a layer's forward and backward at 16,384 tokens × h 1,024 on an H200 (1.5 ms
a mixtral-small step), where the work is ~0.5 GFLOP. A bf16 × bf16 product is exact in fp32, so a
tensor-core GEMM of the half inputs with fp32 accumulation and output (``torch.mm(..., out_dtype=
torch.float32)``) gives the same logits but for the order of the fp32 sums (~112 µs the pair,
bench/RESULTS.md session 14). Backward: the input's gradient g · W in fp32 (g [T, E] fp32, exact
products), rounded to x's dtype as ``x.float()``'s backward would; the weight's gradient gᵀ · x with
g rounded to x's dtype first (a tensor-core GEMM, fp32 out; within one half ulp of the fp32 GEMM's
once rounded to the weight's dtype).
"""

from __future__ import annotations

import torch


class _Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = torch.mm(g, w.float()).to(x.dtype)
        gw = torch.mm(g.t().to(x.dtype), x, out_dtype=torch.float32).to(w.dtype)
        return gx, gw


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, h] · wᵀ ([E, h]) → [T, E] float32, for CUDA bf16/fp16 x and w of one dtype (module doc)."""
    return _Logits.apply(x, w)
