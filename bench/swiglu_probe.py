"""SwiGLU backward at the experts' shape: the compiled chunk backward (Inductor's per-half ``cat``)
against model/swiglu.py's one-pass kernel, forward + backward, CUDA events (issue 31).

Usage (lent H200, repository root): PYTHONPATH=src python bench/swiglu_probe.py [--rows 32768 --f 3584]
Prints ms per call of forward + backward and of the backward alone, and the bytes/s the backward's
ideal traffic (read gate, up, dz; write dy: 10 bytes a pair in bf16) implies.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from meshlm.model.swiglu import swiglu


def plain(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def timed(fn, y, dz, reps: int = 20) -> tuple:
    """(fwd + bwd ms, bwd ms) a call, medians over reps."""
    def once(start, mid, end):
        start.record()
        z = fn(y)
        mid.record()
        z.backward(dz)
        end.record()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(reps + 3)]
    for e in ev:
        once(*e)
        y.grad = None
    torch.cuda.synchronize()
    total = sorted(s.elapsed_time(e) for s, _, e in ev[3:])
    bwd = sorted(m.elapsed_time(e) for _, m, e in ev[3:])
    return total[reps // 2], bwd[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--f", type=int, default=3584)
    args = ap.parse_args()
    y = torch.randn(args.rows, 2 * args.f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dz = torch.randn(args.rows, args.f, device="cuda", dtype=torch.bfloat16)
    ideal = 10 * args.rows * args.f
    for name, fn in (("compiled plain (Inductor cat)", torch.compile(plain)),
                     ("compiled one-pass", torch.compile(swiglu))):
        total, bwd = timed(fn, y, dz)
        print(f"{name}: fwd+bwd {total:.3f} ms, bwd {bwd:.3f} ms ({ideal / bwd / 1e9:.2f} TB/s of the ideal "
              f"{ideal / 1e9:.2f} GB)", flush=True)


if __name__ == "__main__":
    main()
