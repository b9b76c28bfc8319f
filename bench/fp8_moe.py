"""FP8 experts on the GPU (issue 27): does a Mixtral-style model train with --fp8-format hybrid (the
routed experts' GEMMs in FP8, parallel/fp8_experts.py) and keep bf16's loss, and how fast is it?

Cases (each a `meshlm pretrain` process on one GPU, --mock-data, same seed; in order):
  tiny-bf16, tiny-fp8: preset mixtral-tiny (2 layers, h 64, 4 experts of 128, top-2) at sequence
      128, micro-batch 4, --iters steps: the per-iteration losses of both, their largest relative
      difference (FP8 rounds, so not 0; a broken GEMM lands far off) and the last losses;
  small-bf16, small-fp8 (unless --no-small): preset mixtral-small (16 layers, h 1024, 8 experts of
      3584, top-2) at sequence 2048, micro-batch 8, --small-iters steps: tokens/s, the median of
      the logged iterations after the first (warm-up), and both cases' losses per step.
--fast-path / --small-fast-path are passed through (default auto: compiled on CUDA; the FP8 experts
run eagerly inside a compiled layer).

Usage: PYTHONPATH=src python bench/fp8_moe.py --out $OUT [--iters 30] [--small-iters 6] [--no-small] [--no-tiny]
Prints one line `FP8_MOE {json}` and appends it to --results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import records  # noqa: E402

TINY = ["--model", "mixtral-tiny", "--vocab-size", "512", "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "4", "--global-batch-size", "4"]
SMALL = ["--model", "mixtral-small", "--vocab-size", "32000", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--micro-batch-size", "8", "--global-batch-size", "8"]
RUN = ["--bf16", "--mock-data", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--log-interval", "1",
       "--eval-interval", "100000", "--seed", "1234", "--nproc-per-node", "1"]


def run(name: str, flags: list, iters: int, out: str, timeout: int) -> list:
    """The training records of one pretrain process, also of one that timed out (on 2026-12-03 the
    tiny cases trained all their steps in 35 s, then ran out of time in the compiled final
    validation); its log says how it ended."""
    d = os.path.join(out, "runs", name)  # its files stay on the machine ($OUT returns two levels)
    cmd = [sys.executable, "-m", "meshlm", "pretrain", *flags, *RUN, "--train-iters", str(iters), "--run-dir", d]
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"{name}: rc {rc}", flush=True)
    return records(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--small-iters", type=int, default=6)
    ap.add_argument("--no-small", action="store_true")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--fast-path", default="auto", help="of the tiny cases")
    ap.add_argument("--small-fast-path", default="auto")
    ap.add_argument("--timeout", type=int, default=90, help="seconds per process")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fast = ["--fast-path", args.fast_path]
    import torch
    row = {"date": args.date, "bench": "fp8_moe", "fp8": "rowwise (experts), tensorwise (dense)",
           "fp8_format": "hybrid",
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "fast_path": args.fast_path}
    loss = {}
    for name, extra in (() if args.no_tiny else (("bf16", []), ("fp8", ["--fp8-format", "hybrid"]))):
        loss[name] = [r["lm_loss"] for r in run(f"tiny-{name}", TINY + fast + extra, args.iters, args.out,
                                                 args.timeout)]
    if loss.get("bf16") and loss.get("fp8"):
        rel = [abs(a - b) / abs(b) for a, b in zip(loss["fp8"], loss["bf16"])]
        row["tiny"] = {"config": "mixtral-tiny seq 128 mb 4", "iters": len(rel), "max_rel_loss_diff": max(rel),
                       "first": [loss["bf16"][0], loss["fp8"][0]], "last": [loss["bf16"][-1], loss["fp8"][-1]]}
        print("tiny " + json.dumps(row["tiny"]), flush=True)
    if not args.no_small:
        speed, small_loss = {}, {}
        for name, extra in (("bf16", []), ("fp8", ["--fp8-format", "hybrid"])):
            flags = SMALL + ["--fast-path", args.small_fast_path] + extra
            recs = run(f"small-{name}", flags, args.small_iters, args.out, args.timeout)
            tps = [r["tokens_per_sec"] for r in recs[1:] if r.get("tokens_per_sec")]
            speed[name] = statistics.median(tps) if tps else None
            small_loss[name] = [r["lm_loss"] for r in recs]
        row["small"] = {"config": "mixtral-small seq 2048 mb 8 EP 1", "iters": args.small_iters,
                        "fast_path": args.small_fast_path, "losses": small_loss,
                        "tokens_per_s": speed,
                        "vs_bf16": speed["fp8"] / speed["bf16"] if speed["fp8"] and speed["bf16"] else None}
    print("FP8_MOE " + json.dumps(row), flush=True)
    with open(args.results, "a") as fh:
        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
