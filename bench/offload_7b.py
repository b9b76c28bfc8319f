"""The largest model on one GPU (issue 26): the llama2-7b preset with --optimizer-cpu-offload on one H200.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/offload_7b.py --out $OUT [--iters 3] [--timeout-s 170]

One `meshlm pretrain` process (bench/runs.py) on --mock-data: llama2-7b (h4096, 32 layers, ffn 11008,
seq 4096, V32000), bf16, micro-batch 1, global batch --global-batch (gradient accumulation over the
micro-batches, so that the host-side AdamW's seconds are shared by that many sequences), the whole
optimizer state (fp32 masters and both moments: 12 bytes a parameter, ~81 GB) on the host. Eager
(--fast-path off): a fresh machine would spend the short device budget compiling. Printed and
written to <out>/results.jsonl (copied into bench/results.jsonl): tokens/s, MFU and the largest torch max-allocated of the logged steps after
the first, beside the planner's predicted peak (runs.predict: memory.estimate, which keeps
1 − --optimizer-offload-fraction of the optimizer on the device) and the same prediction without
offload (which does not fit in 141 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import COMMON, predict, pretrain, records  # noqa: E402

FLAGS = ["--model", "llama2-7b", "--vocab-size", "32000", "--micro-batch-size", "1", "--fast-path", "off"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out/offload_7b"))
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=170.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flags = FLAGS + ["--global-batch-size", str(args.global_batch)] + COMMON
    offload = flags + ["--optimizer-cpu-offload"]
    pred, pred_gpu = predict(offload, 1), predict(flags, 1)
    t0 = time.time()
    r = pretrain(offload + ["--train-iters", str(args.iters)], 1, os.path.join(args.out, "run"),
                 os.path.join(args.out, "offload_7b.log"), timeout=args.timeout_s)
    rows = r.get("records") or records(os.path.join(args.out, "run"))  # the steps logged before a timeout
    rows = rows[1:]  # the first step allocates the buffers and warms the kernels
    rec = {"date": args.date, "bench": "offload_7b", "gpu": "1x H200", "case": "llama2-7b-cpu-offload",
           "flags": " ".join(offload), "predicted_peak_gib": round(pred["peak_gib"], 2),
           "predicted_peak_gib_without_offload": round(pred_gpu["peak_gib"], 2),
           "predicted_device_gib_without_offload": round(pred_gpu["device_bytes"] / 2 ** 30, 2),
           "wall_s": round(time.time() - t0, 1), "error": r.get("error")}
    if rows:
        peak = max((x["mem_max_allocated_gb"] for x in rows if x.get("mem_max_allocated_gb") is not None),
                   default=None)  # None on CPU
        rec.update(steps=len(rows), step_ms=round(statistics.median(x["iter_ms"] for x in rows), 1),
                   tokens_per_s=round(statistics.median(x["tokens_per_sec"] for x in rows), 1),
                   mfu=rows[-1].get("mfu"), measured_peak_gib=peak and round(peak, 2),
                   peak_error=peak and round(pred["peak_gib"] / peak - 1, 4), loss=rows[-1].get("lm_loss"))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
