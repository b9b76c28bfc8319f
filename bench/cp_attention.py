"""Context-parallel attention kernels on one GPU: a CP = 2 partition against one full-sequence call.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/cp_attention.py --out $OUT --date 2026-12-02 [--seqs 16384 32768]

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128), batch 1, bf16, causal.
"full": one piece over the whole sequence, forward + backward, on each fused kernel the pieces can
run (context.KERNELS: "flash", "cudnn"); "SDPA": the public scaled_dot_product_attention with
enable_gqa (its own backend choice), also the reference the errors are taken against.
"cp2 p2p" / "cp2 all_gather": both CP ranks' block computations of a CP = 2 run, in sequence on
the one GPU, through the same functions the ring and all-gather attention call (context._Pieces:
the pieces, their fused kernels, the log-sum-exp merge in fp32, the backward against the merged
output) — no communication, which this measures apart from. Per rank and for both together;
with perfect balance each rank takes half the total. Median of --iters timed runs after
--warmup (CUDA events). The partition's output and grads are checked against SDPA's (bf16:
relative error of order 1e-3 is rounding). One JSON row per sequence length to --results
(default bench/results.jsonl), a markdown table to stdout and <out>/cp_attention.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F

from meshlm.parallel import context as C

HEADS, GROUPS, DIM = 32, 8, 128


def _timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank_pass(q, k, v, dout, cp, r, scheme):
    """Forward + backward of CP rank r's pieces (no communication): (out, dq, dk, dv) of its rows."""
    s = q.shape[2]
    c = s // (2 * cp)
    pos = [C.local_positions(cp, i, s, q.device) for i in range(cp)]
    qr = q[:, :, pos[r]]
    if scheme == "p2p":
        blocks = [((r - i) % cp, C._ring_pieces(r, (r - i) % cp, c)) for i in range(cp)]
        kv_of = {src: (k[:, :, pos[src]], v[:, :, pos[src]]) for src, _ in blocks}
        key_pos = {src: pos[src] for src, _ in blocks}
    else:
        blocks = [(None, C._gather_pieces(cp, r, c))]
        kv_of, key_pos = {None: (k, v)}, {None: torch.arange(s, device=q.device)}
    states = []
    acc_out, acc_lse = C._accumulators(qr)
    for src, pieces in blocks:
        C._Pieces(pieces, pos[r], key_pos[src], None, states).forward(qr, *kv_of[src], acc_out, acc_lse)
    out, lse = acc_out.to(q.dtype), acc_lse.float()
    dq = torch.zeros(qr.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=q.device) for _ in range(2))
    for src, pieces in blocks:
        dkv = torch.zeros((2,) + kv_of[src][0].shape, dtype=torch.float32, device=q.device)
        C._Pieces(pieces, pos[r], key_pos[src], None, states).backward(dout[:, :, pos[r]], qr, *kv_of[src], out,
                                                                      lse, dq, dkv)
        rows = key_pos[src]
        dk[:, :, rows] += dkv[0]
        dv[:, :, rows] += dkv[1]
    return out, dq, dk, dv, pos[r]


def _full(q, k, v, dout):
    out, lse, state = C.piece_forward(q, k, v, True)
    out = out.to(q.dtype)
    dq, dk, dv = C.piece_backward(dout, q, k, v, out, lse, True, None, state)
    return out, dq, dk, dv


def _sdpa(q, k, v, dout):
    """Public SDPA forward + backward (its own backend choice): (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _errors(q, k, v, dout, scheme, want) -> list:
    """Relative errors of both CP ranks' out and dQ, and of dK/dV summed over them, against want."""
    errs, dk, dv = [], 0, 0
    for r in range(2):
        out, dq, a, b, rows = _rank_pass(q, k, v, dout, 2, r, scheme)
        errs += [_rel(out, want[0][:, :, rows]), _rel(dq, want[1][:, :, rows])]
        dk, dv = dk + a, dv + b
    return errs + [_rel(dk, want[2]), _rel(dv, want[3])]


def _kernel_row(q, k, v, dout, kernel, want, args) -> dict:
    """Timings and errors of the pieces on one fused kernel (context.KERNELS = [kernel])."""
    C.KERNELS[:] = [kernel]
    row = {"kernel": C._kernel(q, None, True) or "matmul",
           "full_ms": round(_timed(lambda: _full(q, k, v, dout), args.warmup, args.iters), 3)}
    errs = [_rel(a, b) for a, b in zip(_full(q, k, v, dout), want)]
    for scheme in ("p2p", "all_gather"):
        ranks = [_timed(lambda r=r: _rank_pass(q, k, v, dout, 2, r, scheme), args.warmup, args.iters)
                 for r in range(2)]
        row[f"cp2_{scheme}_rank_ms"] = [round(t, 3) for t in ranks]
        row[f"cp2_{scheme}_ms"] = round(sum(ranks), 3)
        errs += _errors(q, k, v, dout, scheme, want)
    row["max_rel_err"] = float(f"{max(errs):.3g}")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev, gpu = torch.device("cuda"), torch.cuda.get_device_name()
    default = list(C.KERNELS)
    lines = ["| seq | SDPA ms | piece kernel | full ms | cp2 p2p ms (rank 0 / rank 1) | cp2 all_gather ms "
             "(rank 0 / rank 1) | p2p rank / SDPA | max rel. err vs SDPA |", "|---|---|---|---|---|---|---|---|"]
    for s in args.seqs:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, HEADS, s, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, GROUPS, s, DIM, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn_like(q)
        sdpa_ms = _timed(lambda: _sdpa(q, k, v, dout), args.warmup, args.iters)
        want = _sdpa(q, k, v, dout)
        for kernel in ("flash", "cudnn"):
            row = {"date": args.date, "gpu": gpu, "gpus": 1, "case": "cp-attention", "seq": s, "batch": 1,
                   "heads": f"{HEADS} q / {GROUPS} kv x {DIM}", "dtype": "bf16", "sdpa_ms": round(sdpa_ms, 3),
                   "torch": torch.__version__, **_kernel_row(q, k, v, dout, kernel, want, args)}
            for path in (args.results, os.path.join(args.out, "results.jsonl")):
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            p, a = row["cp2_p2p_rank_ms"], row["cp2_all_gather_rank_ms"]
            lines.append(f"| {s} | {sdpa_ms:.2f} | {row['kernel']} | {row['full_ms']:.2f} | {row['cp2_p2p_ms']:.2f} "
                         f"({p[0]:.2f} / {p[1]:.2f}) | {row['cp2_all_gather_ms']:.2f} ({a[0]:.2f} / {a[1]:.2f}) | "
                         f"{max(p) / sdpa_ms:.2f} | {row['max_rel_err']:.2g} |")
        C.KERNELS[:] = default
        del q, k, v, dout, want
        torch.cuda.empty_cache()
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "cp_attention.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
