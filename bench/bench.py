"""GPU benchmark: run `meshlm pretrain` for named layouts and print one markdown table.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/bench.py --out $OUT  [case ...]

Each case is a pretrain command line on --mock-data (so data loading is not measured); the table
gives, per case, the median of the logged iterations after the first two (warm-up):
elapsed ms per iteration, tokens/s (whole job), TFLOP/s per GPU, MFU, peak memory per GPU, the
memory in use between steps (weights, grads, optimizer state) next to the start-up
bytes-per-parameter estimate, and — since every layout sees the same global batches from the
same weights — the largest relative difference of its loss curve from the first case's (parity).
Results go to <out>/bench.json and <out>/bench.md; copy the table into bench/RESULTS.md with the
date and the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

MODEL = ["--model", "gpt2-125m", "--seq-length", "1024", "--max-position-embeddings", "1024",
         "--mock-data", "--vocab-size", "50257", "--bf16", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0"]

CASES = {
    # name: (number of GPUs, extra flags)
    "1gpu":          (1, ["--micro-batch-size", "8", "--global-batch-size", "32"]),
    "1gpu-mb16":     (1, ["--micro-batch-size", "16", "--global-batch-size", "32"]),
    "dp2":           (2, ["--micro-batch-size", "8", "--global-batch-size", "32"]),
    "dp2-overlap":   (2, ["--micro-batch-size", "8", "--global-batch-size", "32", "--overlap-grad-reduce"]),
    "dp2-zero1":     (2, ["--micro-batch-size", "8", "--global-batch-size", "32",
                          "--use-distributed-optimizer"]),
    "tp2":           (2, ["--micro-batch-size", "8", "--global-batch-size", "32",
                          "--tensor-model-parallel-size", "2"]),
    "tp2-sp":        (2, ["--micro-batch-size", "8", "--global-batch-size", "32",
                          "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2":           (2, ["--micro-batch-size", "8", "--global-batch-size", "32",
                          "--pipeline-model-parallel-size", "2"]),
}


def run_case(name: str, out: str, iters: int) -> dict:
    ngpu, extra = CASES[name]
    run_dir = os.path.join(out, "runs", name)
    cmd = [sys.executable, "-m", "meshlm", "pretrain", *MODEL, *extra, "--train-iters", str(iters),
           "--nproc-per-node", str(ngpu), "--run-dir", run_dir]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(ngpu)))
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    log_path = os.path.join(out, f"{name}.log")
    with open(log_path, "w") as fh:
        fh.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"case": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"))
            if line.strip()]
    rows = [r for r in rows if r.get("iter_ms") is not None]
    losses = [r["lm_loss"] for r in rows]
    rows = rows[2:]

    def med(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    estimate = None  # weights + grads + optimizer bytes of rank 0, from the start-up memory report
    for line in proc.stdout.splitlines():
        m = re.search(r"memory rank 0: .*= ([0-9.]+) (GiB|MiB)", line)
        if m:
            estimate = float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)
    return {"case": name, "gpus": ngpu, "iter_ms": med("iter_ms"), "state_estimate_gb": estimate,
            "state_measured_gb": med("mem_allocated_gb"), "tokens_per_sec": med("tokens_per_sec"),
            "tflops_per_gpu": med("tflops_per_gpu"), "mfu": med("mfu"),
            "mem_gb": max((r.get("mem_max_allocated_gb") or 0) for r in rows) if rows else None, "exposed_comm_share": med("exposed_comm_share"),
            "bubble_fraction": med("bubble_fraction"), "last_loss": rows[-1]["lm_loss"] if rows else None, "losses": losses,
            "wall_s": round(wall, 1)}


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"cases: {', '.join(CASES)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = [run_case(c, args.out, args.iters) for c in args.cases]
    # parity: every layout trains the same function on the same global batches (bf16 tolerance 1e-2)
    ref = next((r["losses"] for r in results if "losses" in r), None)
    for r in results:
        if "losses" in r and ref:
            r["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    lines = ["| case | GPUs | ms/iter | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB | state GiB measured / estimated "
             "| exposed comm | bubble | loss | max rel. loss diff vs first case |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |")
            continue
        lines.append(f"| {r['case']} | {r['gpus']} | {fmt(r['iter_ms'], '.1f')} | {fmt(r['tokens_per_sec'], ',.0f')} "
                     f"| {fmt(r['tflops_per_gpu'], '.1f')} | {fmt(r['mfu'], '.1%')} | {fmt(r['mem_gb'], '.2f')} "
                     f"| {fmt(r['state_measured_gb'], '.2f')} / {fmt(r['state_estimate_gb'], '.2f')} "
                     f"| {fmt(r['exposed_comm_share'], '.1%')} | {fmt(r['bubble_fraction'], '.1%')} "
                     f"| {fmt(r['last_loss'], '.3f')} | {fmt(r.get('max_rel_loss_diff'), '.1e')} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
