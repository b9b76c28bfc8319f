"""Enumerate the layouts of a model on a cluster, keep those that fit, rank them by step time.

Searched: TP ∈ powers of two dividing the world, CP ∈ powers of two dividing the rest for a long sequence (≥ ``LONG_SEQUENCE`` tokens,
but not for an FP8 MoE model, which meshlm refuses with CP; else 1), PP ∈ divisors of the world / (TP × CP), v ∈
{1, 2, 4} (PP > 1), DP the rest, EP ∈ powers of two dividing both the experts and DP × CP for an MoE
model (else 1), micro-batch ∈ powers of two dividing the global batch / DP, recompute none /
selective / full (uniform, 1 layer), the distributed optimizer when DP × CP > 1; SP on whenever
TP > 1 and --overlap-grad-reduce whenever DP × CP > 1 (both cost nothing in memory and only help).
The global batch is the flags' (kept fixed).

A layout is excluded, with its reason, when meshlm's own checks refuse it (``validate``: heads, query
groups, MLP width, vocabulary and layers not divisible, interleaving's micro-batch rule, the global
batch not divisible by micro × DP), when its TP group would cross a node (TP's blocking per-layer
collectives over the inter-node link), or when no variant of it fits in the GPU's memory
(``memory.Memory.device_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config import Config, moe_layer_pattern
from ..errors import ConfigError
from ..parallel import layout_rules
from .cost import StepTime, step_time
from .gpus import GPU, GiB
from .layout import FULL, NONE, SELECTIVE, Layout
from .memory import Memory, estimate

LONG_SEQUENCE = 8192  # tokens from which CP is searched (Megatron-Core's CP docs: long-context training)


@dataclass
class Candidate:
    """A layout that fits, with its memory and step time."""

    layout: Layout
    memory: Memory
    time: StepTime

    def to_json(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
                "micro_batch": lay.micro_batch,
                "recompute": lay.recompute_name, "distributed_optimizer": lay.distributed_optimizer,
                "sequence_parallel": lay.sequence_parallel, "flags": " ".join(lay.flags()),
                "memory": self.memory.to_json(), "time": self.time.to_json()}


def _powers(limit: int) -> list:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _divisors(n: int) -> list:
    """Every divisor of n ≥ 1, ascending, in O(√n) steps (a scan to n hung at --num-gpus 10**12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layout_problems(cfg: Config, layout: Layout, gpus_per_node: int) -> list:
    """Why meshlm would refuse ``layout`` for cfg (validate's one-line messages), plus a TP group
    that crosses a node; empty when it can run."""
    problems = []
    if layout.tp > gpus_per_node or gpus_per_node % layout.tp:
        problems.append(f"TP group of {layout.tp} crosses a node ({gpus_per_node} GPUs per node): TP's blocking "
                        f"per-layer collectives would run over the inter-node link; keep TP a divisor of {gpus_per_node}")
    try:
        applied = layout.apply(cfg)
        problems += layout_rules.layout_problems(applied, layout.world)
        problems += layout_rules.moe_problems(applied, layout.world)
    except ConfigError as e:
        problems += e.problems
    return problems


def evaluate(cfg: Config, layout: Layout, gpu: GPU, vocab: int, gpus_per_node: int, half: bool = True) -> Candidate:
    """Memory and step time of one (valid) layout."""
    mem = estimate(cfg, layout, vocab, half=half)
    return Candidate(layout, mem, step_time(cfg, layout, gpu, vocab, gpus_per_node=gpus_per_node,
                                            params_per_rank=mem.params, expert_params_per_rank=mem.expert_params,
                                            half=half))


def bases(cfg: Config, world: int) -> list:
    """The (TP, CP, PP, v, EP) layouts searched (module doc), DP the rest, SP on whenever TP > 1;
    each of exactly ``world`` GPUs (a TP that does not divide it used fewer: TP 8 × DP 1 of 12)."""
    m = cfg.model
    moe = any(moe_layer_pattern(m))
    out, divisors = [], _divisors(world)
    for tp in [t for t in _powers(world) if world % t == 0]:
        cps = [cp for cp in _powers(world // tp) if (world // tp) % cp == 0 and m.seq_length % (2 * cp) == 0] \
            if m.seq_length >= LONG_SEQUENCE and not (moe and cfg.training.fp8_format) else [1]
        for cp in cps:
            rest = world // (tp * cp)
            for pp in [d for d in divisors if d <= rest and rest % d == 0]:
                dp = rest // pp
                eps = [e for e in _powers(dp * cp) if (dp * cp) % e == 0 and m.num_experts % e == 0] if moe else [1]
                for vp in ([1, 2, 4] if pp > 1 else [1]):
                    if vp > 1 and (m.num_layers % (pp * vp)):
                        continue  # not worth a line: the same (tp, pp) at v = 1 is reported
                    out += [Layout(tp=tp, cp=cp, pp=pp, dp=dp, vp=vp, ep=ep, sequence_parallel=tp > 1,
                                   overlap_grad_reduce=dp * cp > 1) for ep in eps]
    return out


def search(cfg: Config, world: int, gpu: GPU, vocab: int, *, gpus_per_node: int, half: bool = True) -> tuple:
    """(candidates that fit, fastest first; excluded as [{"layout", "reason"}], with "needs_bytes", the
    smallest variant's device bytes, where the layout is valid but does not fit) for cfg's model and
    --global-batch-size on ``world`` GPUs of ``gpu`` in nodes of ``gpus_per_node``."""
    gb = cfg.training.global_batch_size
    fits, excluded = [], []
    for base in bases(cfg, world):
        dp = base.dp
        micros = [b for b in _powers(gb // dp)] or [1]
        valid, first = [], None
        for b in micros:
            lay = replace(base, micro_batch=b)
            problems = layout_problems(cfg, lay, gpus_per_node)
            if problems:
                first = first or problems
            else:
                valid.append(lay)
        if not valid:
            excluded.append({"layout": base.describe(), "reason": (first or ["no micro-batch divides "
                             f"the global batch {gb} / DP {dp}"])[0]})
            continue
        found, smallest = False, None
        for lay in valid:
            for r in (NONE, SELECTIVE, FULL):
                for zero in ([0, 1, 2, 3] if dp * base.cp > 1 else [0]):
                    cand = replace(lay, recompute=r, distributed_optimizer=zero >= 1, zero=zero if zero >= 2 else 0)
                    mem = estimate(cfg, cand, vocab, half=half)
                    if mem.device_bytes <= gpu.memory_bytes:
                        fits.append(evaluate(cfg, cand, gpu, vocab, gpus_per_node, half))
                        found = True
                    elif smallest is None or mem.device_bytes < smallest[1].device_bytes:
                        smallest = (cand, mem)
        if not found and smallest:
            cand, mem = smallest
            excluded.append({"layout": base.describe(), "reason": (
                f"does not fit: even micro-batch {cand.micro_batch}, {cand.recompute_name} recompute"
                f"{f', ZeRO-{cand.stage}' if cand.stage else ''} needs "
                f"{mem.device_bytes / GiB:.1f} GiB > {gpu.memory_bytes / GiB:.1f} GiB of {gpu.name}"),
                "needs_bytes": mem.device_bytes})
    fits.sort(key=lambda c: (c.time.total, c.memory.device_bytes))
    return fits, excluded
