"""Scaling on several GPUs of one host (issue 17): tokens/s against one GPU, MFU, memory, exposed
communication and bubble, each beside the planner's prediction; one table, one invocation.

Device command: one `run` call, kind nvidia-h200-x2, timeout_s 600, this command line:
    export PYTHONPATH=src PYTHONUNBUFFERED=1; nvidia-smi -L; timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_layouts_gpu.py 2>&1 | tee $OUT/layouts.log; python3 bench/scaling.py --out /tmp/sc --results $OUT/results.jsonl --record $OUT/RESULTS.md --budget-s 340 2>&1 | tee $OUT/scaling.log; tar czf $OUT/runs.tgz -C /tmp/sc .
Estimated wall time 9–9.5 minutes, bounded at ~570 s by the two limits: the layout tests ~3 minutes
(8 trainer builds, each compiling its small layers), then the bench: ~15 s of start-up, 20–60 s of
compilation and 10–20 s of steps a case, ~60–90 s each, so about 5 of the 7 cases fit its 340 s; a
case that would start later is skipped and named under the table, and a second call with
`bench/scaling.py pp2-interleaved best-2 …` (the 1-GPU baseline reruns with them) measures the rest.
On nvidia-h200-x8: the same line with `export CUDA_VISIBLE_DEVICES=0,1;` first (the 2-GPU set), then a
second call: `export PYTHONPATH=src PYTHONUNBUFFERED=1; python3 bench/scaling.py 1gpu dp8 8b-tp2pp2dp2
8b-best --out /tmp/sc --results $OUT/results.jsonl --record $OUT/RESULTS.md --budget-s 540 2>&1 | tee
$OUT/scaling.log; tar czf $OUT/runs.tgz -C /tmp/sc .` (~8 minutes: the 8B cases ~2 minutes each).
Then append $OUT/results.jsonl to bench/results.jsonl and $OUT/RESULTS.md to bench/RESULTS.md.
CPU smoke run (gloo, tiny model, 2 processes; writes under --out only):
    PYTHONPATH=src python bench/scaling.py --tiny [case ...]

Cases (CASES; a case needing more GPUs than are visible is skipped, and the 1-GPU case always runs
first, since every scaling figure is against it): the 1.14B Llama of bench/bench.py at sequence 2048,
bf16, the default fast path, micro-batch 8, global batch 64 in every layout (the same job on more
GPUs: 8 micro-batches per step on one GPU, 4 per rank at DP 2, 8 through the pipeline at PP 2);
DP 2 plain and with --use-distributed-optimizer and both overlaps; TP 2 with SP; PP 2 1F1B and
interleaved (v 2); the planner's best layout for 2 GPUs (`meshlm plan`'s search, planner/search.py);
on 8 GPUs DP 8 and Llama-3-8B (seq 2048, micro-batch 1, global batch 16) at TP 2 SP × PP 2 × DP 2
with the distributed optimizer and both overlaps, and at the planner's best layout for 8 GPUs;
issue 31's moe-1gpu and moe-ep2: mixtral-small with a shared expert of 3584 (micro-batch 8, global
64) at EP 1 and at EP 2 × DP 2, where the rows' all-to-all overlaps the shared expert's forward and backward
(their scaling is against moe-1gpu: each model's first 1-GPU case is its baseline; --tiny runs
them on mixtral-tiny).
Each case is one `meshlm pretrain` process (bench/runs.py), logging every ``log`` iterations; the
first logged interval (compilation) is left out, as `meshlm analyze` does, and the figures are the
medians of the other intervals. On a logged iteration under PP the timeline synchronises the GPU
around every forward and backward, so one iteration in ``log`` pays that.

Figures: tokens/s of the job; scaling = tokens/s ÷ the same run's 1-GPU tokens/s (target for DP 2,
with or without the distributed optimizer: ≥ 1.90, goal 1.95); MFU and TFLOP/s/GPU as metrics.jsonl
logs them (meshlm/flops.py: model FLOPs ÷ world ÷ 989.4 TFLOP/s); peak = mem_max_allocated_gb of
the logging rank (last stage, first TP/DP rank); exposed communication and bubble = `meshlm
analyze`'s step breakdown (planner/analyze.py: comm_share by kind, measured bubble). Under the fast
path TP's collectives run inside compiled layers and are not timed; the planner's shares (column
"planner") then say what TP costs. Planner: bench/runs.py's predict (memory of the logging rank's
stage, step time, H200-141GB preset); targets: memory within 10%, step time within 20%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runs import COMMON, GPU, L1B, TINY, config_of, predict, pretrain  # noqa: E402

from meshlm.config import global_batch  # noqa: E402
from meshlm.planner.analyze import analyze, load_run  # noqa: E402
from meshlm.planner.search import search  # noqa: E402

MODELS = {  # name: (flags, iterations, log interval)
    "llama-1b": (L1B + ["--micro-batch-size", "8", "--global-batch-size", "64"], 12, 4),
    "llama3-8b": (["--model", "llama3-8b", "--vocab-size", "128256", "--seq-length", "2048",
                   "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "16"], 8, 2),
    "tiny": (TINY + ["--num-layers", "4", "--micro-batch-size", "2", "--global-batch-size", "8"], 6, 2),
    # issue 31: mixtral-small with a shared expert (the EP all-to-all overlaps its forward and backward)
    "mixtral-shared": (["--model", "mixtral-small", "--vocab-size", "32000", "--seq-length", "2048",
                        "--max-position-embeddings", "2048", "--moe-shared-expert-intermediate-size", "3584",
                        "--micro-batch-size", "8", "--global-batch-size", "64"], 12, 4),
    "tiny-moe": (["--model", "mixtral-tiny", "--vocab-size", "256", "--seq-length", "64", "--max-position-embeddings",
                  "64", "--moe-shared-expert-intermediate-size", "64", "--micro-batch-size", "2",
                  "--global-batch-size", "8"], 6, 2),
}
TINY_OF = {"mixtral-shared": "tiny-moe"}  # --tiny: the CPU stand-in of a model (else "tiny")
ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather"]
TP2, PP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--pipeline-model-parallel-size", "2"]
BEST = None  # the planner's best layout for the case's GPUs
CASES = {  # name: (model, GPUs, layout flags); run in this order
    "1gpu": ("llama-1b", 1, []),
    "dp2": ("llama-1b", 2, []),
    "dp2-zero1-overlap": ("llama-1b", 2, ZERO1),
    "tp2-sp": ("llama-1b", 2, TP2),
    "pp2": ("llama-1b", 2, PP2),
    "pp2-interleaved": ("llama-1b", 2, PP2 + ["--virtual-pipeline-model-parallel-size", "2"]),
    "best-2": ("llama-1b", 2, BEST),
    "dp8": ("llama-1b", 8, []),
    "8b-tp2pp2dp2": ("llama3-8b", 8, TP2 + PP2 + ZERO1),
    "8b-best": ("llama3-8b", 8, BEST),
    # issue 26 (ZeRO-2/3), not run yet: `bench/scaling.py 1gpu dp2-zero2 dp2-zero3` on nvidia-h200-x2,
    # `bench/scaling.py 1gpu dp8-zero2 dp8-zero3 8b-dp8-zero3` on nvidia-h200-x8 (the command lines above)
    "dp2-zero2": ("llama-1b", 2, ZERO2),
    "dp2-zero3": ("llama-1b", 2, ZERO3),
    "dp8-zero2": ("llama-1b", 8, ZERO2),
    "dp8-zero3": ("llama-1b", 8, ZERO3),
    "8b-dp8-zero3": ("llama3-8b", 8, ZERO3),
    # issue 31 (EP all-to-all overlapped with the shared expert), not run yet, on nvidia-h200-x2:
    # `bench/scaling.py moe-1gpu moe-ep2` (the first command line above with these cases); the
    # MoE rows scale against moe-1gpu
    "moe-1gpu": ("mixtral-shared", 1, []),
    "moe-ep2": ("mixtral-shared", 2, ["--expert-model-parallel-size", "2"]),
}
TARGETS = {"dp2": 1.90, "dp2-zero1-overlap": 1.90}  # scaling vs 1 GPU (issue 17; goal 1.95)
GOAL, MEM_TOL, STEP_TOL = 1.95, 0.10, 0.20
TINY_GPUS = 2  # --tiny: CPU processes (gloo) standing in for GPUs


def planner_best(model_flags: list, gpus: int) -> list:
    """The layout flags of `meshlm plan`'s fastest layout for the model on ``gpus`` GPUs of one host."""
    cfg = config_of(model_flags + COMMON)
    cfg.training.global_batch_size = global_batch(cfg, gpus)
    fits, _ = search(cfg, gpus, GPU, cfg.model.vocab_size, gpus_per_node=gpus, half=True)
    return fits[0].layout.flags()


