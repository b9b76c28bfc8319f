"""Planner against measurement: predicted vs measured peak memory and step time on this machine.

Usage (the lent H200, one GPU, from the repository root):
    PYTHONPATH=src python bench/plan_check.py --out $OUT [--date D] [case ...]
    PYTHONPATH=src python bench/plan_check.py --tiny          # CPU smoke run: tiny shapes, no results rows

Each case is a `meshlm pretrain` command line on --mock-data (as bench/bench.py launches them: llama-1b
and llama-3b shapes at sequence 2048, bf16, the default fast path), run as its own process for
--iters iterations. Measured: the peak of ``mem_max_allocated_gb`` (torch.cuda.max_memory_allocated)
and the median ``iter_ms`` after --warmup iterations, from the run's metrics.jsonl. Predicted: the
planner's ``memory.estimate(...).peak_bytes`` (what max_memory_allocated counts: no CUDA context) and
``cost.step_time(...).total`` with the H200-141GB preset — the same constants for every case (bench/runs.py). Prints
the table (markdown) with % errors and writes it, with each run's log, under --out (default $OUT, else
bench/out/plan_check, which git ignores); appends one JSON row per case to --results and, with --record, the
table as a section of bench/RESULTS.md. Targets: memory within 10%, step time within 15%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import COMMON, L1B, TINY, predict as planned, pretrain  # noqa: E402

L3B = ["--model", "llama-3b", "--vocab-size", "128256", "--seq-length", "2048", "--max-position-embeddings", "2048"]
SEL = ["--recompute-activations"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
CASES = {  # name: flags
    "llama1b-m1": L1B + ["--micro-batch-size", "1", "--global-batch-size", "1"],
    "llama1b-m4-selective-acc2": L1B + ["--micro-batch-size", "4", "--global-batch-size", "8"] + SEL,
    "llama1b-m8": L1B + ["--micro-batch-size", "8", "--global-batch-size", "8"],
    "llama1b-m16-full": L1B + ["--micro-batch-size", "16", "--global-batch-size", "16"] + FULL,
    "llama3b-m2-selective-acc2": L3B + ["--micro-batch-size", "2", "--global-batch-size", "4"] + SEL,
    "llama3b-m4": L3B + ["--micro-batch-size", "4", "--global-batch-size", "4"],
    "llama3b-m8-full": L3B + ["--micro-batch-size", "8", "--global-batch-size", "8"] + FULL,
    # second set, run after the model was revised on the first (an independent check)
    "llama1b-m2-acc4": L1B + ["--micro-batch-size", "2", "--global-batch-size", "8"],
    "llama1b-m12-selective": L1B + ["--micro-batch-size", "12", "--global-batch-size", "12"] + SEL,
    "llama3b-m1": L3B + ["--micro-batch-size", "1", "--global-batch-size", "1"],
    "llama3b-m6-selective": L3B + ["--micro-batch-size", "6", "--global-batch-size", "6"] + SEL,
}
TINY_CASES = {"tiny-m2": TINY + ["--micro-batch-size", "2", "--global-batch-size", "4"],
              "tiny-m4-full": TINY + ["--micro-batch-size", "4", "--global-batch-size", "4"] + FULL}


def measure(name: str, flags: list, out: str, iters: int, warmup: int) -> dict:
    run = pretrain([*flags, *COMMON, "--train-iters", str(iters)], 1, os.path.join(out, "runs", name),
                   os.path.join(out, f"{name}.log"))
    if "error" in run:
        return run
    rows = run["records"][warmup:]
    peaks = [r["mem_max_allocated_gb"] for r in rows if r.get("mem_max_allocated_gb") is not None]
    return {"step_ms": statistics.median(r["iter_ms"] for r in rows), "peak_gib": max(peaks) if peaks else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*")
    default_out = os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out", "plan_check"))
    ap.add_argument("--out", default=default_out,
                    help="the runs' logs and plan_check.md (default $OUT, else bench/out/plan_check, git-ignored)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shapes); writes no results")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    cases = TINY_CASES if args.tiny else CASES
    names = args.cases or list(cases)
    os.makedirs(args.out, exist_ok=True)
    lines = ["| case | flags | predicted peak GiB | measured peak GiB | error | predicted ms/step | measured ms/step "
             "| error |", "|---|---|---|---|---|---|---|---|"]
    records = []
    for name in names:
        flags = cases[name]
        pred = planned(flags + COMMON, 1)
        meas = measure(name, flags, args.out, args.iters, args.warmup)
        if "error" in meas:
            print(f"{name}: error {meas['error']}", flush=True)
            continue
        mem_err = None if meas["peak_gib"] is None else pred["peak_gib"] / meas["peak_gib"] - 1
        t_err = pred["step_ms"] / meas["step_ms"] - 1
        rec = {"date": args.date, "bench": "plan_check", "case": name, "flags": " ".join(flags),
               "predicted_peak_gib": round(pred["peak_gib"], 2), "measured_peak_gib": meas["peak_gib"],
               "peak_error": None if mem_err is None else round(mem_err, 4),
               "predicted_step_ms": round(pred["step_ms"], 1), "measured_step_ms": round(meas["step_ms"], 1),
               "step_error": round(t_err, 4)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        peak = "n/a" if meas["peak_gib"] is None else f"{meas['peak_gib']:.2f}"
        err = "n/a" if mem_err is None else f"{100 * mem_err:+.1f}%"
        lines.append(f"| {name} | `{' '.join(f for f in flags if f not in L1B + L3B + TINY)}` | {pred['peak_gib']:.2f} "
                     f"| {peak} | {err} | {pred['step_ms']:.1f} | {meas['step_ms']:.1f} | {100 * t_err:+.1f}% |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "plan_check.md"), "w") as fh:
        fh.write(table + "\n")
    if not args.tiny:
        with open(args.results, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    if args.record:
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as fh:
            fh.write(f"\n## {args.date} — planner vs measurement (bench/plan_check.py)\n\n{table}\n")


if __name__ == "__main__":
    main()
