"""How much host (CPU) time does one meshlm training step take, by phase? The planner's host-time
term (issue 29: host-bound steps) is fitted to these figures.

Usage (lent machine, repository root):
    PYTHONPATH=src python bench/host_probe.py --label NAME --steps 12 <meshlm pretrain flags>
Runs the production step (trainer.train_step, the collector as ``train`` sets it: --manual-gc
honoured) step by step with a sync after each, and times on the host, each step:
- fwd: the micro-batches' forwards (pipeline._Executor.forward), bwd: their backwards
  (_Executor.backward: returns when autograd has queued every kernel), opt: the optimizer step
  less its waits in ``Tensor.item`` (the grad norm's sync), rest: the step's other host work
  (zero_grad, losses, logging), host = fwd + bwd + opt + rest = the step less its item() waits;
- wall: the step with the sync after it; gc: ms in Python's collector (gc.callbacks), by generation.
Run with few tokens (e.g. --seq-length 256 --micro-batch-size 1) the GPU is never the bottleneck,
so these are the host's costs of the step's launches, whatever the widths. One JSON line a step,
then a summary line {"label", "median": {...}} (median over the steps after the second).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch


def main() -> None:
    from meshlm.config import add_config_args, config_from_args
    from meshlm.parallel import pipeline
    from meshlm.training import trainer
    from meshlm.training.manual_gc import ManualGC
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--steps", type=int, default=12)
    add_config_args(parser)
    args = parser.parse_args(sys.argv[1:])
    cfg = config_from_args(args)
    cfg.training.train_iters = 1000
    run = trainer.build(cfg)
    state = trainer.TrainState()
    spans = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0, "item": 0.0, "gc0": 0.0, "gc1": 0.0, "gc2": 0.0}
    counts = {"gc0": 0, "gc1": 0, "gc2": 0}

    def timed(key, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[key] += time.perf_counter() - t0
        return wrapper
    pipeline._Executor.forward = timed("fwd", pipeline._Executor.forward)
    pipeline._Executor.backward = timed("bwd", pipeline._Executor.backward)
    run.opt.step = timed("opt", run.opt.step)
    torch.Tensor.item = timed("item", torch.Tensor.item)
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            spans[f"gc{info['generation']}"] += time.perf_counter() - gc_start[0]
            counts[f"gc{info['generation']}"] += 1
    gc.callbacks.append(on_gc)
    t = cfg.training
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows = []
    with ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval).running() as collector:
        for i in range(args.steps):
            for k in spans:
                spans[k] = 0.0
            for k in counts:
                counts[k] = 0
            sync()
            p0 = time.process_time()
            t0 = time.perf_counter()
            trainer.train_step(run, state)
            ret = time.perf_counter() - t0
            sync()
            wall = time.perf_counter() - t0
            collector.after_step(state.iteration)
            opt = spans["opt"] - spans["item"]
            host = ret - spans["item"]
            row = {"label": args.label, "step": i + 1, "wall_ms": wall * 1e3, "host_ms": host * 1e3,
                   "fwd_ms": spans["fwd"] * 1e3, "bwd_ms": spans["bwd"] * 1e3, "opt_ms": opt * 1e3,
                   "rest_ms": (host - spans["fwd"] - spans["bwd"] - opt) * 1e3, "item_ms": spans["item"] * 1e3,
                   "cpu_ms": (time.process_time() - p0) * 1e3,
                   "gc_ms": {g: round(spans[g] * 1e3, 2) for g in ("gc0", "gc1", "gc2")}, "gc_n": dict(counts)}
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    later = rows[2:] or rows
    keys = ("wall_ms", "host_ms", "fwd_ms", "bwd_ms", "opt_ms", "rest_ms", "cpu_ms")
    summary = {"label": args.label, "steps": len(later),
               "median": {k: round(statistics.median(r[k] for r in later), 2) for k in keys},
               "min": {k: round(min(r[k] for r in later), 2) for k in keys},
               "gc_ms_mean": round(statistics.mean(sum(r["gc_ms"].values()) for r in later), 2),
               "params": sum(1 for c in run.chunks for _ in c.parameters()),
               "flags": " ".join(sys.argv[1:])}
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
