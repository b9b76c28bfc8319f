"""GPU benchmark: meshlm against a plain-PyTorch loop of the same model, one table, one invocation.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/bench.py --out $OUT --date 2026-12-01 [case ...]

Each case is a `meshlm pretrain` command line on --mock-data (data loading not measured), run as
its own process; cases with a Llama shape also run bench/baseline.py (no meshlm: bf16 autocast,
SDPA, nn.RMSNorm, per-block torch.compile, fused AdamW) once per shape in the same invocation.
Per case: the median of the logged iterations after --warmup (compilation happens there) of the
iteration time (wall clock of the whole step), tokens/s, and the peak memory (max allocated).
With --repeat N the baseline and meshlm run N times each, alternately (baseline first), and the
row holds the median over the N processes of each one's median (and every process's figure in
"runs"): on these machines one process's steps can run ~10% slower than the next one's on the
same machine, both ways, so a single pair can mislead.

FLOPs per token (issue 9): 6N + 12·L·h·s, N all parameters (from meshlm's start-up line: exact on
one GPU and under pure DP), L layers, h hidden, s sequence; TFLOP/s/GPU = that × tokens/s ÷ GPUs;
MFU = TFLOP/s/GPU ÷ 989.4 (H200 SXM dense bf16). Every case appends one JSON row to --results
(default bench/results.jsonl); the markdown table goes to stdout and <out>/bench.md.

FP8 cases (``-fp8``: --fp8-format hybrid, the tensorwise recipe) run beside the plain loop's FP8 mode
(baseline.py --fp8 tensorwise: torchao 0.18, which must be installed); their rows carry ``fp8``,
``vs_bf16`` (against the bf16 case of the same model in the same invocation) and ``vs_baseline``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import COMMON, L1B, pretrain  # noqa: E402

PEAK_TFLOPS = 989.4
LLAMA_1B = dict(name="llama-1b h2048 L16 a16/g8 ffn8192 V32000 untied", flags=L1B,
                dims=dict(layers=16, hidden=2048, seq=2048),
                baseline=dict(layers=16, hidden=2048, heads=16, groups=8, ffn=8192, vocab=32000, seq=2048))
LLAMA_3B = dict(name="llama-3b h3072 L28 a24/g8 ffn8192 V128256 tied",
                flags=["--model", "llama-3b", "--vocab-size", "128256", "--seq-length", "4096",
                       "--max-position-embeddings", "4096"],
                dims=dict(layers=28, hidden=3072, seq=4096), baseline=None)
GPT2_350M = dict(name="gpt2-350m h1024 L24 a16 V50257 dropout 0.1",
                 flags=["--model", "gpt2-350m", "--seq-length", "1024", "--max-position-embeddings", "1024",
                        "--vocab-size", "50257"],
                 dims=dict(layers=24, hidden=1024, seq=1024),
                 # nanoGPT's padded vocabulary (meshlm pads 50257 to 50304 itself)
                 baseline=dict(arch="gpt", dropout=0.1, layers=24, hidden=1024, heads=16, ffn=4096, vocab=50304,
                               seq=1024))
GPT2_125M = dict(name="gpt2-125m V50257 dropout 0",
                 flags=["--model", "gpt2-125m", "--seq-length", "1024", "--max-position-embeddings", "1024",
                        "--vocab-size", "50257", "--hidden-dropout", "0", "--attention-dropout", "0"],
                 dims=dict(layers=12, hidden=768, seq=1024), baseline=None)

LLAMA3_8B_W8 = dict(name="llama3-8b widths L8 h4096 a32/g8 ffn14336 V32000 untied",
                   flags=["--model", "llama3-8b", "--num-layers", "8", "--vocab-size", "32000", "--seq-length", "2048",
                          "--max-position-embeddings", "2048"],
                   dims=dict(layers=8, hidden=4096, seq=2048),
                   baseline=dict(layers=8, hidden=4096, heads=32, groups=8, ffn=14336, vocab=32000, seq=2048))
FP8 = ["--fp8-format", "hybrid"]  # the tensorwise recipe (meshlm's default --fp8-recipe)
BASELINE_FP8 = "tensorwise"  # torchao 0.18's recipe in bench/baseline.py --fp8

CASES = {
    # name: (model, GPUs, micro-batch, layout flags)
    "llama1b": (LLAMA_1B, 1, 8, []),
    "llama1b-fp8": (LLAMA_1B, 1, 8, FP8),
    "llama8b-w8": (LLAMA3_8B_W8, 1, 4, []),
    "llama8b-w8-fp8": (LLAMA3_8B_W8, 1, 4, FP8),
    "llama1b-eager": (LLAMA_1B, 1, 8, ["--fast-path", "off"]),
    # issue 26: ZeRO-3's own machinery at DP=1 (gradient shards folded every micro-batch, block hooks;
    # nothing to gather) against stage 0, alternated in one invocation: `bench.py llama1b-zero0
    # llama1b-zero3 llama1b-zero0 llama1b-zero3` (no plain-PyTorch baseline: the baseline is stage 0)
    # (4 micro-batches a step, so the per-micro-batch folds are counted)
    "llama1b-zero0": (dict(LLAMA_1B, baseline=None), 1, 8, ["--global-batch-size", "32"]),
    "llama1b-zero3": (dict(LLAMA_1B, baseline=None), 1, 8, ["--global-batch-size", "32",
                                                            "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "llama1b-selective": (LLAMA_1B, 1, 8, ["--recompute-activations"]),
    "llama3b-selective": (LLAMA_3B, 1, 2, ["--recompute-activations", "--global-batch-size", "8"]),
    "gpt2-350m": (GPT2_350M, 1, 8, []),
    "gpt2-1gpu": (GPT2_125M, 1, 8, []),
    "gpt2-dp2": (GPT2_125M, 2, 8, []),
    "gpt2-tp2": (GPT2_125M, 2, 8, ["--tensor-model-parallel-size", "2"]),
    "gpt2-pp2": (GPT2_125M, 2, 8, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "32"]),
}


def run_meshlm(name: str, out: str, iters: int, warmup: int) -> dict:
    model, gpus, micro, layout = CASES[name]
    t0 = time.time()
    run = pretrain([*model["flags"], *COMMON, "--micro-batch-size", str(micro), *layout, "--train-iters", str(iters)],
                   gpus, os.path.join(out, "runs", name), os.path.join(out, f"{name}.log"))
    if "error" in run:
        return run
    rows = run["records"]
    losses = [r["lm_loss"] for r in rows]
    rows = rows[warmup:]
    params = int(re.search(r"([\d,]+) parameters on rank 0", run["stdout"]).group(1).replace(",", ""))

    def med(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"params": params, "iter_ms": med("iter_ms"), "tokens_per_sec": med("tokens_per_sec"),
            "peak_mem_gb": max((r.get("mem_max_allocated_gb") or 0) for r in rows),
            "exposed_comm_share": med("exposed_comm_share"), "losses": losses, "wall_s": round(time.time() - t0, 1)}


def is_fp8(name: str) -> bool:
    return "--fp8-format" in CASES[name][3]


def run_baseline(shape: dict, micro: int, out: str, iters: int, warmup: int, fp8: str | None = None) -> dict:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()] + ([f"--fp8={fp8}"] if fp8 else [])
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "baseline.py"), *args,
           f"--micro-batch={micro}", f"--iters={iters}", f"--warmup={warmup}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tag = f"-fp8{fp8}" if fp8 else ""
    with open(os.path.join(out, f"baseline-{shape.get('arch', 'llama')}-{shape['hidden']}-{micro}{tag}.log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BASELINE ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(line[len("BASELINE "):])


def row(name: str, r: dict, base: dict | None, date: str, gpu: str) -> dict:
    """One results.jsonl record (see the module docstring for the formulas)."""
    model, gpus, micro, layout = CASES[name]
    d = model["dims"]
    flops_per_token = 6 * r["params"] + 12 * d["layers"] * d["hidden"] * d["seq"]
    tflops = flops_per_token * r["tokens_per_sec"] / gpus / 1e12
    base_tps = base.get("tokens_per_sec") if base else None
    return {"date": date, "gpu": gpu, "gpus": gpus, "model": model["name"], "seq": d["seq"],
            "layout": " ".join(layout) or "default", "case": name, "micro_batch": micro,
            "tokens_per_sec": round(r["tokens_per_sec"], 1),
            "tokens_per_sec_per_gpu": round(r["tokens_per_sec"] / gpus, 1),
            "tflops_per_gpu": round(tflops, 1), "mfu": round(tflops / PEAK_TFLOPS, 4),
            "peak_mem_gb": round(r["peak_mem_gb"], 2), "exposed_comm_share": r["exposed_comm_share"],
            "baseline_tokens_per_sec": None if base_tps is None else round(base_tps, 1),
            "baseline_peak_mem_gb": None if not base else round(base["peak_mem_gb"], 2),
            "vs_baseline": None if base_tps is None else round(r["tokens_per_sec"] / base_tps, 3),
            "iter_ms": round(r["iter_ms"], 1), "params": r["params"],
            "first_losses": [round(x, 4) for x in r["losses"][:5]]}


def add_fp8_fields(records: list) -> None:
    """Each FP8 row gets ``fp8`` (the recipe), ``fp8_format``, ``baseline_fp8`` (the plain loop's
    torchao recipe: its baseline figures are that loop's), ``vs_bf16`` (tokens/s against meshlm's bf16
    row of the same model, micro-batch and other flags in this run) and ``peak_vs_bf16``."""
    by_key = {(r["model"], r["micro_batch"], r["layout"]): r for r in records if not is_fp8(r["case"])}
    for r in records:
        if not is_fp8(r["case"]):
            continue
        layout = CASES[r["case"]][3]
        i = layout.index("--fp8-format")
        rest = " ".join(layout[:i] + layout[i + 2:]) or "default"
        peer = by_key.get((r["model"], r["micro_batch"], rest))
        r.update(fp8="tensorwise", fp8_format=layout[i + 1], baseline_fp8=BASELINE_FP8,
                 vs_bf16=None if peer is None else round(r["tokens_per_sec"] / peer["tokens_per_sec"], 3),
                 peak_vs_bf16=None if peer is None else round(r["peak_mem_gb"] / peer["peak_mem_gb"], 3))


def _median_run(runs: list) -> dict | None:
    """The runs' figures combined: median iteration time and tokens/s, max peak memory."""
    if not runs:
        return None
    out = dict(runs[0])
    for key in ("iter_ms", "tokens_per_sec"):
        out[key] = statistics.median(r[key] for r in runs)
    out["peak_mem_gb"] = max(r["peak_mem_gb"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=["llama1b", "llama1b-eager"], help=f"cases: {', '.join(CASES)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="baseline/meshlm pairs per case (medians kept)")
    ap.add_argument("--fp8-baselines-only", action="store_true",
                    help="run the plain loop only beside FP8 cases (its torchao FP8 mode): saves device time")
    args = ap.parse_args()
    import torch
    gpu = torch.cuda.get_device_name(0)
    os.makedirs(args.out, exist_ok=True)
    baselines, records = {}, []
    for name in args.cases:
        model, gpus, micro, _ = CASES[name]
        fp8 = BASELINE_FP8 if is_fp8(name) else None
        key = (model["name"], micro, fp8)
        want_base = model["baseline"] and (fp8 or not args.fp8_baselines_only)
        runs, bases = [], []
        for _ in range(args.repeat):
            if want_base and (key not in baselines or args.repeat > 1):
                bases.append(run_baseline(model["baseline"], micro, args.out, args.iters, args.warmup, fp8))
                print(f"baseline {key}: {bases[-1]}", flush=True)
            runs.append(run_meshlm(name, args.out, args.iters, args.warmup))
        if bases:
            baselines[key] = _median_run([b for b in bases if "error" not in b]) or bases[-1]
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"{name}: error {runs[-1]['error']}", flush=True)
            continue
        base = baselines.get(key)
        records.append(row(name, _median_run(good), None if base is None or "error" in base else base, args.date, gpu))
        if args.repeat > 1:
            records[-1]["runs"] = {"tokens_per_sec": [round(r["tokens_per_sec"], 1) for r in good],
                                   "baseline_tokens_per_sec": [round(b["tokens_per_sec"], 1) for b in bases
                                                               if "error" not in b]}
        print(json.dumps(records[-1]), flush=True)
    add_fp8_fields(records)
    with open(args.results, "a") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    lines = ["| case | GPUs | micro | tokens/s | baseline tokens/s | vs baseline | vs bf16 | TFLOP/s/GPU | MFU "
             "| peak GiB (baseline) | ms/iter |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        base = "n/a" if r["baseline_tokens_per_sec"] is None else f"{r['baseline_tokens_per_sec']:,.0f}"
        vs = "n/a" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}"
        vs16 = f"{r['vs_bf16']:.3f}" if r.get("vs_bf16") else "n/a"
        lines.append(f"| {r['case']} | {r['gpus']} | {r['micro_batch']} | {r['tokens_per_sec']:,.0f} | {base} | {vs} | {vs16} "
                     f"| {r['tflops_per_gpu']:.1f} | {r['mfu']:.3f} | {r['peak_mem_gb']:.2f} "
                     f"({r['baseline_peak_mem_gb']}) | {r['iter_ms']:.1f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
