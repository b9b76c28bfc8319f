"""The largest model on one GPU (issue 26): the llama2-7b preset with --optimizer-cpu-offload on one H200.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/offload_7b.py --out $OUT [--iters 3] [--fraction F] [--timeout-s 160]

One `meshlm pretrain` process (bench/runs.py's command) on --mock-data: llama2-7b (h4096, 32 layers,
ffn 11008, seq 4096, V32000), bf16, micro-batch 1, global batch --global-batch (gradient accumulation,
so that the host AdamW's seconds are shared by that many sequences). Eager (--fast-path off): a fresh
machine would spend the short device budget compiling.

The offloaded fraction: --fraction, else the largest the planner says fits in SHARE (85%) of the
host memory available now (planner/memory.py ``largest_offload_fraction``: 12 bytes an element of the
fraction + staging; the 15% left is for the process itself: torch, the CUDA context, Python). The
whole optimizer would need 12 × 6.74e9 = 81 GB, all of a 125 GiB host's 82 GiB available.

A thread samples the run's host memory every second (meshlm/host_memory.py: the resident bytes of the
process and its descendants, and the host's available bytes) into the log beside the run's own
output, so a kill shows where it came. Printed and written to <out>/results.jsonl (copied into
bench/results.jsonl): fraction, host peak (sampled, and the largest child's ru_maxrss), the largest
torch max-allocated of the logged steps after the first, tokens/s and MFU, beside the planner's
device peak and host bytes for that fraction (and its device peak without offload, which does not fit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import COMMON, command, config_of, predict, records  # noqa: E402

from meshlm.config import global_batch  # noqa: E402
from meshlm.host_memory import available_bytes, tree_rss_bytes  # noqa: E402
from meshlm.planner.layout import Layout  # noqa: E402
from meshlm.planner.memory import GiB, estimate, largest_offload_fraction  # noqa: E402

FLAGS = ["--model", "llama2-7b", "--vocab-size", "32000", "--micro-batch-size", "1", "--fast-path", "off"]
SHARE = 0.85  # of the available host memory the offloaded state and its staging may take


def largest_fraction(flags: list, budget: float) -> float:
    """The largest --optimizer-offload-fraction (0.01 steps) whose planned host bytes fit in budget bytes."""
    cfg = config_of(flags)
    cfg.training.global_batch_size = global_batch(cfg, 1)
    return largest_offload_fraction(estimate(cfg, Layout.of(cfg, 1), cfg.model.vocab_size), budget)


def run(flags: list, run_dir: str, log_path: str, timeout: float) -> dict:
    """``meshlm pretrain FLAGS`` on one GPU, its output streamed to log_path with a host-memory line
    every second. {"rc", "host_peak_gib" (sampled tree), "child_maxrss_gib", "min_available_gib",
    "wall_s", "last_line"}."""
    cmd, env = command(flags, 1, run_dir)
    with open(log_path, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
    log = open(log_path, "a", buffering=1)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen = {"peak": 0, "available": None}
    done = threading.Event()

    def watch():
        while not done.wait(1.0):
            rss, avail = tree_rss_bytes(proc.pid), available_bytes()
            seen["peak"] = max(seen["peak"], rss)
            if avail is not None:
                seen["available"] = avail if seen["available"] is None else min(seen["available"], avail)
            log.write(f"host t={time.time() - t0:6.1f}s rss={rss / GiB:6.2f} GiB (peak {seen['peak'] / GiB:6.2f}) "
                      f"available={avail / GiB if avail is not None else float('nan'):6.2f} GiB\n")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = proc.wait()
        log.write(f"timed out after {timeout:.0f} s\n")
    done.set()
    thread.join()
    log.close()
    with open(log_path) as fh:
        lines = [x for x in fh.read().splitlines() if x.strip() and not x.startswith("host t=")]
    return {"rc": rc, "host_peak_gib": round(seen["peak"] / GiB, 2), "wall_s": round(time.time() - t0, 1),
            "child_maxrss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GiB, 2),
            "min_available_gib": seen["available"] and round(seen["available"] / GiB, 2),
            "last_line": lines[-1] if lines else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out/offload_7b"))
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=None, help="default: the largest that fits SHARE of the host")
    ap.add_argument("--timeout-s", type=float, default=160.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flags = FLAGS + ["--global-batch-size", str(args.global_batch)] + COMMON
    available = available_bytes()
    if available is None and args.fraction is None:
        raise SystemExit("offload_7b: the host's available memory cannot be read here: give --fraction")
    fraction = args.fraction if args.fraction is not None else largest_fraction(
        flags + ["--optimizer-cpu-offload"], SHARE * available)
    offload = flags + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{fraction:g}"]
    pred, pred_gpu = predict(offload, 1), predict(flags, 1)
    print(f"offload_7b: {(available or 0) / GiB:.1f} GiB available on the host; fraction {fraction:g}: planned host "
          f"{pred['host_gib']:.2f} GiB, device peak {pred['peak_gib']:.2f} GiB", flush=True)
    r = run(offload + ["--train-iters", str(args.iters)], os.path.join(args.out, "run"),
            os.path.join(args.out, "offload_7b.log"), args.timeout_s)
    rows = records(os.path.join(args.out, "run"))[1:]  # the first step allocates the buffers, warms the kernels
    rec = {"date": args.date, "bench": "offload_7b", "gpu": "1x H200", "case": "llama2-7b-cpu-offload",
           "flags": " ".join(offload), "fraction": fraction, "host_available_gib": available and round(available / GiB, 2),
           "predicted_host_gib": round(pred["host_gib"], 2), "measured_host_peak_gib": r["host_peak_gib"],
           "child_maxrss_gib": r["child_maxrss_gib"], "min_available_gib": r["min_available_gib"],
           "predicted_peak_gib": round(pred["peak_gib"], 2),
           "predicted_peak_gib_without_offload": round(pred_gpu["peak_gib"], 2),
           "predicted_device_gib_without_offload": round(pred_gpu["device_bytes"] / GiB, 2),
           "wall_s": r["wall_s"], "rc": r["rc"], "error": None if r["rc"] == 0 else r["last_line"]}
    if rows:
        peak = max((x["mem_max_allocated_gb"] for x in rows if x.get("mem_max_allocated_gb") is not None),
                   default=None)  # None on CPU
        rec.update(steps=len(rows), step_ms=round(statistics.median(x["iter_ms"] for x in rows), 1),
                   tokens_per_s=round(statistics.median(x["tokens_per_sec"] for x in rows), 1),
                   mfu=rows[-1].get("mfu"), measured_peak_gib=peak and round(peak, 2),
                   peak_error=peak and round(pred["peak_gib"] / peak - 1, 4),
                   host_error=round(pred["host_gib"] / r["host_peak_gib"] - 1, 4) if r["host_peak_gib"] else None,
                   loss=rows[-1].get("lm_loss"))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
