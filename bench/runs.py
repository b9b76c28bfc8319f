"""What the bench scripts share: the flags every case runs with, the llama-1b and CPU-size shapes, one `meshlm
pretrain` run on --mock-data as its own process, and the planner's prediction of a run.

``pretrain`` launches the command users type (`python -m meshlm pretrain … --nproc-per-node N`:
meshlm starts its N local workers itself, NCCL on GPUs, gloo on CPU) on the first N visible GPUs and
returns the run's training records (metrics.jsonl lines with ``iter_ms``). ``predict`` is `meshlm
plan`'s memory estimate and step-time model for the same flags on ``world`` GPUs of one host, with
the H200-141GB preset: bench/plan_check.py checked it against one-GPU runs (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from meshlm import metrics_json  # noqa: E402
from meshlm.config import add_config_args, config_from_args, global_batch  # noqa: E402
from meshlm.planner.cost import step_time  # noqa: E402
from meshlm.planner.gpus import GiB, PRESETS  # noqa: E402
from meshlm.planner.layout import Layout  # noqa: E402
from meshlm.planner.memory import estimate  # noqa: E402

COMMON = ["--mock-data", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
          "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0"]
L1B = ["--model", "llama-1b", "--num-attention-heads", "16", "--untie-embeddings-and-output-weights",
       "--vocab-size", "32000", "--seq-length", "2048", "--max-position-embeddings", "2048"]
TINY = ["--model", "tiny", "--vocab-size", "256", "--seq-length", "64", "--max-position-embeddings", "64"]
GPU = PRESETS["H200-141GB"]


def pretrain(flags: list, gpus: int, run_dir: str, log_path: str, timeout: Optional[float] = None) -> dict:
    """Run ``meshlm pretrain FLAGS --nproc-per-node GPUS --run-dir RUN_DIR`` on the first ``gpus``
    visible GPUs; its command line and output go to ``log_path``. Returns {"records": training
    records in file order, "stdout"}, or {"error": [last output line]} when it fails or runs past
    ``timeout`` seconds (then it is killed; its workers die with it)."""
    cmd, env = command(flags, gpus, run_dir)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, failed = proc.stdout + proc.stderr, proc.returncode != 0
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or ""))
        out, failed = out + f"\ntimed out after {timeout:.0f} s", True
    with open(log_path, "w") as fh:
        fh.write(" ".join(cmd) + "\n" + out)
    if failed:
        return {"error": out.strip().splitlines()[-1:]}
    return {"records": records(run_dir), "stdout": proc.stdout}


def command(flags: list, gpus: int, run_dir: str) -> tuple:
    """(argv, environment) of ``meshlm pretrain FLAGS --nproc-per-node GPUS --run-dir RUN_DIR`` on the
    first ``gpus`` visible GPUs."""
    cmd = [sys.executable, "-m", "meshlm", "pretrain", *flags, "--nproc-per-node", str(gpus), "--run-dir", run_dir]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return cmd, dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(ids[:gpus]))


def records(run_dir: str) -> list:
    """The training records (metrics.jsonl lines with ``iter_ms``) of a run folder, in file order;
    [] when it has no metrics.jsonl yet."""
    path = os.path.join(run_dir, "logs", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [r for r in (metrics_json.loads(x) for x in fh if x.strip()) if r.get("iter_ms") is not None]


def config_of(flags: list):
    """The Config ``meshlm pretrain FLAGS`` builds (not validated)."""
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args(flags))


def predict(flags: list, world: int, stage: Optional[int] = None, gpu=GPU) -> dict:
    """The planner's figures for ``meshlm pretrain FLAGS`` on ``world`` GPUs (``gpu``, a planner GPU) of one host:
    {"peak_gib" (torch max allocated of pipeline rank ``stage``, default the larger of the first and
    the last), "step_ms", "device_bytes" (peak + CUDA context + fragmentation), "activations_gib", "state_gib",
    "host_gib" and "host_full_gib" (--optimizer-cpu-offload: the host bytes of the fraction and of the whole optimizer,
    memory.Memory), "time" (cost.StepTime as a dict, seconds)}."""
    cfg = config_of(flags)
    cfg.training.global_batch_size = global_batch(cfg, world)
    lay = Layout.of(cfg, world)
    vocab = cfg.model.vocab_size
    mem = estimate(cfg, lay, vocab, stage=stage)
    t = step_time(cfg, lay, gpu, vocab, gpus_per_node=world, params_per_rank=mem.params,
                  expert_params_per_rank=mem.expert_params)
    return {"peak_gib": mem.peak_bytes / GiB, "step_ms": 1000 * t.total, "device_bytes": mem.device_bytes, "activations_gib": mem.activations / GiB,
            "state_gib": (mem.weights + mem.optimizer + (mem.grads if mem.grads_at_peak else 0)) / GiB,
            "host_gib": mem.host_bytes / GiB, "host_full_gib": mem.host_optimizer_full / GiB, "time": t.to_json()}
