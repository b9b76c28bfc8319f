"""FP8 against bf16 on real text: two `meshlm pretrain` runs of the same Llama-style model, seed and
data (the embedded corpus: this interpreter's standard-library sources, byte-level BPE of 4096 ids),
one with --fp8-format hybrid (tensorwise), side by side on one GPU, then one `meshlm report` page
of both curves.

The model is llama-1b's block (RMSNorm, SwiGLU with ffn = 4h, GQA 16/8 heads, RoPE, untied, no
biases) shrunk to fit the device budget: h 1024, 8 layers, seq 1024, micro-batch 8 (about 8k tokens
a step). Both runs share the GPU, so their speeds are not figures; bench/bench.py measures speed.

Usage: PYTHONPATH=src python bench/fp8_loss.py --out $OUT [--iters 2000]
Prints one line `FP8_LOSS {json}`: final validation loss of each, their relative difference, the
largest training loss of each after the first 100 steps (divergence check), and appends it to
--results (bench/results.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from meshlm import metrics_json  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
         "--num-query-groups", "8", "--ffn-hidden-size", "4096", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--seq-length", "1024", "--max-position-embeddings", "1024"]
RUN = ["--micro-batch-size", "8", "--global-batch-size", "8", "--bf16", "--lr", "6e-4", "--min-lr", "6e-5",
       "--lr-warmup-iters", "100", "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-interval", "100",
       "--eval-iters", "10", "--seed", "1234"]


def records(run_dir: str) -> list:
    with open(os.path.join(run_dir, "logs", "metrics.jsonl")) as fh:
        return [metrics_json.loads(x) for x in fh if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    procs, dirs = {}, {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8-format", "hybrid"])):
        dirs[name] = os.path.join(args.out, "runs", f"loss-{name}")
        cmd = [sys.executable, "-m", "meshlm", "pretrain", *MODEL, *RUN, *extra, "--train-iters", str(args.iters),
               "--nproc-per-node", "1", "--run-dir", dirs[name]]
        log = open(os.path.join(args.out, f"loss-{name}.log"), "w")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (p, log) in procs.items():
        p.wait()
        log.close()
        if p.returncode:
            print(f"{name} failed ({p.returncode}): see {log.name}", flush=True)
            sys.exit(1)
    out = {"date": args.date, "bench": "fp8_loss", "fp8": "tensorwise", "fp8_format": "hybrid",
           "model": "llama-1b block shrunk: h1024 L8 a16/g8 ffn4096 V4096 (embedded corpus) seq 1024 mb 8",
           "iters": args.iters}
    import torch
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for name, d in dirs.items():
        recs = records(d)
        val = [r for r in recs if r.get("val_loss") is not None]
        train = [r for r in recs if r.get("lm_loss") is not None]
        out[f"{name}_final_val_loss"] = round(val[-1]["val_loss"], 5)
        out[f"{name}_val_iteration"] = val[-1]["iteration"]
        out[f"{name}_max_train_loss_after_100"] = round(max(r["lm_loss"] for r in train if r["iteration"] > 100), 4)
        ms = sorted(r["iter_ms"] for r in train if r.get("iter_ms"))
        out[f"{name}_median_iter_ms"] = ms[len(ms) // 2] if ms else None
    out["val_loss_rel_diff"] = round(out["fp8_final_val_loss"] / out["bf16_final_val_loss"] - 1, 5)
    page = os.path.join(args.out, "fp8_loss_report.html")
    subprocess.run([sys.executable, "-m", "meshlm", "report", dirs["bf16"], dirs["fp8"], "-o", page, "--no-predict"],
                   check=False)
    print("FP8_LOSS " + json.dumps(out), flush=True)
    with open(args.results, "a") as fh:
        fh.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
