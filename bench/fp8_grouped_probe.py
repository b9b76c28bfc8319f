"""What torch._scaled_grouped_mm does on this GPU (issue 27: FP8 experts through one grouped GEMM).

Checks, each printed as one `PROBE {json}` line:
  schema: the op's signature;
  fwd (2d × 3d: A [N, k] row-major, B [E, k, n] column-major, scale_a [N], scale_b [E, n]) and
  wgrad (2d × 2d, the groups along the contraction: A [n, N], B [N, k], scale_a [G·n], scale_b [G·k]):
      the relative error against the same dequantized operands through bf16 torch._grouped_mm (fp32
      accumulation in both: small), offsets that are and are not multiples of 16, an empty group
      (wgrad's groups must be multiples of 16 rows: 40 rows failed a device assertion, which ends the
      process, so only multiples are checked);
  timing at mixtral-small's expert shapes (8 experts, h 1024, ffn 3584 SwiGLU: fc1 1024 → 7168,
      fc2 3584 → 1024; 32768 routed rows, top-2 of mb 8 × seq 2048, even load): forward, dgrad and
      wgrad of both projections, bf16 torch._grouped_mm against FP8 torch._scaled_grouped_mm, the
      median of CUDA-event timings (ms), without the quantization;
  linear: meshlm's fp8_expert_linear (parallel/fp8_experts.py, quantization included), compiled,
      forward + backward of each projection, against bf16 torch._grouped_mm's forward + backward.

Usage (lent H200): PYTHONPATH=src python bench/fp8_grouped_probe.py
"""

from __future__ import annotations

import json
import statistics

import torch

E4M3 = torch.float8_e4m3fn
MAX = torch.finfo(E4M3).max


def report(**row) -> None:
    print("PROBE " + json.dumps(row), flush=True)


def rowwise(t: torch.Tensor, dim: int):
    """(t8, dequantization scale): t scaled so that each slice along dim has its amax at E4M3's max."""
    a = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    return (t.float() * (MAX / a)).to(E4M3), (a / MAX)


