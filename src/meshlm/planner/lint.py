"""Launch mistakes the planner warns about before a run (``meshlm plan`` and ``pretrain --dry-run``).

A global batch that is not micro × accumulation × DP and --sequence-parallel without TP are already
refused by ``meshlm.validate`` (one-line errors before any worker starts), so they never reach here.
Warned here, because the run would work but badly:
- a TP group spanning nodes: TP's blocking per-layer collectives over the inter-node link;
- PP equal to one node's GPU count for a model that fits at PP = 1 with DP: a pipeline bubble of
  (p − 1)/(v·m + p − 1) of the step for nothing;
- --sequence-parallel off with TP > 1: the norms and dropouts hold s·b·h activations on every TP rank;
- --fp8-format planned for a GPU without FP8 tensor cores (the A100 preset, or a profile calibrated on
  one), where the launch refuses it (``fp8_rules``: compute capability 8.9 or newer).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import Config
from ..parallel.schedules import analytic_bubble_fraction
from .gpus import GPU, GiB
from .layout import Layout
from .memory import estimate


def lint(cfg: Config, world: int, gpus_per_node: int, gpu: GPU, vocab: int) -> list:
    """Warnings (one line each) for cfg's layout on ``world`` GPUs in nodes of ``gpus_per_node``."""
    out = []
    lay = Layout.of(cfg, world)
    if lay.tp > gpus_per_node or gpus_per_node % lay.tp:
        out.append(f"TP group of {lay.tp} spans nodes ({gpus_per_node} GPUs per node): every layer's TP collectives "
                   f"cross the inter-node link; keep --tensor-model-parallel-size ≤ {gpus_per_node} and a divisor of it")
    if lay.tp > 1 and not lay.sequence_parallel:
        out.append(f"TP {lay.tp} without --sequence-parallel: norms and dropout keep full s·b·h activations on "
                   f"every TP rank; add --sequence-parallel")
    if lay.pp > 1 and lay.pp == gpus_per_node and world % (lay.tp * lay.cp) == 0:
        flat = replace(lay, pp=1, vp=1, dp=world // (lay.tp * lay.cp))
        try:
            fits = estimate(cfg, flat, vocab).device_bytes <= gpu.memory_bytes
        except Exception:  # the flat layout is not valid for this model: nothing to suggest
            fits = False
        if fits:
            m = max(1, cfg.training.global_batch_size // (lay.micro_batch * lay.dp)) \
                if cfg.training.global_batch_size else 1
            out.append(f"PP {lay.pp} = one node's GPUs, but the model fits at PP 1 with DP {flat.dp} "
                       f"({estimate(cfg, flat, vocab).device_bytes / GiB:.1f} GiB per GPU): the pipeline bubble costs "
                       f"{100 * analytic_bubble_fraction(lay.pp, m, lay.vp):.0f}% of the step; drop "
                       f"--pipeline-model-parallel-size")
    no_fp8 = (gpu.source == "preset" and gpu.fp8_gemm_speedup <= 1.0) or \
        ("no FP8 tensor cores" in gpu.source and gpu.name != "cpu")  # a CPU emulates FP8; an A100 has none
    if cfg.training.fp8_format and no_fp8:
        out.append(f"--fp8-format on {gpu.name}, which has no FP8 tensor cores: meshlm refuses --fp8-format there "
                   f"(it needs compute capability 8.9 or newer: Ada, Hopper), so this plan cannot launch; drop "
                   f"--fp8-format or plan for another --gpu")
    return out
