"""Where does one meshlm training step spend its GPU time? Profiles the production step
(trainer.train_step) of any `meshlm pretrain` flags on one GPU and groups the CUDA kernels.

Usage (lent machine, repository root):
    PYTHONPATH=src python bench/profile_step.py --model llama-1b ... --mock-data --bf16
Prints ms per step (wall, median of 5 after warm-up), GPU-busy ms, and a table of kernel
categories (GEMM, attention, compiled Triton kernels, optimizer, copies, other) with the top
kernels; writes a Chrome trace to $OUT/step_trace.json when OUT is set.

--gaps: also where the GPU idles when steps run back to back as the trainer runs them (no sync
between steps but the trainer's own; --log-interval as given, 1 as bench/moe_bench.py runs):
the wall ms a step over --gap-steps steps, and from a CUDA-only trace (kernels, copies and fills
alone, so the profiler adds no host work) the idle ms a step and the largest gaps, each with the
kernels before and after it and its time from the window's start. With OUT set, one step is
also traced with the host's ops to $OUT/gaps_trace.json.gz.
--kernels N: also the N kernels of most GPU time, each with its ms and calls a step.
--syncs: one step under torch.cuda.set_sync_debug_mode("warn"), each synchronizing call listed
by the Python line that made it.
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
    parser.add_argument("--gaps", action="store_true", help="also the GPU's idle gaps (module doc)")
    parser.add_argument("--gap-steps", type=int, default=6)
    parser.add_argument("--syncs", action="store_true", help="list the host syncs of one step (module doc)")
    parser.add_argument("--kernels", type=int, default=0, help="list the N kernels of most GPU time")
    add_config_args(parser)
    args = parser.parse_args(sys.argv[1:])
    cfg = config_from_args(args)
    cfg.training.train_iters = 1000
    if not args.gaps:
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
    if args.kernels:
        print(f"\nthe {args.kernels} kernels of most GPU time (ms/step, calls/step, name):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.kernels]:
            print(f"  {e.self_device_time_total / 2e3:8.3f} {e.count // 2:5d}  {e.key[:140]}")
    if args.gaps:
        gaps(run, state, args.gap_steps)
    if args.syncs:
        syncs(run, state)


def syncs(run, state) -> None:
    """Print the host syncs of one training step, by the Python line that made each."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(run, state)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    lines = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:80]}" for w in caught
             if "synchroniz" in str(w.message)]
    print(f"\nhost syncs in one step: {len(lines)}")
    for line in lines:
        print("  " + line)


def _kernels(prof) -> list:
    """[(start µs, end µs, name)] of the GPU's kernels, copies and fills in a profile, by start."""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def gaps(run, state, steps: int) -> None:
    """Print the wall ms a step back to back, the GPU's idle ms a step and its largest gaps (module doc)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(run, state)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step(run, state)
        torch.cuda.synchronize()
    ks = _kernels(prof)
    t0, end, found = ks[0][0], ks[0][1], []
    prev = ks[0][2]
    for s, e, name in ks[1:]:
        if s - end > 5:
            found.append((s - end, s - t0, prev, name))
        if e > end:
            end, prev = e, name
    span = (end - t0) / 1e3 / steps
    idle = sum(g for g, *_ in found) / 1e3 / steps
    print(f"\nback to back: {wall:.1f} ms a step wall; CUDA-only trace: span {span:.1f} ms a step, "
          f"GPU idle {idle:.2f} ms a step in gaps > 5 µs ({len(found) / steps:.0f} a step)")
    small = sum(g for g, *_ in found if g < 50) / 1e3 / steps
    print(f"gaps < 50 µs: {small:.2f} ms a step; the 25 largest (ms, at ms, after → before):")
    for g, at, a, b in sorted(found, reverse=True)[:25]:
        print(f"  {g / 1e3:7.3f} at {at / 1e3:8.1f}  {a[:60]} → {b[:60]}")
    if os.environ.get("OUT"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step(run, state)
            torch.cuda.synchronize()
        import gzip
        import shutil
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as src, gzip.open(os.path.join(os.environ["OUT"], "gaps_trace.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)


if __name__ == "__main__":
    main()
