"""A parallel layout as the planner sees it: sizes, micro-batch, recompute, optimizer sharding.

``Layout.of(cfg, world)`` reads one from a config, ``layout.apply(cfg)`` writes one into a copy of a
config (so meshlm's own checks and stage partition judge it), ``layout.flags()`` gives the exact
``meshlm pretrain`` flags.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..config import SHARDING, Config, dp_size, zero_stage
from ..model.recompute import Recompute
from ..parallel.pipeline import virtual_size

FULL = Recompute("full", "uniform", 1)  # the planner's full recompute: every layer checkpointed alone
SELECTIVE = Recompute("selective")
NONE = Recompute()


@dataclass(frozen=True)
class Layout:
    """TP × CP × PP × DP ranks (PP with vp virtual stages per rank), EP (the MoE experts split over
    ep of the DP × CP ranks, Megatron's layout: not a factor of the world), the micro-batch
    (samples), recompute (meshlm.model.recompute.Recompute), ZeRO-1 (distributed_optimizer), ZeRO-2/3
    (zero: 2 or 3, --data-parallel-sharding-strategy optim_grads / optim_grads_params; 0 otherwise) and
    sequence parallelism. ``stage`` is the ZeRO stage (0 where DP × CP is 1: nothing to shard)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    recompute: Recompute = field(default=NONE)
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    overlap_grad_reduce: bool = False
    zero: int = 0

    @property
    def stage(self) -> int:
        if self.dp * self.cp == 1:
            return 0
        return max(self.zero, 1 if self.distributed_optimizer else 0)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: those holding the same experts, DP × CP / EP (parallel/mesh.py)."""
        return max(1, self.dp * self.cp // self.ep)

    @property
    def recompute_name(self) -> str:
        r = self.recompute
        if r.granularity != "full":
            return r.granularity or "none"
        return f"full ({r.method} {r.num_layers})"

    @classmethod
    def of(cls, cfg: Config, world: int) -> "Layout":
        p, t = cfg.parallel, cfg.training
        shards = dp_size(cfg, world) * p.context_parallel_size > 1
        return cls(zero=zero_stage(p) if shards and zero_stage(p) >= 2 else 0,tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=max(1, dp_size(cfg, world)),
                   vp=virtual_size(cfg), cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                   micro_batch=t.micro_batch_size, recompute=Recompute.of(t),
                   distributed_optimizer=zero_stage(p) >= 1 and shards,
                   sequence_parallel=p.sequence_parallel, overlap_grad_reduce=p.overlap_grad_reduce)

    def apply(self, cfg: Config) -> Config:
        """A copy of ``cfg`` with this layout (its --nproc-per-node set to the layout's world). The
        global batch stays cfg's --global-batch-size, which the planner sets before it searches. cfg's
        --overlap-param-gather is kept where the layout has ZeRO-1 and dropped where it has not."""
        c = copy.deepcopy(cfg)
        p, t = c.parallel, c.training
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = self.tp, self.pp
        p.context_parallel_size, p.nproc_per_node = self.cp, self.world
        p.expert_model_parallel_size = self.ep
        p.virtual_pipeline_model_parallel_size = self.vp if self.vp > 1 else None
        p.num_layers_per_virtual_pipeline_stage = None
        p.sequence_parallel, p.use_distributed_optimizer = self.sequence_parallel, self.distributed_optimizer
        p.data_parallel_sharding_strategy = [k for k, v in SHARDING.items() if v == self.zero][0] \
            if self.zero >= 2 else "no_shard"
        p.use_torch_fsdp2 = False
        t.micro_batch_size, t.gradient_accumulation_steps = self.micro_batch, None
        t.recompute_activations = False
        t.recompute_granularity, t.recompute_method = self.recompute.granularity, self.recompute.method
        t.recompute_num_layers = self.recompute.num_layers
        p.overlap_grad_reduce = self.overlap_grad_reduce
        # --overlap-param-gather overlaps ZeRO-1's all-gather: a layout without ZeRO-1 has none to overlap
        p.overlap_param_gather = p.overlap_param_gather and self.stage >= 1
        return c

    def flags(self) -> list:
        """The meshlm pretrain flags of this layout (sizes at 1 left out, DP implied by the world)."""
        out = []
        if self.tp > 1:
            out += ["--tensor-model-parallel-size", str(self.tp)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.pp > 1:
            out += ["--pipeline-model-parallel-size", str(self.pp)]
        if self.vp > 1:
            out += ["--virtual-pipeline-model-parallel-size", str(self.vp)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        out += ["--micro-batch-size", str(self.micro_batch)]
        r = self.recompute
        if r.selective:
            out.append("--recompute-activations")
        elif r.granularity == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", r.method,
                    "--recompute-num-layers", str(r.num_layers)]
        if self.zero >= 2:  # ZeRO-2/3 shard over DP × CP as ZeRO-1 does
            out += ["--data-parallel-sharding-strategy", [k for k, v in SHARDING.items() if v == self.zero][0]]
        elif self.distributed_optimizer:  # ZeRO-1 shards over DP × CP (experts: over DP × CP / EP)
            out.append("--use-distributed-optimizer")
        if self.overlap_grad_reduce and self.dp * self.cp > 1:
            out.append("--overlap-grad-reduce")
        return out

    def describe(self) -> str:
        v = f" (v {self.vp})" if self.vp > 1 else ""
        cp = f" × CP {self.cp}" if self.cp > 1 else ""
        ep = f" (EP {self.ep})" if self.ep > 1 else ""
        return f"TP {self.tp}{' SP' if self.sequence_parallel else ''}{cp} × PP {self.pp}{v} × DP {self.dp}{ep}"
