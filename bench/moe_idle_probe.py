"""Why does an EP = 1 MoE step's GPU idle grow as the learned router's load becomes uneven (issue 29/31)?

Usage (lent machine, repository root):
    PYTHONPATH=src python bench/moe_idle_probe.py --gmm
    PYTHONPATH=src python bench/moe_idle_probe.py --steps 14 <meshlm pretrain flags>
--gmm: torch._grouped_mm forward + backward at one MoE layer's shape (8,192 rows, h 1,024, 16 experts of
f 3,584, SwiGLU) with even and skewed group sizes: GPU ms (events) and host ms a call (no sync), and
the syncs it makes (set_sync_debug_mode). Otherwise: the production step (trainer.train_step) step by
step with a sync after each: wall ms, host ms until train_step returned, routing imbalance (max / mean
routes, the layers' mean), dynamo's graph count; then one early and one late step under the profiler
with host ops: the CUDA runtime calls and the host ops by self time, and one step's syncs.
Each step's line also gives the time Python's garbage collector ran inside it, by generation
(gc.callbacks); with --manual-gc the loop runs under the trainer's collector schedule
(training/manual_gc.py), so the two runs tell whether the collector is the drift.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from host_timing import Rusage, Spans, canary


def gmm(rows: int = 8192, h: int = 1024, f: int = 3584, experts: int = 16) -> None:
    dev = torch.device("cuda")
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(experts, 2 * f, h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(experts, h, f, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    mean = rows // experts
    shapes = {"even": [mean] * experts}
    for top in (2, 4, 8):  # one expert top × the mean, the others share the rest evenly
        rest = rows - top * mean
        shapes[f"max/mean {top}"] = [top * mean] + [rest // (experts - 1)] * (experts - 2) + [
            rest - (rest // (experts - 1)) * (experts - 2)]
    shapes["all on one"] = [rows] + [0] * (experts - 1)
    for name, sizes in shapes.items():
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)

        def step():
            y = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
            gate, up = y.chunk(2, dim=-1)
            z = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
            z.float().square().mean().backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        n = 20
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 0.0
        a.record()
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            host += time.perf_counter() - t0
        b.record()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(f"gmm {name:12s} GPU {a.elapsed_time(b) / n:7.3f} ms  host {host / n * 1e3:7.3f} ms a call  "
              f"syncs {sum('synchroniz' in str(w.message) for w in caught)}", flush=True)


def profiled(run, state, train_step, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        train_step(run, state)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    ev = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
    print(f"\n[{label}] profiled step {wall:.1f} ms wall, GPU kernels {busy:.1f} ms", flush=True)
    rt = sorted((e for e in ev if e.key.startswith("cuda") or e.key.startswith("cu")),
                key=lambda e: -e.self_cpu_time_total)[:12]
    print("  runtime calls (self CPU ms, count): " + "; ".join(
        f"{e.key} {e.self_cpu_time_total / 1e3:.2f} ({e.count})" for e in rt))
    ops = sorted((e for e in ev if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:20]
    print("  host ops by self CPU ms (count): " + "; ".join(
        f"{e.key[:60]} {e.self_cpu_time_total / 1e3:.2f} ({e.count})" for e in ops))
    tot = sorted((e for e in ev if e.device_type.name == "CPU"), key=lambda e: -e.cpu_time_total)[:20]
    print("  host ops by total CPU ms (count): " + "; ".join(
        f"{e.key[:60]} {e.cpu_time_total / 1e3:.2f} ({e.count})" for e in tot), flush=True)


def main() -> None:
    if "--gmm" in sys.argv:
        gmm()
        return
    from meshlm.config import add_config_args, config_from_args
    from meshlm.training.trainer import TrainState, build, train_step
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    add_config_args(parser)
    args = parser.parse_args(sys.argv[1:])
    cfg = config_from_args(args)
    cfg.training.train_iters, cfg.training.log_interval = 1000, 1000
    run = build(cfg)
    state = TrainState()
    from meshlm.training import trainer
    spans = Spans("fb", "opt", "item")
    trainer.forward_backward = spans.wrap("fb", trainer.forward_backward)
    run.opt.step = spans.wrap("opt", run.opt.step)
    torch.Tensor.item = spans.wrap("item", torch.Tensor.item)
    from meshlm.training.manual_gc import ManualGC
    t = cfg.training
    collector = ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)
    with collector.running():
        steps(args, run, state, cfg, spans, collector)
    profiled(run, state, train_step, "late")
    from profile_step import syncs  # bench/profile_step.py: one step's host syncs, by Python line
    syncs(run, state)


def steps(args, run, state, cfg, spans, collector) -> None:
    import os
    from torch._dynamo.utils import counters
    from meshlm.model.moe import routing_stats, routing_summary
    from meshlm.training.trainer import train_step
    usage = Rusage()
    for i in range(args.steps):
        spans.reset()
        usage.delta()
        sec = spans.seconds
        c0, p0 = time.thread_time(), time.process_time()
        if i == 3:
            profiled(run, state, train_step, "early")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(run, state)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        used = usage.delta()
        probe = canary(torch.device("cuda"))
        s = routing_summary(routing_stats(run.chunks, run.ps, cfg.model), 1)
        print(f"step {i + 1}: wall {wall * 1e3:8.1f} ms host {host * 1e3:8.1f} ms imbalance "
              f"{s['moe_tokens_per_expert']['imbalance']:.2f} graphs {counters['stats'].get('unique_graphs')} "
              f"recompiles {len(counters.get('recompiles', {}))} | main-thread CPU {(time.thread_time() - c0) * 1e3:.1f} ms "
              f"process CPU {(time.process_time() - p0) * 1e3:.1f} ms; fwd-bwd {sec['fb'] * 1e3:.1f}, optimizer "
              f"{sec['opt'] * 1e3:.1f} of which item() {sec['item'] * 1e3:.1f} ms; load {os.getloadavg()[0]:.1f}"
              f"; gc " + (", ".join(f"gen{g} {n}× {s * 1e3:.1f} ms" for g, (n, s) in sorted(
                  (g, (spans.gc_counts[g], spans.gc_seconds[g])) for g in spans.gc_counts))
                         or "none") + f"; {used}; canary " + ", ".join(f"{k} {v:.2f}" for k, v in probe.items())
              + " ms", flush=True)
        collector.after_step(i + 1)


if __name__ == "__main__":
    main()
