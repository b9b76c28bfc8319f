"""The planner at simulator accuracy (issue 29): predicted vs measured step time and peak memory on
configurations the planner was not tuned on, predicted (and committed) before they ran.

Usage (from the repository root):
    PYTHONPATH=src python bench/plan_accuracy.py predict      # adds new cases to bench/plan_accuracy_predictions.json
    PYTHONPATH=src python bench/plan_accuracy.py predict --gpu H100-80GB --cases ...   # another GPU's (predictions_path)
    PYTHONPATH=src python bench/plan_accuracy.py run --out $OUT [--deadline-s 300]   # the lent H200
    PYTHONPATH=src python bench/plan_accuracy.py table RESULTS.jsonl                  # the markdown table
    PYTHONPATH=src python bench/plan_accuracy.py now RESULTS.jsonl    # the same runs, the current model's figures
    PYTHONPATH=src python bench/plan_accuracy.py margin bench/results.jsonl          # the HBM safety margin

``run`` has two phases, so that the device time goes into measured steps, not into compiling:
1. warm: every case for 2 iterations with one layer (``WARM_FLAGS``: every layer compiles to the same
   graph), several at once (first-fit-decreasing groups whose predicted device bytes sum to at most
   ``WARM_SHARE`` of the GPU's memory), which fills torch.compile's caches (Inductor's FX-graph and autograd caches);
2. measure: each case alone, as its own ``meshlm pretrain`` process (bench/runs.py), --iters iterations;
   step = median ``iter_ms`` after --warmup, peak = the largest ``mem_max_allocated_gb`` (torch
   max_memory_allocated).
Cases left when fewer than ``CASE_RESERVE_S`` seconds of --deadline-s remain are skipped and said so.
One JSON row per measured case goes to $OUT/results.jsonl as it is measured, with the GPU's SM clock and
power-cap share while it ran (bench/gpu_clocks.py: at the H200's 700 W cap a GPU-bound step runs slower).

Predicted: ``runs.predict`` (``memory.estimate(...).peak_bytes``, ``cost.step_time(...).total``, the
H200-141GB preset), the same constants for every case. Since session 15 the committed prediction also
holds the step's phases (``phases_ms``: [host ms, GPU ms] in launch order, ``StepTime.phases`` at
host_scale 1), so that the step is a committed function of the host's speed: ``run`` first times this
host as ``plan --calibrate`` does (``host.launch_seconds``, the median of ``LAUNCH_READINGS``;
host_scale = it over ``host.REFERENCE_LAUNCH_S``) and records each run's prediction at it
(``host.rescaled(phases, host_scale)``, what a user who calibrated would have been told) and at the
preset's host_scale 1. The row's ``predicted_step_ms`` (the one compared, ``host_scale`` in the row) is
the preset's, or with --calibrate-host the measured scale's: session 15 compared at the measured scale
and found the launch timing too noisy to help (bench/RESULTS.md: 7.7–11.3 µs on one host within four
minutes; 2 of 3 host-influenced runs further off than at the preset), so the preset is the default. With --probe-host the call also times a training step's host work at its
start (``probe_scale``: the d16 host probe against the planner's host terms for it) and records each run's
prediction at that scale beside the compared one, so that a later session can judge it. ``margin`` reads every ``plan_check`` /
``plan_accuracy`` row of a results file: the largest measured / predicted peak, i.e. how far below HBM a
prediction must stay to be safe on every recorded run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_clocks import Sampler  # noqa: E402
from runs import COMMON, predict, records  # noqa: E402

from meshlm.planner import host  # noqa: E402

WARM_SHARE = 0.88  # the warm phase's concurrent runs: predicted device bytes together at most this share of the GPU's
WARM_FLAGS = ["--num-layers", "1"]  # every layer compiles to the same graph: one layer fills the caches
CASE_RESERVE_S = 25.0
LAUNCH_READINGS = 5  # the call's host_scale: the median of this many host.launch_seconds at its start
# The probe's host_scale (--probe-host): bench/host_probe.py's dense reference d16 (host_probe_shapes.sh's D:
# llama-1b layout at h 1,024, 256 tokens, where the GPU never bounds the step) measured against the
# planner's host terms for it: the training step's own host work (Python, dynamo's guards, autograd),
# where a launch's time follows the driver (session 15: d16 ran 1.18x the model on a host whose
# host-bound MoE run ran 1.20x, while the launch timing read 7.6-11.3 us within minutes).
PROBE_FLAGS = ["--model", "llama-1b", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size",
               "4096", "--vocab-size", "8192", "--seq-length", "256", "--max-position-embeddings", "256",
               "--micro-batch-size", "1", "--global-batch-size", "1"]
PROBE_STEPS = 10
PREDICTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_accuracy_predictions.json")
REFERENCE_PRESET = "H200-141GB"  # PREDICTIONS' GPU; another preset's predictions: predictions_path(preset)


def predictions_path(preset: str) -> str:
    """The committed predictions of planner GPU preset ``preset``: PREDICTIONS for the H200 (every case),
    plan_accuracy_predictions_<preset>.json for another (the cases predicted for it with ``predict --gpu``,
    e.g. when the lent machine is an H100; step times differ, peaks do not)."""
    return PREDICTIONS if preset == REFERENCE_PRESET else PREDICTIONS.replace(".json", f"_{preset}.json")


def _gpt(name: str, seq: int) -> list:
    return ["--model", name, "--vocab-size", "50304", "--seq-length", str(seq), "--max-position-embeddings",
            str(seq), "--attention-dropout", "0"]


def _llama(name: str, seq: int, vocab: int = 128256) -> list:
    return ["--model", name, "--vocab-size", str(vocab), "--seq-length", str(seq), "--max-position-embeddings",
            str(seq)]


def _moe(seq: int, experts: int, topk: int, ffn: int) -> list:
    return _llama("mixtral-small", seq, 32000) + ["--num-experts", str(experts), "--moe-router-topk", str(topk),
                                                  "--moe-ffn-hidden-size", str(ffn)]


def _mb(micro: int, acc: int = 1) -> list:
    return ["--micro-batch-size", str(micro), "--global-batch-size", str(micro * acc)]


SEL = ["--recompute-activations"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
ZERO = ["--use-distributed-optimizer"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
PAO = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
CASES = {  # name: flags, in the order they are measured; none of these shapes or sizes is in plan_check.py's tuned set
    "llama8b-w-L16-s4k-m2-full-zero": _llama("llama3-8b", 4096) + ["--num-layers", "16"] + _mb(2) + FULL + ZERO,
    "mixtral-small-s2k-m4": _llama("mixtral-small", 2048, 32000) + _mb(4),
    "llama1b-s16k-m1-sel": _llama("llama-1b", 16384) + _mb(1) + SEL,
    "gpt350m-s1k-m16": _gpt("gpt2-350m", 1024) + ["--hidden-dropout", "0"] + _mb(16),
    "llama3b-s1k-m16-full": _llama("llama-3b", 1024) + _mb(16) + FULL,
    "gpt760m-s2k-m8-sel-drop": _gpt("gpt2-760m", 2048) + _mb(8) + SEL,
    "llama8b-w-L8-s2k-m4": _llama("llama3-8b", 2048) + ["--num-layers", "8"] + _mb(4),
    "llama3b-s8k-m1-sel-zero": _llama("llama-3b", 8192) + _mb(1) + SEL + ZERO,
    "gpt1.3b-s8k-m1": _gpt("gpt2-1.3b", 8192) + ["--hidden-dropout", "0"] + _mb(1),
    "mixtral-small-s4k-m2-sel-acc2": _llama("mixtral-small", 4096, 32000) + _mb(2, 2) + SEL,
    "gpt2.7b-s2k-m4-acc2": _gpt("gpt3-2.7b", 2048) + ["--hidden-dropout", "0"] + _mb(4, 2),
    "llama1b-s4k-m2-v128k": _llama("llama-1b", 4096) + _mb(2),
    # the second set (2026-12-03), predicted by the model with the attention curve (cost.attention_efficiency)
    "gpt760m-s8k-m1-full": _gpt("gpt2-760m", 8192) + ["--hidden-dropout", "0"] + _mb(1) + FULL,
    "gpt1.3b-s16k-m1-sel": _gpt("gpt2-1.3b", 16384) + ["--hidden-dropout", "0"] + _mb(1) + SEL,
    "llama8b-w-L4-s8k-m1": _llama("llama3-8b", 8192) + ["--num-layers", "4"] + _mb(1),
    "gpt350m-s4k-m4-acc2": _gpt("gpt2-350m", 4096) + ["--hidden-dropout", "0"] + _mb(4, 2),
    # the third set (2026-12-03), MoE, predicted by the model with the grouped-GEMM and compiled-layer terms
    "mixtral-small-s4k-m4": _llama("mixtral-small", 4096, 32000) + _mb(4),
    "moe-e16-top4-f1792-s2k-m4": _llama("mixtral-small", 2048, 32000) + ["--num-experts", "16", "--moe-router-topk", "4",
                                                                      "--moe-ffn-hidden-size", "1792"] + _mb(4),
    # the fourth set (2026-12-03, session 11): the grouped GEMM as tiles and waves, the FP8 activation casts
    "moe-e16-top2-f1792-s2k-m8": _llama("mixtral-small", 2048, 32000) + ["--num-experts", "16", "--moe-router-topk", "2",
                                                                      "--moe-ffn-hidden-size", "1792"] + _mb(8),
    "moe-e8-top4-f1792-s1k-m16": _llama("mixtral-small", 1024, 32000) + ["--moe-router-topk", "4",
                                                                      "--moe-ffn-hidden-size", "1792"] + _mb(16),
    "llama3b-s2k-m4-fp8": _llama("llama-3b", 2048) + _mb(4) + FP8,
    "gpt1.3b-s4k-m2-full-zero": _gpt("gpt2-1.3b", 4096) + ["--hidden-dropout", "0"] + _mb(2) + FULL + ZERO,
    "llama8b-w-L4-s4k-m2-fp8-sel": _llama("llama3-8b", 4096) + ["--num-layers", "4"] + _mb(2) + FP8 + SEL,
    "gpt760m-s16k-m1-sel": _gpt("gpt2-760m", 16384) + ["--hidden-dropout", "0"] + _mb(1) + SEL,
    # the fifth set (2026-12-04): FP8 on its own size curve (cost.fp8_speedup), the grouped GEMM at its calibrated
    # rate and the MoE cost that grows with the expert count (moe_cp.routing_seconds)
    "gpt350m-s2k-m8-sel": _gpt("gpt2-350m", 2048) + ["--hidden-dropout", "0"] + _mb(8) + SEL,
    "llama1b-s8k-m1-fp8-sel": _llama("llama-1b", 8192) + _mb(1) + FP8 + SEL,
    "moe-e12-top3-f2048-s2k-m4": _moe(2048, 12, 3, 2048) + _mb(4),
    "gpt1.3b-s1k-m16-full": _gpt("gpt2-1.3b", 1024) + ["--hidden-dropout", "0"] + _mb(16) + FULL,
    "llama8b-w-L6-s2k-m2-fp8": _llama("llama3-8b", 2048) + ["--num-layers", "6"] + _mb(2) + FP8,
    "moe-e16-top1-f3584-s4k-m2": _moe(4096, 16, 1, 3584) + _mb(2),
    "gpt760m-s4k-m2-zero": _gpt("gpt2-760m", 4096) + ["--hidden-dropout", "0"] + _mb(2) + ZERO,
    "gpt2.7b-s4k-m1-fp8": _gpt("gpt3-2.7b", 4096) + ["--hidden-dropout", "0"] + _mb(1) + FP8,
    "moe-e4-top1-f7168-s2k-m4-sel": _moe(2048, 4, 1, 7168) + _mb(4) + SEL,
    "llama8b-w-L4-s1k-m8-sel-zero": _llama("llama3-8b", 1024) + ["--num-layers", "4"] + _mb(8) + SEL + ZERO,
    "llama3b-s4k-m2-fp8-full": _llama("llama-3b", 4096) + _mb(2) + FP8 + FULL,
    "moe-e32-top4-f896-s2k-m2": _moe(2048, 32, 4, 896) + _mb(2),
    # the sixth set (2026-12-04, session 13): the host-time model (planner/host.py), no T·E² term, FP8 at 2× on
    # bf16's size curve with 44 bytes a weight of casts
    "moe-e8-top1-f3584-s2k-m2": _moe(2048, 8, 1, 3584) + _mb(2),
    "gpt1.3b-s2k-m2-fp8": _gpt("gpt2-1.3b", 2048) + ["--hidden-dropout", "0"] + _mb(2) + FP8,
    "llama1b-s2k-m4-zero": _llama("llama-1b", 2048) + _mb(4) + ZERO,
    "moe-e24-top2-f1024-s1k-m8": _moe(1024, 24, 2, 1024) + _mb(8),
    "llama1b-s2k-m2-fp8-full": _llama("llama-1b", 2048) + _mb(2) + FP8 + FULL,
    "gpt350m-s4k-m2-full": _gpt("gpt2-350m", 4096) + ["--hidden-dropout", "0"] + _mb(2) + FULL,
    "moe-e6-top2-f2048-s4k-m1-sel": _moe(4096, 6, 2, 2048) + _mb(1) + SEL,
    "llama8b-w-L4-s2k-m4-fp8-zero": _llama("llama3-8b", 2048) + ["--num-layers", "4"] + _mb(4) + FP8 + ZERO,
    "llama3b-s1k-m8-sel": _llama("llama-3b", 1024) + _mb(8) + SEL,
    "gpt350m-s16k-m1": _gpt("gpt2-350m", 16384) + ["--hidden-dropout", "0"] + _mb(1),
    "llama8b-w-L8-s1k-m16": _llama("llama3-8b", 1024) + ["--num-layers", "8"] + _mb(16),
    # the seventh set (2026-12-04, session 14): the deferred loop's overlap (host.step_phases); the four
    # session-13 cases above that were not reached are re-predicted with it (their old figures dropped unmeasured)
    "moe-e8-top2-f2048-s4k-m2": _moe(4096, 8, 2, 2048) + _mb(2),
    "moe-e16-top2-f1024-s2k-m4-full": _moe(2048, 16, 2, 1024) + _mb(4) + FULL,
    "gpt2.7b-s8k-m1-sel": _gpt("gpt3-2.7b", 8192) + ["--hidden-dropout", "0"] + _mb(1) + SEL,
    "llama1b-s4k-m2-acc2-fp8": _llama("llama-1b", 4096) + _mb(2, 2) + FP8,
    "gpt760m-s1k-m16-zero": _gpt("gpt2-760m", 1024) + ["--hidden-dropout", "0"] + _mb(16) + ZERO,
    "llama3b-s16k-m1-full": _llama("llama-3b", 16384) + _mb(1) + FULL,
    # the eighth set (2026-12-04, session 15): the MoE host terms re-measured (planner/host.py), attention at a
    # head dim between 64-tiles run as the next tile (cost.attention_efficiency); committed with their phases,
    # compared at the call's host_scale; measured in this order
    "moe-e8-top2-f1536-s2k-m4": _moe(2048, 8, 2, 1536) + _mb(4),
    "gpt2.7b-s2k-m2-full": _gpt("gpt3-2.7b", 2048) + ["--hidden-dropout", "0"] + _mb(2) + FULL,
    "moe-e16-top2-f1024-s4k-m1-full": _moe(4096, 16, 2, 1024) + _mb(1) + FULL,
    "llama8b-w-L6-s4k-m1-zero": _llama("llama3-8b", 4096) + ["--num-layers", "6"] + _mb(1) + ZERO,
    "gpt760m-s8k-m2-sel": _gpt("gpt2-760m", 8192) + ["--hidden-dropout", "0"] + _mb(2) + SEL,
    "llama1b-s8k-m2-fp8": _llama("llama-1b", 8192) + _mb(2) + FP8,
    "gpt350m-s2k-m16": _gpt("gpt2-350m", 2048) + ["--hidden-dropout", "0"] + _mb(16),
    "moe-e4-top1-f3584-s1k-m16-sel": _moe(1024, 4, 1, 3584) + _mb(16) + SEL,
    "llama8b-w-L4-s16k-m1-sel": _llama("llama3-8b", 16384) + ["--num-layers", "4"] + _mb(1) + SEL,
    "llama3b-s2k-m4-zero": _llama("llama-3b", 2048) + _mb(4) + ZERO,
    "gpt1.3b-s16k-m1-full": _gpt("gpt2-1.3b", 16384) + ["--hidden-dropout", "0"] + _mb(1) + FULL,
    "gpt2.7b-s1k-m8-fp8": _gpt("gpt3-2.7b", 1024) + ["--hidden-dropout", "0"] + _mb(8) + FP8,
    # the ninth set (2026-12-04, session 15, integrator): after the experts' gradients went uncopied under
    # half_grads (a flat run per expert stack) and bf16 Adam moments (PAO); committed before any of them runs
    # (first predicted on a one-call flat update that left main unmeasured, then again without it, still unrun)
    "llama1b-s2k-m8-pao": _llama("llama-1b", 2048) + _mb(8) + PAO,
    "gpt350m-s4k-m4-sel": _gpt("gpt2-350m", 4096) + ["--hidden-dropout", "0"] + _mb(4) + SEL,
    "moe-e8-top2-f3584-s2k-m6": _moe(2048, 8, 2, 3584) + _mb(6),
    "moe-e16-top2-f1792-s1k-m8-pao": _moe(1024, 16, 2, 1792) + _mb(8) + PAO,
    "llama3b-s4k-m2-acc2-zero": _llama("llama-3b", 4096) + _mb(2, 2) + ZERO,
    "gpt1.3b-s2k-m8-full": _gpt("gpt2-1.3b", 2048) + ["--hidden-dropout", "0"] + _mb(8) + FULL,
    "llama8b-w-L4-s8k-m1-fp8": _llama("llama3-8b", 8192) + ["--num-layers", "4"] + _mb(1) + FP8,
    "gpt760m-s4k-m4": _gpt("gpt2-760m", 4096) + ["--hidden-dropout", "0"] + _mb(4),
    "moe-e4-top2-f2048-s8k-m1-sel": _moe(8192, 4, 2, 2048) + _mb(1) + SEL,
    "gpt2.7b-s4k-m1-pao-zero": _gpt("gpt3-2.7b", 4096) + ["--hidden-dropout", "0"] + _mb(1) + PAO + ZERO,
    # the tenth set (2026-12-05, session 19): after the one-call flat update (issue 31) and the model's session-19
    # terms (bench/RESULTS.md); committed before any of them runs; measured in this order
    "moe-e8-top2-f2048-s2k-m8": _moe(2048, 8, 2, 2048) + _mb(8),
    "gpt350m-s8k-m2-full": _gpt("gpt2-350m", 8192) + ["--hidden-dropout", "0"] + _mb(2) + FULL,
    "llama3b-s8k-m1-fp8": _llama("llama-3b", 8192) + _mb(1) + FP8,
    "gpt760m-s2k-m4-acc2-zero": _gpt("gpt2-760m", 2048) + ["--hidden-dropout", "0"] + _mb(4, 2) + ZERO,
    "moe-e16-top2-f1536-s4k-m2-sel": _moe(4096, 16, 2, 1536) + _mb(2) + SEL,
    "llama1b-s1k-m16-sel": _llama("llama-1b", 1024) + _mb(16) + SEL,
    "gpt2.7b-s2k-m4-full-zero": _gpt("gpt3-2.7b", 2048) + ["--hidden-dropout", "0"] + _mb(4) + FULL + ZERO,
    "llama8b-w-L4-s4k-m2": _llama("llama3-8b", 4096) + ["--num-layers", "4"] + _mb(2),
    "mixtral8x7b-w-L2-s4k-m1": _llama("mixtral-8x7b", 4096, 32000) + ["--num-layers", "2"] + _mb(1),
    "gpt1.3b-s4k-m4-sel": _gpt("gpt2-1.3b", 4096) + ["--hidden-dropout", "0"] + _mb(4) + SEL,
    "llama1b-s16k-m1": _llama("llama-1b", 16384) + _mb(1),
    "gpt1.3b-s1k-m8-fp8-zero": _gpt("gpt2-1.3b", 1024) + ["--hidden-dropout", "0"] + _mb(8) + FP8 + ZERO,
    "llama8b-w-L6-s2k-m2-sel-zero": _llama("llama3-8b", 2048) + ["--num-layers", "6"] + _mb(2) + SEL + ZERO,
    "llama3b-s2k-m2-acc4-pao": _llama("llama-3b", 2048) + _mb(2, 4) + PAO,
}


def predictions(date: str, preset: str = REFERENCE_PRESET, cases=None) -> dict:
    """{case: {"flags", "peak_gib", "step_ms", "device_gib", "predicted"}} from the planner on GPU preset
    ``preset``, nothing run: the committed file's cases as they are (a prediction, once committed, is never
    redone), the planner's figures (dated ``date``) for the cases it lacks (of ``cases``, default all)."""
    from meshlm.planner.gpus import PRESETS, GiB
    out, path = {}, predictions_path(preset)
    if os.path.exists(path):
        with open(path) as fh:
            out = json.load(fh)
    for name in cases or CASES:
        flags = CASES[name]
        if name in out:
            continue
        p = predict(flags + COMMON, 1, gpu=PRESETS[preset])
        out[name] = {"flags": " ".join(flags), "peak_gib": round(p["peak_gib"], 3), "step_ms": round(p["step_ms"], 2),
                     "device_gib": round(p["device_bytes"] / GiB, 3), "predicted": date,
                     "phases_ms": [[round(1e3 * h, 4), round(1e3 * g, 4)] for h, g in p["time"]["phases"]]}
    return out


