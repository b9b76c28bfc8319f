"""What does one micro-batch's forward keep for backward? The activation bytes the planner's memory
model counts (planner/memory.py ``layer_terms``, ``moe_cp.moe_mlp_terms``), measured on the production
step, so that a term that is wrong is named, not guessed (issue 29: the FP8 GPT-2.7B and the 32-expert
MoE peaks were over-predicted by 8%).

Usage (lent machine, repository root; one micro-batch, e.g. --global-batch-size = --micro-batch-size):
    PYTHONPATH=src python bench/saved_bytes.py <meshlm pretrain flags>

Runs two training steps (the first compiles), and during the second step's forward records every
tensor that autograd saves (``torch.autograd.graph.saved_tensors_hooks``: compiled graphs save theirs
through the same hook), each storage once, parameters and their flat buffers left out. Prints one JSON
line: the device bytes allocated after the forward less before it (``held_bytes``: what the backward
starts with, the loss buffers included), the saved bytes, and the saved tensors grouped by (dtype, shape)
with their count, largest first, and the planner's per-layer terms for the same flags.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch


def main() -> None:
    from meshlm.config import add_config_args, config_from_args
    from meshlm.parallel import pipeline
    from meshlm.planner.layout import Layout
    from meshlm.planner.memory import estimate
    from meshlm.training import trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(sys.argv[1:]))
    cfg.training.train_iters = 1000
    run = trainer.build(cfg)
    state = trainer.TrainState()
    trainer.train_step(run, state)
    params = {p.untyped_storage().data_ptr() for c in run.chunks for p in c.parameters()}
    seen, groups = set(), Counter()
    record = {"on": False, "before": 0, "after": 0}

    def pack(t):
        if record["on"] and isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                groups[(str(t.dtype), tuple(t.shape))] += t.untyped_storage().nbytes()
        return t

    forward = pipeline._Executor.forward

    def traced(self, a):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        record.update(on=True, before=torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(self, a)
        sync()
        record.update(on=False, after=torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)

    pipeline._Executor.forward = traced
    trainer.train_step(run, state)
    lay = Layout.of(cfg, 1)
    mem = estimate(cfg, lay, cfg.model.vocab_size)
    print("SAVED " + json.dumps({
        "held_bytes": record["after"] - record["before"], "saved_bytes": sum(groups.values()),
        "planner": {"activations": mem.activations, "per_layer": mem.activations_per_layer, "loss": mem.loss},
        "tensors": [[d, list(s), n] for (d, s), n in groups.most_common(40)]}), flush=True)


if __name__ == "__main__":
    main()