def col_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def check_fwd(sizes, k=256, n=512):
    offs = torch.tensor(sizes, device="cuda").cumsum(0).int()
    x = torch.randn(sum(sizes), k, device="cuda").bfloat16()
    w = (torch.randn(len(sizes), n, k, device="cuda") / 10).bfloat16()  # [E, n, k]
    x8, sx = rowwise(x, 1)                      # sx [N, 1]
    w8, sw = rowwise(w, 2)                      # sw [E, n, 1]
    try:
        y = torch._scaled_grouped_mm(x8, w8.transpose(1, 2), sx.squeeze(1).contiguous(),
                                     sw.squeeze(2).contiguous(), offs=offs, out_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - the probe reports what the op refuses
        return report(check="fwd", sizes=sizes, error=str(e).splitlines()[0])
    want = torch._grouped_mm((x8.float() * sx).bfloat16(), (w8.float() * sw).bfloat16().transpose(1, 2), offs=offs)
    report(check="fwd", sizes=sizes, rel=rel(y, want))


def check_wgrad(sizes, n=512, k=256):
    offs = torch.tensor(sizes, device="cuda").cumsum(0).int()
    dy = torch.randn(sum(sizes), n, device="cuda").bfloat16()
    x = torch.randn(sum(sizes), k, device="cuda").bfloat16()
    bounds = [0] + offs.tolist()
    g8, gs, x8, xs = [], [], [], []
    for i in range(len(sizes)):  # per group: dyᵀ scaled per row (an out channel), x per column (an in channel)
        a, sa = rowwise(dy[bounds[i]:bounds[i + 1]].t(), 1) if sizes[i] else (
            torch.zeros(n, 0, device="cuda", dtype=E4M3), torch.ones(n, 1, device="cuda"))
        b, sb = rowwise(x[bounds[i]:bounds[i + 1]], 0) if sizes[i] else (
            torch.zeros(0, k, device="cuda", dtype=E4M3), torch.ones(1, k, device="cuda"))
        g8.append(a), gs.append(sa.flatten()), x8.append(b), xs.append(sb.flatten())
    A, B = torch.cat(g8, 1).contiguous(), col_major(torch.cat(x8, 0))
    try:
        dw = torch._scaled_grouped_mm(A, B, torch.cat(gs), torch.cat(xs), offs=offs, out_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        return report(check="wgrad", sizes=sizes, error=str(e).splitlines()[0])
    want = torch.stack([(g8[i].float() * gs[i][:, None]) @ (x8[i].float() * xs[i][None]) for i in range(len(sizes))])
    report(check="wgrad", sizes=sizes, shape=list(dw.shape), rel=rel(dw, want))


def timed(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timing(E=8, rows=32768):
    offs = torch.full((E,), rows // E, device="cuda").cumsum(0).int()
    for name, k, n in (("fc1", 1024, 7168), ("fc2", 3584, 1024)):
        x = torch.randn(rows, k, device="cuda").bfloat16()
        dy = torch.randn(rows, n, device="cuda").bfloat16()
        w = (torch.randn(E, n, k, device="cuda") / 30).bfloat16()
        x8, dy8, dyT8 = x.to(E4M3), dy.to(E4M3), dy.t().contiguous().to(E4M3)
        w8, wT8 = w.to(E4M3), w.transpose(1, 2).contiguous().to(E4M3)
        xc8 = col_major(x8)
        one = lambda *s: torch.ones(*s, device="cuda")  # noqa: E731
        t = {
            "fwd_bf16": timed(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)),
            "fwd_fp8": timed(lambda: torch._scaled_grouped_mm(x8, w8.transpose(1, 2), one(rows), one(E, n), offs=offs,
                                                              out_dtype=torch.bfloat16)),
            "dgrad_bf16": timed(lambda: torch._grouped_mm(dy, w, offs=offs)),
            "dgrad_fp8": timed(lambda: torch._scaled_grouped_mm(dy8, wT8.transpose(1, 2), one(rows), one(E, k),
                                                                offs=offs, out_dtype=torch.bfloat16)),
            "wgrad_bf16": timed(lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
            "wgrad_fp8": timed(lambda: torch._scaled_grouped_mm(dyT8, xc8, one(E * n), one(E * k), offs=offs,
                                                                out_dtype=torch.bfloat16)),
        }
        flops = 2 * rows * k * n
        report(check="timing", gemm=name, rows=rows, k=k, n=n, experts=E, ms=t,
               tflops={key: flops / v / 1e9 for key, v in t.items()})


def linear_timing(E=8, rows=32768):
    from meshlm.parallel.fp8 import Fp8Recipe
    from meshlm.parallel.fp8_experts import fp8_expert_linear

    counts = torch.full((E,), rows // E, device="cuda")
    offs = counts.cumsum(0).int()
    fp8 = torch.compile(lambda x, w: fp8_expert_linear(x, w, counts, None, Fp8Recipe("hybrid"), None))
    bf16 = torch.compile(lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
    for name, k, n in (("fc1", 1024, 7168), ("fc2", 3584, 1024)):
        x = torch.randn(rows, k, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(E, n, k, device="cuda") / 30).bfloat16().requires_grad_()
        dy = torch.randn(rows, n, device="cuda").bfloat16()
        t = {key: timed(lambda: fn(x, w).backward(dy), reps=10) for key, fn in (("bf16", bf16), ("fp8", fp8))}
        report(check="linear", gemm=name, ms=t, fp8_vs_bf16=t["bf16"] / t["fp8"])


def main() -> None:
    report(check="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
           schema=str(torch.ops.aten._scaled_grouped_mm.default._schema))
    for sizes in ([64, 64], [40, 88], [40, 0, 88], [0, 128]):
        check_fwd(sizes)
    for sizes in ([64, 64], [48, 80], [0, 128]):  # 40 | 88 failed the op's device assertion (2026-12-03)
        check_wgrad(sizes)
    timing()
    linear_timing()


if __name__ == "__main__":
    main()
