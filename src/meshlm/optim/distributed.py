"""The distributed optimizer: ZeRO-1 (Rajbhandari et al. 2020, "ZeRO", §5.1 P_os; Megatron's
``--use-distributed-optimizer``), and the optimizer side of ZeRO-2 and ZeRO-3
(``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``).

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
export) calls ``finish_param_sync()`` first; the end of training ``settle_params()``.

Under ZeRO-2 the shards' gradients are the DDP's reduced ``shard_grad`` tensors (nothing else is
kept, parallel/data.py). Under ZeRO-3 the params are not gathered after the step: the updated
shard is the bucket's ``param_shard`` and optim/param_gather.py gathers each block's buckets when
it runs; ``finish_param_sync()`` makes every bucket whole (for a save, an export) until the next
update frees them; ``settle_params()`` (the end of training) frees them instead.

Under --fp8-param-gather the FP8 buffers' buckets are gathered as their uint8 FP8 copies, cast
from the masters after each update (optim/fp8_gather.py); their params are gathered whole only by
``finish_param_sync``. ``param_gather_bytes`` counts the bytes every param all-gather delivers
(the whole bucket's), {"fp8": …, "params": …}.

``build_optimizer`` picks this class or the plain MixedPrecisionOptimizer from the flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import watchdog
from ..parallel.data import all_gather_flat
from ..parallel.grad_buffer import blocks
from .optimizer import MixedPrecisionOptimizer
from .fp8_gather import Fp8Gather
from .param_gather import ParamGather


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
        # a gradient shard is counted once: over DP × CP, or (hybrid sharding, the optimizer replicated
        # across replicas) over one replica's shard group
        replicated = ps.instances > 1 and cfg.parallel.outer_dp_sharding_strategy == "no_shard"
        self.norm_groups = [ps.mp_group, ps.shard_group if replicated else ddp.group]
        # experts' shards split EDP × EP = DP × CP, covered by ddp.group; when the norm sums over one
        # replica only, first over the replica group (the ranks at this place in every replica)
        self.expert_norm_groups = [ps.replica_group] if replicated else []
        self.overlap_param_gather = cfg.parallel.overlap_param_gather
        self._pending = {}  # id(bucket) → handle of its param all-gather
        self.param_gather = None
        if ddp.stage == 3:  # reshard after forward/backward with one pipeline stage only (param_gather.py)
            reshard = ps.pp == 1 and not cfg.parallel.torch_fsdp2_no_reshard_after_forward
            self.param_gather = ParamGather(chunks, ddp, lambda *a, **k: self._gather(*a, **k),
                                            prefetch=self.overlap_param_gather, reshard=reshard)
        if self.overlap_param_gather:
            for chunk in chunks:
                self._hook_block(chunk, recurse=False)  # parameters a chunk holds itself, if any
                for block in blocks(chunk):
                    self._hook_block(block, recurse=True)
        self.param_gather_bytes = {"fp8": 0, "params": 0}
        self._stale = {}  # id(bucket) → Shard: FP8 buckets whose params are whole only in this rank's shard
        self.fp8 = Fp8Gather(self.shards, ddp, ps.tp_group) if any(b.fp8 for b in ddp.buffers) else None
        self._refresh_fp8()

    def _shard_range(self, buf, bucket) -> tuple:
        lo, hi = bucket.shard(buf.rank, buf.size)
        if not buf.optim_across:
            return lo, hi
        n = (hi - lo) // buf.replica_size  # hybrid, --outer-dp-sharding-strategy optim: a part of the shard
        return lo + buf.replica_rank * n, lo + (buf.replica_rank + 1) * n

    def _gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool, buf=None):
        """All-gather each rank's [n] shard into full [n × group size] over ``buf``'s group (the
        DP × CP group by default; in place when shard aliases full)."""
        if async_op:
            return self._start_gather(full, shard, True, buf)
        group = buf.group if buf is not None else self.ddp.group
        watchdog.call("all_gather of the ZeRO-1 params", group, self._start_gather, full, shard, False, buf)

    def _start_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool, buf=None):
        self.param_gather_bytes["fp8" if full.dtype == torch.uint8 else "params"] += full.numel() * full.element_size()
        group, size = (buf.group, buf.size) if buf is not None else (self.ddp.group, self.ddp.size)
        single = buf.single_tensor if buf is not None else self.ddp.single_tensor_collectives
        if single:
            return all_gather_flat(full, shard, group=group, async_op=async_op)
        return dist.all_gather(list(full.chunk(size)), shard, group=group, async_op=async_op)

    @staticmethod
    def _whole_and_shard(s, fp8: bool) -> tuple:
        """The bucket of shard s, whole, and this rank's shard of it: its params, or its FP8 copy."""
        lo, hi = s.bucket.shard(s.buf.rank, s.buf.size)
        if fp8:
            return s.bucket.param8, s.buf.param8_of(s.bucket, lo, hi)
        return s.bucket.param, s.buf.param_of(s.bucket, lo, hi)

    def _refresh_fp8(self) -> None:
        """Cast the masters into the FP8 copies and all-gather them (not under ZeRO-3, which gathers
        per block), waiting: at the start and after the masters are reloaded."""
        if self.fp8 is None:
            return
        self.fp8.cast()
        for s in self.shards:
            if s.buf.fp8 and s.buf.group is not None and not s.buf.sharded_params:
                self._gather(*self._whole_and_shard(s, True), async_op=False, buf=s.buf)

    def _publish(self) -> None:
        """Copy masters into this rank's param shards, then all-gather every bucket's params (the
        FP8 buffers' FP8 copies, cast first; ZeRO-3: free them instead; each block gathers its own
        when it next runs)."""
        super()._publish()
        if self.param_gather is not None:
            self.param_gather.free_all()
        for s in self.shards:  # hybrid, optimizer split across replicas: rebuild each whole shard
            if s.buf.optim_across:
                shard = s.buf.param_of(s.bucket, *s.bucket.shard(s.buf.rank, s.buf.size))
                watchdog.call("all_gather of a param shard across replicas", s.buf.replica, all_gather_flat,
                              shard, s.param.clone(), group=s.buf.replica)
        if self.fp8 is not None:
            self.fp8.cast()
        for s in reversed(self.shards):  # forward order: the first layers' bucket first
            if s.buf.group is None or s.buf.sharded_params:
                continue
            if s.buf.fp8:
                self._stale[id(s.bucket)] = s
            handle = self._gather(*self._whole_and_shard(s, s.buf.fp8), async_op=self.overlap_param_gather, buf=s.buf)
            if self.overlap_param_gather:
                self._pending[id(s.bucket)] = handle

    def _hook_block(self, module, recurse: bool) -> None:
        """Make module's forward first wait for the gathers of the buckets of its parameters."""
        buckets = list(dict.fromkeys(id(bucket) for p in module.parameters(recurse=recurse) if p.requires_grad
                                     for buf, bucket in [self.ddp.bucket_of(p)] if not buf.sharded_params))
        if buckets:
            module.register_forward_pre_hook(torch._dynamo.disable(
                lambda module, args: self._wait_for_buckets(buckets)))

    def _wait_for_buckets(self, buckets: list) -> None:
        """Wait for the parameter all-gathers still pending among ``buckets`` (ids of Buckets)."""
        for b in buckets:
            handle = self._pending.pop(b, None)
            if handle is not None:
                watchdog.call("all_gather of the ZeRO-1 params", self.ddp.group, handle.wait)

    def _wait_all(self) -> None:
        for handle in self._pending.values():
            watchdog.call("all_gather of the ZeRO-1 params", self.ddp.group, handle.wait)
        self._pending.clear()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight; all-gather the params of the FP8
        buckets (--fp8-param-gather gathers their FP8 copies only); under ZeRO-3 make every bucket
        whole (collective over DP × CP: every rank calls it)."""
        self._wait_all()
        for s in self._stale.values():
            self._gather(*self._whole_and_shard(s, False), async_op=False, buf=s.buf)
        self._stale.clear()
        if self.param_gather is not None:
            self.param_gather.gather_all()

    def settle_params(self) -> None:
        """As the base class; under ZeRO-3 wait for the gathers in flight and free every bucket, so
        that the end of training never holds the whole model (only a save or export gathers it)."""
        if self.param_gather is None:
            self.finish_param_sync()
        else:
            self._before_step()

    def _before_step(self) -> None:
        """ZeRO-3 reads no whole bucket in the step: wait for gathers in flight, free the rest."""
        if self.param_gather is None:
            self._wait_all()
        else:
            self.param_gather.free_all()

    def reload_model_params(self, from_whole: bool = True) -> None:
        """As the base class, after copying the whole (loaded) params into the ZeRO-3 shards; a
        checkpoint loads ZeRO-3's shards themselves (``from_whole`` False), which gathers nothing."""
        if from_whole:
            self.finish_param_sync()
            for s in self.shards:
                if s.buf.sharded_params:
                    s.param.copy_(s.bucket.param[s.bucket.local(s.start, s.end)])
        super().reload_model_params()
        if self.param_gather is not None:
            self.param_gather.free_all()
        self._refresh_fp8()


def build_optimizer(cfg, ps, chunks, ddp) -> MixedPrecisionOptimizer:
    """DistributedOptimizer at ZeRO stage ≥ 1 (--use-distributed-optimizer or
    --data-parallel-sharding-strategy), else MixedPrecisionOptimizer.

    ddp must be the DistributedDataParallel built over the same chunks and cfg.
    """
    if ddp.use_distributed_optimizer:
        return DistributedOptimizer(cfg, ps, chunks, ddp)
    return MixedPrecisionOptimizer(cfg, ps, chunks, ddp)
