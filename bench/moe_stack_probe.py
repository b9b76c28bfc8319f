"""Probe (issue 31): what the per-step ``torch.stack`` of the experts' weights costs in the grouped
GEMM, against weights that already lie stacked in one flat buffer (as the DDP param buffer could
lay them out) and are viewed as [E, out, in] with no copy. One mixtral-small MoE layer's expert
GEMMs: T = 16,384 routed rows (8 × 2048 tokens, top-2 over 8 experts, balanced), h 1024, SwiGLU
width 3584, bf16, forward + backward including the leaves' gradient accumulation (AccumulateGrad);
CUDA events, median of --iters. Also prints the strides of the gradient the grouped GEMM returns
for the stacked weight (a layout the leaves' AccumulateGrad must clone if not contiguous).

Usage (lent H200): PYTHONPATH=src python bench/moe_stack_probe.py [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


class _View(torch.autograd.Function):
    """[E, n, k] view of the flat buffer the E leaves lie in, back to back; backward: its gradient
    split into the E leaves' (views of one tensor: no copy)."""

    @staticmethod
    def forward(ctx, base, *ws):
        return base.view_as(base)

    @staticmethod
    def backward(ctx, g):
        return (None, *g.unbind(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    E, h, f, T = 8, 1024, 3584, 16384
    torch.manual_seed(0)
    flat = (torch.randn(E * (2 * f * h + h * f), device=dev) * 0.02).to(dt)
    b1, b2 = flat[:E * 2 * f * h].view(E, 2 * f, h), flat[E * 2 * f * h:].view(E, h, f)
    w1 = [torch.nn.Parameter(b1[e]) for e in range(E)]  # views of the flat buffer, as DDP's p.data
    w2 = [torch.nn.Parameter(b2[e]) for e in range(E)]
    x = torch.randn(T, h, device=dev, dtype=dt, requires_grad=True)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (T // E)

    def act(y):
        g, u = y.chunk(2, dim=-1)
        return F.silu(g) * u

    def stacked():
        y = torch._grouped_mm(x, torch.stack(w1).transpose(1, 2), offs=offs)
        return torch._grouped_mm(act(y), torch.stack(w2).transpose(1, 2), offs=offs)

    def viewed():
        a, b = _View.apply(b1, *w1), _View.apply(b2, *w2)
        y = torch._grouped_mm(x, a.transpose(1, 2), offs=offs)
        return torch._grouped_mm(act(y), b.transpose(1, 2), offs=offs)

    W = torch.stack(w1).transpose(1, 2)
    W.retain_grad()
    torch._grouped_mm(x, W, offs=offs).float().sum().backward()
    layout = {"grad_shape": list(W.grad.shape), "grad_stride": list(W.grad.stride()),
              "grad_of_out_in_contiguous": W.grad.transpose(1, 2).is_contiguous()}

    def timed(fn):
        dy = torch.randn(T, h, device=dev, dtype=dt)
        out = []
        for i in range(args.iters + 3):
            for p in w1 + w2:
                p.grad = None
            x.grad = None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn().backward(dy)
            e.record()
            torch.cuda.synchronize()
            if i >= 3:
                out.append(s.elapsed_time(e))
        return statistics.median(out)

    ms = {"stack_per_call": timed(stacked), "flat_buffer_view": timed(viewed)}
    ms["stack_per_call_again"] = timed(stacked)
    ref = stacked()
    same = torch.equal(ref, viewed())
    flops = 3 * 2 * T * h * 3 * f
    rec = {"bench": "moe_stack_probe", "gpu": torch.cuda.get_device_name(0), "rows": T, "hidden": h, "ffn": f,
           "experts": E, "ms_fwd_bwd": {k: round(v, 3) for k, v in ms.items()},
           "tflops": {k: round(flops / v / 1e9, 1) for k, v in ms.items()}, "same_output": same, **layout}
    print(json.dumps(rec), flush=True)
    if args.results:
        with open(args.results, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
