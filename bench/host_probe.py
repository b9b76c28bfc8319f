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
import json
import statistics
import sys
import time

import torch

from host_timing import Spans


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
    spans = Spans("fwd", "bwd", "opt", "item")
    pipeline._Executor.forward = spans.wrap("fwd", pipeline._Executor.forward)
    pipeline._Executor.backward = spans.wrap("bwd", pipeline._Executor.backward)
    run.opt.step = spans.wrap("opt", run.opt.step)
    torch.Tensor.item = spans.wrap("item", torch.Tensor.item)
    t = cfg.training
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows = []
    with ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval).running() as collector:
        for i in range(args.steps):
            spans.reset()
            sync()
            p0 = time.process_time()
            t0 = time.perf_counter()
            trainer.train_step(run, state)
            ret = time.perf_counter() - t0
            sync()
            wall = time.perf_counter() - t0
            collector.after_step(state.iteration)
            sec = spans.seconds
            opt = sec["opt"] - sec["item"]
            host = ret - sec["item"]
            row = {"label": args.label, "step": i + 1, "wall_ms": wall * 1e3, "host_ms": host * 1e3,
                   "fwd_ms": sec["fwd"] * 1e3, "bwd_ms": sec["bwd"] * 1e3, "opt_ms": opt * 1e3,
                   "rest_ms": (host - sec["fwd"] - sec["bwd"] - opt) * 1e3, "item_ms": sec["item"] * 1e3,
                   "cpu_ms": (time.process_time() - p0) * 1e3,
                   "gc_ms": {f"gc{g}": round(spans.gc_seconds.get(g, 0.0) * 1e3, 2) for g in range(3)},
                   "gc_n": {f"gc{g}": spans.gc_counts.get(g, 0) for g in range(3)}}
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