def median(records: list, key: str):
    vals = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def measure(name: str, flags: list, gpus: int, out: str, timeout: float) -> dict:
    """Run one case; its measured figures, `meshlm analyze`'s breakdown and the planner's figures."""
    run_dir = os.path.join(out, "runs", name)
    t0 = time.time()
    run = pretrain(flags, gpus, run_dir, os.path.join(out, f"{name}.log"), timeout=timeout)
    if "error" in run:
        return run
    records, config = load_run(run_dir)
    steady = records[1:] if len(records) >= 3 else records  # analyze's warm-up rule
    breakdown = analyze(records, config)["breakdown"]
    pp = config_of(flags).parallel.pipeline_model_parallel_size
    pred = predict(flags, gpus, stage=pp - 1)  # the logging rank's stage
    peaks = [r["mem_max_allocated_gb"] for r in records if r.get("mem_max_allocated_gb") is not None]
    t = pred["time"]
    return {"device": records[-1].get("device"), "tokens_per_sec": median(steady, "tokens_per_sec"),
            "iter_ms": median(steady, "iter_ms"), "mfu": median(steady, "mfu"),
            "tflops_per_gpu": median(steady, "tflops_per_gpu"), "peak_gib": max(peaks) if peaks else None,
            "comm_share": {k: v for k, v in breakdown.items() if k != "bubble"},
            "bubble": breakdown.get("bubble"), "predicted": pred,
            "predicted_share": {"dp": t["dp_exposed"] / t["total"], "tp": t["tp_comm"] / t["total"],
                                "pp": t["pp_p2p"] / t["total"], "bubble": t["bubble"] / t["total"]},
            "first_losses": [round(r["lm_loss"], 4) for r in records[:3]], "wall_s": round(time.time() - t0, 1)}


