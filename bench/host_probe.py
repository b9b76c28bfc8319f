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
then a summary line {"label", "median": {...}} (median over the steps after the second), with
``launch_us`` (``host.launch_seconds`` in this process before the first step: this host's speed)
and ``model_ms``: the planner's host terms for the same flags on the H200 preset (host_scale 1,
``StepTime.phases`` of the deferred loop: fwd = Σ F_j, bwd = Σ B_j, opt = O, rest = B), so that a
term's refit is measured / model × ``host.REFERENCE_LAUNCH_S`` / launch.
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
    from meshlm.planner.host import launch_seconds
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
    launch = launch_seconds("cuda" if torch.cuda.is_available() else "cpu")
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
               "launch_us": round(launch * 1e6, 3), "model_ms": model_ms(_pretrain_flags(sys.argv[1:])),
               "flags": " ".join(sys.argv[1:])}
    print("SUMMARY " + json.dumps(summary), flush=True)


def _pretrain_flags(argv: list) -> list:
    """argv without this script's own --label and --steps (each with its value)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a in ("--label", "--steps"):
            skip = True
        else:
            out.append(a)
    return out


def model_ms(flags: list) -> dict:
    """The planner's host ms of a step of ``meshlm pretrain FLAGS`` on one H200 (module doc): fwd,
    bwd, opt, rest (the deferred loop's phases: [(B, U), (F_1, f_1), (B_1, b_1), …, (O, T)])."""
    from runs import predict
    phases = predict(flags, 1)["time"]["phases"]
    mbs = phases[1:-1]
    return {"fwd": round(1e3 * sum(h for h, _ in mbs[0::2]), 2), "bwd": round(1e3 * sum(h for h, _ in mbs[1::2]), 2),
            "opt": round(1e3 * phases[-1][0], 2), "rest": round(1e3 * phases[0][0], 2)}


if __name__ == "__main__":
    main()