def _pretrain(name: str, flags: list, out: str, iters: int, port: int = 29500) -> tuple:
    """(process, run dir) of `meshlm pretrain` on one GPU as rank 0 of a torchrun-style job of one (the
    environment torchrun sets), so that no launcher process is started first."""
    run_dir = os.path.join(out, "runs", name + f"-{iters}")
    cmd = [sys.executable, "-m", "meshlm", "pretrain", *flags, *COMMON, "--train-iters", str(iters),
           "--run-dir", run_dir]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = open(os.path.join(out, "logs", f"{name}-{iters}.log"), "w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), run_dir


def calibrated_ms(p: dict, scale: float) -> float:
    """A committed prediction's step ms on a host ``scale`` times the reference's launch time: from its
    ``phases_ms`` (``host.rescaled``), or its ``step_ms`` where it has none (committed before session 15)."""
    if "phases_ms" not in p:
        return p["step_ms"]
    return host.rescaled([(h, g) for h, g in p["phases_ms"]], scale)


def _launch_us(readings: int = 1) -> float:
    """This host's launch time, µs (``plan --calibrate``'s: ``host.launch_seconds`` on the GPU), the
    median of ``readings`` (one host read 7.6–10.7 µs within minutes: bench/RESULTS.md session 15)."""
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return 1e6 * statistics.median(host.launch_seconds(dev) for _ in range(readings))


def probe_scale(out: str) -> dict:
    """{"host_scale_probe", "probe_host_ms", "probe_model_ms"}: bench/host_probe.py's median host ms of
    the d16 step (``PROBE_FLAGS``, its own process, ``PROBE_STEPS`` steps) over the planner's host ms for
    it at host_scale 1; {} when the probe fails (its log in ``out``/logs/host_probe.log)."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "host_probe.py"), "--label", "d16", "--steps", str(PROBE_STEPS),
           *PROBE_FLAGS, *COMMON, "--run-dir", os.path.join(out, "runs", "host_probe")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(out, "logs", "host_probe.log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    if proc.returncode != 0 or line is None:
        return {}
    summary = json.loads(line[len("SUMMARY "):])
    measured, model = summary["median"]["host_ms"], sum(summary["model_ms"].values())
    return {"host_scale_probe": round(measured / model, 4), "probe_host_ms": measured, "probe_model_ms": round(model, 2)}


def run(args) -> None:
    start = time.time()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    launch = _launch_us(LAUNCH_READINGS)
    scale = launch * 1e-6 / host.REFERENCE_LAUNCH_S
    print(f"host: a launch {launch:.2f} µs, host_scale {scale:.3f}", flush=True)
    probe = probe_scale(args.out) if args.probe_host else {}
    if args.probe_host:
        print(f"host: the d16 probe {probe or 'failed (logs/host_probe.log)'}", flush=True)
    import torch
    from meshlm.planner.gpus import gpu_of_device
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    gpu = gpu_of_device(device)[0]
    preset, warm_gib = gpu.name, WARM_SHARE * gpu.memory_bytes / 2 ** 30
    with open(predictions_path(preset)) as fh:
        pred = json.load(fh)
    print(f"device {device}: the {preset} predictions ({predictions_path(preset)})", flush=True)
    names = [n for n in args.cases or list(CASES) if n in pred]
    if len(names) < len(args.cases or CASES):
        print(f"not predicted for {preset}, not run: {sorted(set(args.cases or CASES) - set(names))}", flush=True)
    warm = {n: predict(CASES[n] + WARM_FLAGS + COMMON, 1)["device_bytes"] / 2 ** 30 for n in names}
    groups = []  # first-fit decreasing by predicted device GiB, warm_gib a group
    for name in sorted(names, key=lambda n: -warm[n]):
        g = next((g for g in groups if sum(warm[n] for n in g) + warm[name] <= warm_gib), None)
        groups.append([name]) if g is None else g.append(name)
    for g in groups:
        if time.time() - start > args.warm_budget_s:
            print(f"warm phase stopped at {time.time() - start:.0f} s; not warmed: {g}", flush=True)
            break
        procs = [_pretrain(n, CASES[n] + WARM_FLAGS, args.out, 2, port=29600 + i)[0] for i, n in enumerate(g)]
        codes = [p.wait() for p in procs]
        print(f"warm {g}: exit {codes} at {time.time() - start:.0f} s", flush=True)
    with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
        for name in names:
            left = args.deadline_s - (time.time() - start)
            if left < CASE_RESERVE_S:
                print(f"{name}: skipped, {left:.0f} s of the deadline left", flush=True)
                continue
            t0 = time.time()
            launch_case = _launch_us()
            with Sampler(period_ms=500) as clocks:  # the SM clock and power cap while it runs
                proc, run_dir = _pretrain(name, CASES[name], args.out, args.iters)
                try:
                    code = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = "timeout"
            rows = records(run_dir)[args.warmup:]
            peaks = [r["mem_max_allocated_gb"] for r in rows if r.get("mem_max_allocated_gb") is not None]
            finished = code == 0 or (code == "timeout" and len(rows) == args.iters - args.warmup)
            if not finished or not rows:  # a process killed at the deadline after its last iteration counts
                print(f"{name}: exit {code}, {len(rows)} measured rows", flush=True)
                continue
            p = pred[name]
            step, peak = statistics.median(r["iter_ms"] for r in rows), max(peaks) if peaks else None  # None on CPU
            used = scale if args.calibrate_host else 1.0
            predicted = calibrated_ms(p, used)
            rec = {"date": args.date, "bench": "plan_accuracy", "gpu": f"1x {device}", "preset": preset, "case": name, "flags": p["flags"],
                   "predicted_peak_gib": p["peak_gib"], "measured_peak_gib": peak,
                   "peak_error": round(p["peak_gib"] / peak - 1, 4) if peak else None,
                   "predicted_step_ms": round(predicted, 2), "measured_step_ms": round(step, 2),
                   "step_error": round(predicted / step - 1, 4), "host_scale": round(used, 4),
                   "host_scale_measured": round(scale, 4),
                   "predicted_step_ms_calibrated": round(calibrated_ms(p, scale), 2),
                   **({**probe, "predicted_step_ms_probe": round(calibrated_ms(p, probe["host_scale_probe"]), 2),
                       "step_error_probe": round(calibrated_ms(p, probe["host_scale_probe"]) / step - 1, 4)}
                      if probe else {}),
                   "launch_us": round(launch, 3), "launch_us_case": round(launch_case, 3),
                   "predicted_step_ms_preset": p["step_ms"], "step_error_preset": round(p["step_ms"] / step - 1, 4),
                   "iters": args.iters, "warmup": args.warmup, "wall_s": round(time.time() - t0, 1),
                   **({} if code == 0 else {"exit": "killed at the deadline after its last iteration"}),
                   "tokens_per_s": rows[-1].get("tokens_per_sec"), "mfu": rows[-1].get("mfu"), "clocks": clocks.summary(),
                   "iter_ms_all": [r["iter_ms"] for r in records(run_dir)]}
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(json.dumps(rec), flush=True)
    print(f"done at {time.time() - start:.0f} s; host: a launch {_launch_us():.2f} µs at the end", flush=True)


def table(rows: list) -> str:
    """The markdown table of plan_accuracy rows, with the median and worst |error| of each column."""
    lines = ["| case | predicted peak GiB | measured peak GiB | error | predicted ms/step | measured ms/step | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['predicted_peak_gib']:.2f} | {r['measured_peak_gib']:.2f} | "
                     f"{100 * r['peak_error']:+.1f}% | {r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} | "
                     f"{100 * r['step_error']:+.1f}% |")
    if rows:
        mem, step = [abs(r["peak_error"]) for r in rows], [abs(r["step_error"]) for r in rows]
        lines.append(f"| **median / worst \\|error\\|** ({len(rows)} runs) | | | {100 * statistics.median(mem):.1f}% / "
                     f"{100 * max(mem):.1f}% | | | {100 * statistics.median(step):.1f}% / {100 * max(step):.1f}% |")
    return "\n".join(lines)


def repredicted(rows: list) -> list:
    """The rows with the current planner's predictions in place of the committed ones (at the row's
    ``host_scale`` where it has one, else the preset's; on the row's GPU preset): after a model change these are in-sample
    figures, never a substitute for predictions committed before a run."""
    from meshlm.planner.gpus import PRESETS
    out = []
    for r in rows:
        p = predict(r["flags"].split() + COMMON, 1, gpu=PRESETS[r.get("preset", REFERENCE_PRESET)])
        step = 1e3 * host.rescaled(p["time"]["phases"], r.get("host_scale", 1.0))
        out.append(dict(r, predicted_peak_gib=p["peak_gib"], predicted_step_ms=step,
                        peak_error=p["peak_gib"] / r["measured_peak_gib"] - 1,
                        step_error=step / r["measured_step_ms"] - 1))
    return out


def margin(rows: list) -> dict:
    """{"runs", "worst_case", "worst_ratio"}: the largest measured / predicted peak over the rows; a
    layout is safe on every recorded run when predicted peak × worst_ratio < HBM."""
    ratios = [((r.get("measured_peak_gib") or r.get("peak_mem_gib")) / r["predicted_peak_gib"], r["case"])
              for r in rows if (r.get("measured_peak_gib") or r.get("peak_mem_gib")) and r.get("predicted_peak_gib")]
    worst = max(ratios)
    return {"runs": len(ratios), "worst_ratio": round(worst[0], 4), "worst_case": worst[1]}


def _rows(path: str, benches=("plan_accuracy",)) -> list:
    with open(path) as fh:
        return [r for r in (json.loads(x) for x in fh if x.strip()) if r.get("bench") in benches]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("predict", "run", "table", "now", "margin"))
    ap.add_argument("path", nargs="?")
    ap.add_argument("--cases", nargs="*")
    ap.add_argument("--gpu", default=REFERENCE_PRESET, help="predict: the planner GPU preset (default %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out/plan_accuracy"))
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--warm-budget-s", type=float, default=150.0)
    ap.add_argument("--calibrate-host", action="store_true",
                    help="compare each run at the host_scale measured at the call's start, not the preset's 1")
    ap.add_argument("--probe-host", action="store_true",
                    help="also time the d16 host probe at the call's start and record each run's prediction at "
                         "its host_scale (predicted_step_ms_probe; the compared figure stays the preset's)")
    args = ap.parse_args()
    if args.action == "predict":
        found, path = predictions(args.date, args.gpu, args.cases), predictions_path(args.gpu)
        with open(path, "w") as fh:
            json.dump(found, fh, indent=1)
        print(open(path).read())
    elif args.action == "run":
        run(args)
    elif args.action == "table":
        print(table(_rows(args.path)))
    elif args.action == "now":
        print(table(repredicted(_rows(args.path))))
    else:
        print(json.dumps(margin(_rows(args.path, ("plan_check", "plan_accuracy", "scaling")))))


if __name__ == "__main__":
    main()