def _rel(pred, meas):
    return None if pred is None or not meas else round(pred / meas - 1, 4)


def row(name: str, model: str, gpus: int, layout: list, m: dict, base: dict | None, date: str) -> dict:
    """One bench/results.jsonl record."""
    tps, pred = m["tokens_per_sec"], m["predicted"]
    scaling = None if base is None else round(tps / base["tokens_per_sec"], 3)
    r4 = (lambda x: None if x is None else round(x, 4))
    return {"date": date, "bench": "scaling", "gpu": m["device"], "gpus": gpus, "model": model, "case": name,
            "layout": " ".join(layout) or "default", "tokens_per_sec": round(tps, 1),
            "tokens_per_sec_per_gpu": round(tps / gpus, 1), "scaling_vs_1gpu": scaling,
            "scaling_efficiency": None if scaling is None else round(scaling / gpus, 3),
            "target_scaling": TARGETS.get(name), "mfu": r4(m["mfu"]), "tflops_per_gpu": r4(m["tflops_per_gpu"]),
            "peak_mem_gib": r4(m["peak_gib"]), "predicted_peak_gib": r4(pred["peak_gib"]),
            "peak_error": _rel(pred["peak_gib"], m["peak_gib"]), "measured_step_ms": round(m["iter_ms"], 3),
            "predicted_step_ms": round(pred["step_ms"], 3), "step_error": _rel(pred["step_ms"], m["iter_ms"]),
            "exposed_comm_share": {k: r4(v) for k, v in m["comm_share"].items()}, "bubble_fraction": r4(m["bubble"]),
            "predicted_share": {k: r4(v) for k, v in m["predicted_share"].items()},
            "first_losses": m["first_losses"], "wall_s": m["wall_s"]}


def _pct(x, signed=False) -> str:
    return "n/a" if x is None else f"{100 * x:{'+' if signed else ''}.1f}%"


def _shares(shares: dict) -> str:
    return " ".join(f"{k.upper()} {_pct(v)}" for k, v in shares.items() if v) or "–"


