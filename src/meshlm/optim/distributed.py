"""ZeRO-1 distributed optimizer (Rajbhandari et al. 2020, "ZeRO", §5.1 P_os; Megatron's
``--use-distributed-optimizer``).

Every bucket of the DDP buffers is split into DP × CP equal shards (buckets are padded for
this); rank r owns shard r of every bucket: its fp32 master weights and Adam moments exist only
there. Per step: the DDP reduce-scatters each bucket's gradients into the owners' shards; each
rank updates its shards (the grad norm and inf check are reduced over DP × CP as well); the
updated params are all-gathered bucket by bucket back into every rank's param buffer.

With ``--overlap-param-gather`` the all-gathers start right after the step (in forward order,
last bucket first) and are waited for by forward pre-hooks on the *blocks* of each model chunk
(the embedding, each transformer layer, the final norm, the output layer: ``_blocks``):
a block waits for the buckets of every parameter in it before it runs, so the gathers of later
blocks hide behind the forward of earlier ones. This is safe because the model reads every
parameter only inside the forward of a block that contains it (the position table and the output
layer are modules for that reason; tests/test_parity_matrix.py poisons every pending gather with
NaN to prove it). The hooks run eagerly (``torch._dynamo.disable``) at the boundary of a compiled
layer, never traced into it. Anything that reads params outside a forward (checkpoint save,
export, the end of training) calls ``finish_param_sync()`` first.

``build_optimizer`` picks this class or the plain MixedPrecisionOptimizer from the flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import watchdog
from ..parallel.data import all_gather_flat
from .optimizer import MixedPrecisionOptimizer


def _blocks(chunk: torch.nn.Module) -> list:
    """The chunk's children that run a forward, looking inside containers that have none
    (ModuleDict/ModuleList: the transformer layers)."""
    out = []
    for child in chunk.children():
        if isinstance(child, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            out += _blocks(child)
        else:
            out.append(child)
    return out


class DistributedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose state is sharded over ``ps.dp_cp_group`` (see module doc).

    Requires a DistributedDataParallel built with --use-distributed-optimizer (padded buckets,
    reduce-scatter). Memory per parameter: see ``memory_report``.
    """

    def __init__(self, cfg, ps, chunks, ddp):
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs a DistributedDataParallel built with "
                             "cfg.parallel.use_distributed_optimizer")
        super().__init__(cfg, ps, chunks, ddp)
        self.norm_groups = [ps.mp_group, ddp.group]
        self.expert_norm_groups = []  # experts' shards: EDP × EP = DP × CP, covered by ddp.group
        self.overlap_param_gather = cfg.parallel.overlap_param_gather
        self._pending = {}  # id(bucket) → handle of its param all-gather
        if self.overlap_param_gather:
            for chunk in chunks:
                self._hook_block(chunk, recurse=False)  # parameters a chunk holds itself, if any
                for block in _blocks(chunk):
                    self._hook_block(block, recurse=True)

    def _shard_range(self, buf, bucket) -> tuple:
        return bucket.shard(buf.rank, buf.size)

    def _gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool, buf=None):
        """All-gather each rank's [n] shard into full [n × group size] over ``buf``'s group (the
        DP × CP group by default; in place when shard aliases full)."""
        if async_op:
            return self._start_gather(full, shard, True, buf)
        group = buf.group if buf is not None else self.ddp.group
        watchdog.call("all_gather of the ZeRO-1 params", group, self._start_gather, full, shard, False, buf)

    def _start_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool, buf=None):
        group, size = (buf.group, buf.size) if buf is not None else (self.ddp.group, self.ddp.size)
        single = buf.single_tensor if buf is not None else self.ddp.single_tensor_collectives
        if single:
            return all_gather_flat(full, shard, group=group, async_op=async_op)
        return dist.all_gather(list(full.chunk(size)), shard, group=group, async_op=async_op)

    def _publish(self) -> None:
        """Copy masters into this rank's param shards, then all-gather every bucket's params."""
        super()._publish()
        for s in reversed(self.shards):  # forward order: the first layers' bucket first
            if s.buf.group is None:
                continue
            full = s.buf.param_data[s.bucket.start:s.bucket.end]
            handle = self._gather(full, s.param, async_op=self.overlap_param_gather, buf=s.buf)
            if self.overlap_param_gather:
                self._pending[id(s.bucket)] = handle

    def _hook_block(self, module, recurse: bool) -> None:
        """Make module's forward first wait for the gathers of the buckets of its parameters."""
        buckets = list(dict.fromkeys(id(self.ddp.bucket_of(p)[1]) for p in module.parameters(recurse=recurse)
                                     if p.requires_grad))
        if buckets:
            module.register_forward_pre_hook(torch._dynamo.disable(
                lambda module, args: self._wait_for_buckets(buckets)))

    def _wait_for_buckets(self, buckets: list) -> None:
        """Wait for the parameter all-gathers still pending among ``buckets`` (ids of Buckets)."""
        for b in buckets:
            handle = self._pending.pop(b, None)
            if handle is not None:
                watchdog.call("all_gather of the ZeRO-1 params", self.ddp.group, handle.wait)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for handle in self._pending.values():
            watchdog.call("all_gather of the ZeRO-1 params", self.ddp.group, handle.wait)
        self._pending.clear()


def build_optimizer(cfg, ps, chunks, ddp) -> MixedPrecisionOptimizer:
    """DistributedOptimizer (ZeRO-1) under --use-distributed-optimizer, else MixedPrecisionOptimizer.

    ddp must be the DistributedDataParallel built over the same chunks and cfg.
    """
    if cfg.parallel.use_distributed_optimizer:
        return DistributedOptimizer(cfg, ps, chunks, ddp)
    return MixedPrecisionOptimizer(cfg, ps, chunks, ddp)
