"""Where does one meshlm training step spend its GPU time? Profiles the production step
(trainer.train_step) of any `meshlm pretrain` flags on one GPU and groups the CUDA kernels.

Usage (lent machine, repository root):
    PYTHONPATH=src python bench/profile_step.py --model llama-1b ... --mock-data --bf16
Prints ms per step (wall, median of 5 after warm-up), GPU-busy ms, and a table of kernel
categories (GEMM, attention, compiled Triton kernels, optimizer, copies, other) with the top
kernels; writes a Chrome trace to $OUT/step_trace.json when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from meshlm.config import add_config_args, config_from_args
from meshlm.training.trainer import TrainState, build, train_step

CATEGORIES = [("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
              ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")),
              ("optimizer", ("adam", "multi_tensor", "foreach")),
              ("triton", ("triton",)),
              ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat")),
              ("nccl", ("nccl",))]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(sys.argv[1:]))
    cfg.training.train_iters = 1000
    cfg.training.log_interval = 1000
    t0 = time.perf_counter()
    run = build(cfg)
    torch.cuda.synchronize()
    print(f"build: {time.perf_counter() - t0:.1f} s", flush=True)
    state = TrainState()
    times = []
    for i in range(9):
        start = time.perf_counter()
        train_step(run, state)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i == 0:
            print(f"first step (compiles): {times[0]:.1f} s", flush=True)
    step_ms = statistics.median(times[4:]) * 1e3
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            train_step(run, state)
        torch.cuda.synchronize()
    if os.environ.get("OUT"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], "step_trace.json"))
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / 2e3  # ms per step
    by_cat, top = defaultdict(float), defaultdict(list)
    for e in kernels:
        c = category(e.key)
        by_cat[c] += e.self_device_time_total / 2e3
        top[c].append((e.self_device_time_total / 2e3, e.count // 2, e.key[:90]))
    print(f"\nstep {step_ms:.1f} ms wall (median of 5), GPU busy {busy:.1f} ms "
          f"({busy / step_ms:.0%}); peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print("| category | ms/step | share of busy | top kernels (ms/step, calls/step) |\n|---|---|---|---|")
    for c, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        tops = "; ".join(f"{k} ({t:.2f}, {n})" for t, n, k in sorted(top[c], reverse=True)[:5])
        print(f"| {c} | {ms:.2f} | {ms / busy:.1%} | {tops} |")


if __name__ == "__main__":
    main()