def table(rows: list) -> str:
    lines = ["| case | GPUs | layout | tokens/s | × 1 GPU | MFU | peak GiB (planner, error) | ms/step (planner, "
             "error) | exposed comm | bubble | planner comm / bubble |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        scal = "n/a" if r["scaling_vs_1gpu"] is None else f"{r['scaling_vs_1gpu']:.3f}"
        pred = dict(r["predicted_share"])
        lines.append(f"| {r['case']} | {r['gpus']} | `{r['layout']}` | {r['tokens_per_sec']:,.0f} | {scal} "
                     f"| {'n/a' if r['mfu'] is None else format(r['mfu'], '.3f')} | {peak} ({r['predicted_peak_gib']:.2f}, "
                     f"{_pct(r['peak_error'], True)}) | {r['measured_step_ms']:.1f} ({r['predicted_step_ms']:.1f}, "
                     f"{_pct(r['step_error'], True)}) | {_shares(r['exposed_comm_share'])} | {_pct(r['bubble_fraction'])} "
                     f"| {_shares({k: v for k, v in pred.items() if k != 'bubble'})} / {_pct(pred['bubble'])} |")
    return "\n".join(lines)


def verdicts(rows: list) -> list:
    """One line per target: DP scaling, planner memory and step time."""
    out = []
    for r in rows:
        if r["target_scaling"] and r["scaling_vs_1gpu"] is not None:
            s = r["scaling_vs_1gpu"]
            out.append(f"- {r['case']}: scaling {s:.3f}, target ≥ {r['target_scaling']:.2f} "
                       f"{'met' if s >= r['target_scaling'] else 'MISSED'}, goal {GOAL} {'met' if s >= GOAL else 'missed'}")
    for key, tol, what in (("peak_error", MEM_TOL, "memory"), ("step_error", STEP_TOL, "step time")):
        errs = {r["case"]: r[key] for r in rows if r[key] is not None}
        bad = [f"{c} {100 * e:+.1f}%" for c, e in errs.items() if abs(e) > tol]
        if errs:
            out.append(f"- planner {what} within {100 * tol:.0f}%: {len(errs) - len(bad)}/{len(errs)} cases"
                       + (f" (outside: {', '.join(bad)})" if bad else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help=f"cases (default: all that fit the visible GPUs): {', '.join(CASES)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "scaling-out"), help="runs, logs and scaling.md")
    ap.add_argument("--results", default=None, help="JSON rows appended here (default bench/results.jsonl; "
                    "with --tiny OUT/results.jsonl)")
    ap.add_argument("--record", nargs="?", const=os.path.join(os.path.dirname(__file__), "RESULTS.md"), default=None,
                    help="append the table as a section to this file (default bench/RESULTS.md)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--budget-s", type=float, default=None, help="skip the cases that would start after this many "
                    "seconds, and stop a running one at it (the table is printed either way)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, gloo, 2 processes")
    args = ap.parse_args()
    import torch
    visible = TINY_GPUS if args.tiny else torch.cuda.device_count()
    names = list(dict.fromkeys(["1gpu"] + (args.cases or list(CASES))))
    os.makedirs(args.out, exist_ok=True)
    results = args.results or (os.path.join(args.out, "results.jsonl") if args.tiny
                               else os.path.join(os.path.dirname(__file__), "results.jsonl"))
    t0, rows, bases, notes, seen = time.time(), [], {}, [], {}  # bases: model → its 1-GPU measurement
    for name in names:
        model, gpus, layout = CASES[name]
        if gpus > visible:
            notes.append(f"- {name}: skipped, needs {gpus} GPUs ({visible} visible)")
            continue
        left = None if args.budget_s is None else args.budget_s - (time.time() - t0)
        if left is not None and left < 30:
            notes.append(f"- {name}: skipped, --budget-s {args.budget_s:.0f} spent")
            continue
        mflags, iters, log = MODELS[TINY_OF.get(model, "tiny") if args.tiny else model]
        layout = planner_best(mflags, gpus) if layout is BEST else layout
        flags = [*mflags, *COMMON, "--log-interval", str(log), "--train-iters", str(iters), *layout]
        key = (gpus, tuple(flags))
        m = seen.get(key) or measure(name, flags, gpus, args.out, left)
        if key in seen:
            notes.append(f"- {name}: the planner's best is a layout measured above ({' '.join(layout)})")
        if "error" in m:
            notes.append(f"- {name}: error {m['error']}")
            print(f"{name}: error {m['error']}", flush=True)
            continue
        seen[key] = m
        if gpus == 1:
            bases.setdefault(model, m)
        rows.append(row(name, "tiny" if args.tiny else model, gpus, layout, m, bases.get(model), args.date))
        print(json.dumps(rows[-1]), flush=True)
    with open(results, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    text = "\n".join([table(rows), "", *verdicts(rows), *notes])
    with open(os.path.join(args.out, "scaling.md"), "w") as fh:
        fh.write(text + "\n")
    if args.record:
        gpu = rows[0]["gpu"] if rows else "n/a"
        with open(args.record, "a") as fh:
            fh.write(f"\n## {args.date} — {visible}× {gpu}, torch {torch.__version__}: scaling on one host "
                     f"(bench/scaling.py)\n\n`python bench/scaling.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
