"""The experts' grouped GEMMs (torch._grouped_mm) against one dense GEMM of the same FLOPs, at
mixtral-small's shapes on one GPU, balanced and with one expert taking more rows (issue 31).

Usage (lent H200, repository root):
    python bench/grouped_gemm_probe.py
Rows T = 32,768 routed (8 × 2,048 tokens, top-2), h 1,024, expert ffn 3,584 (fc1 [2 × 3,584, h],
SwiGLU), E = 8. "imb x": expert 0 gets x times the others' rows (max/mean = 8x / (x + 7)). Each GEMM
of a layer's forward and backward: fc1/fc2 forward, the input gradients (dgrad) and the weight
gradients (wgrad, the K dimension grouped), median of 30 CUDA-event timings after 5 warm-ups;
TFLOP/s from 2·M·N·K. The dense row runs the same products as one [T, ·] GEMM each.
"""

import statistics

import torch

T, H, F, E = 32768, 1024, 3584, 8


def timed(fn, n: int = 30) -> float:
    """Median ms of fn over n CUDA-event timings after 5 warm-ups."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def offsets(imb: float, dev) -> torch.Tensor:
    """Cumulative int32 row offsets of E groups, expert 0 with ``imb`` times the others' rows."""
    share = torch.ones(E)
    share[0] = imb
    counts = (share / share.sum() * T).round().long()
    counts[-1] += T - counts.sum()
    return counts.cumsum(0).to(torch.int32).to(dev)


def main() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x, a = torch.randn(T, H, device=dev, dtype=bf), torch.randn(T, F, device=dev, dtype=bf)
    w1, w2 = torch.randn(E, 2 * F, H, device=dev, dtype=bf), torch.randn(E, H, F, device=dev, dtype=bf)
    dy1, dy2 = torch.randn(T, 2 * F, device=dev, dtype=bf), torch.randn(T, H, device=dev, dtype=bf)
    d1, d2 = torch.randn(H, 2 * F, device=dev, dtype=bf), torch.randn(F, H, device=dev, dtype=bf)
    flops = {"fc1": 2 * T * H * 2 * F, "fc2": 2 * T * F * H}
    rows = []
    for imb in (1.0, 2.0, 3.0):
        offs = offsets(imb, dev)
        gm = torch._grouped_mm
        rows.append((f"grouped, imb {imb:g}", {
            "fc1 fwd": timed(lambda: gm(x, w1.transpose(1, 2), offs=offs)),
            "fc2 fwd": timed(lambda: gm(a, w2.transpose(1, 2), offs=offs)),
            "fc1 dgrad": timed(lambda: gm(dy1, w1, offs=offs)), "fc2 dgrad": timed(lambda: gm(dy2, w2, offs=offs)),
            "fc1 wgrad": timed(lambda: gm(dy1.t(), x, offs=offs)),
            "fc2 wgrad": timed(lambda: gm(dy2.t(), a, offs=offs))}))
    rows.append(("dense mm", {"fc1 fwd": timed(lambda: x @ d1), "fc2 fwd": timed(lambda: a @ d2),
                              "fc1 dgrad": timed(lambda: dy1 @ d1.t()), "fc2 dgrad": timed(lambda: dy2 @ d2.t()),
                              "fc1 wgrad": timed(lambda: dy1.t() @ x), "fc2 wgrad": timed(lambda: dy2.t() @ a)}))
    for name, t in rows:
        cells = "  ".join(f"{k} {v * 1e3:4.0f} µs {flops[k[:3]] / v / 1e9:4.0f} TF/s" for k, v in t.items())
        print(f"{name:16s} {cells} | a layer {sum(t.values()):.3f} ms, ×16 {16 * sum(t.values()):.1f} ms")


if __name__ == "__main__":
    main()
