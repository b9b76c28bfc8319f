"""Core attention's forward + backward at mixtral-small's shape on one GPU, by SDPA backend and input
layout (issue 31: attention was 12.7 ms of a 108.5 ms MoE step in session 15's profile, ~300 TFLOP/s).

Usage (lent H200, repository root):
    python bench/sdpa_probe.py [--batch 8 --seq 2048 --heads 16 --groups 8 --head-dim 64]
Inputs as model/attention.py hands them to SDPA: q [b, n, s, d] and k/v [b, n_kv, s, d] as permuted
views of [s, b, n, d] projections (``permuted``) or contiguous copies, causal, bf16, GQA by
``enable_gqa`` (or k/v repeated to n heads: ``expanded``). Each row: median ms of 30 CUDA-event timings
of forward + backward (bench/grouped_gemm_probe.py ``timed``), TFLOP/s counting the causal half of
4·b·n·s²·d forward and 2.5× that backward; a backend that refuses the inputs is reported as such.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_gemm_probe import timed  # noqa: E402


def inputs(b: int, s: int, n: int, g: int, d: int, permuted: bool, expanded: bool) -> tuple:
    """(q, k, v) with requires_grad, laid out as the case says (module doc)."""
    def make(heads):
        t = torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        return t if permuted else t.contiguous()
    q, k, v = make(n), make(g), make(g)
    if expanded:
        k, v = (t.repeat_interleave(n // g, dim=1) for t in (k, v))
    return tuple(t.detach().requires_grad_() for t in (q, k, v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 8), ("seq", 2048), ("heads", 16), ("groups", 8), ("head-dim", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    b, s, n, g, d = a.batch, a.seq, a.heads, a.groups, a.head_dim
    flops = 3.5 * 4 * b * n * s * s * d / 2
    print(f"b {b}, s {s}, heads {n}/{g}, d {d}: {flops / 1e9:.0f} GFLOP forward + backward (causal)")
    print("| backend | layout | kv | ms | TFLOP/s |\n|---|---|---|---|---|")
    grad = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, None):
        for permuted in (True, False):
            for expanded in (False, True):
                q, k, v = inputs(b, s, n, g, d, permuted, expanded)

                def step():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expanded)
                    out.backward(grad)
                name = "default" if backend is None else backend.name
                try:
                    if backend is None:
                        ms = timed(step)
                    else:
                        with sdpa_kernel([backend]):
                            ms = timed(step)
                    figure = f"{ms:.3f} | {flops / ms / 1e9:,.0f}"
                except RuntimeError as exc:
                    figure = f"refused: {str(exc).splitlines()[0][:60]} |"
                print(f"| {name} | {'permuted' if permuted else 'contiguous'} | "
                      f"{'expanded' if expanded else 'gqa'} | {figure} |", flush=True)


if __name__ == "__main__":
    main()
