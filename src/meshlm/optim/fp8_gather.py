"""--fp8-param-gather (Megatron's flag): the FP8 layers' weights kept and all-gathered in FP8.

Without it each FP8 GEMM casts its weight itself, after ZeRO has all-gathered the weight in the
params' dtype (parallel/fp8.py). With it the distributed optimizer casts once a step, from the fp32
master, and the all-gather moves the cast bytes (one an element instead of two), as Megatron does.
To stay exact, the cast of a shard must equal the cast of the whole weight:

1. a weight's tensorwise scale comes from the amax of the *whole* weight: each rank takes the amax
   of its master shard's part of the weight (``torch._foreach_norm`` with p = ∞, one kernel for all
   fragments), max-reduced over the shard group (the buffer's DP × CP group) and over TP (every
   FP8 weight is split over TP: column- or row-parallel), one all-reduce of a [weights] vector per
   FP8 buffer and group; scale = 448 / amax / 2^margin (parallel/fp8.py's ``scale_of``, E4M3, the
   forward format of both --fp8-format choices), in the master's dtype, written into each weight's
   ``fp8_scale``;
2. each fragment of the master is cast with that scale into the bucket's uint8 copy
   (``Bucket.param8``, parallel/data.py): the cast is elementwise given the scale, so the gathered
   bytes are the cast of the whole weight, the same bytes one process casting its own master gets;
3. the distributed optimizer all-gathers ``param8`` instead of the params (ZeRO-1/2, right after
   the step), and under ZeRO-3 optim/param_gather.py gathers ``param8`` per block (prefetch and
   the tests' NaN-poisoning kept: 0x7F is NaN in E4M3 and E5M2);
4. the GEMMs take (``fp8_data``, ``fp8_scale``) as they are, forward and backward.

The params themselves (bf16) stay the model's weights for everything else: the optimizer still
copies its master into the rank's param shard each step, and ``finish_param_sync`` all-gathers the
FP8 buffers' params whole before a checkpoint, an export or the end of training (the rest of a
step never reads them). The master is cast once, not rounded to bf16 first: with the flag an FP8
weight is the cast of the fp32 master, without it of the bf16 param (tests compare with one
process running the flag too; in float64 the two coincide).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dtypes import wide
from ..parallel import watchdog
from ..parallel.fp8 import E4M3, quantize, scale_of


class Fp8Gather:
    """Casts this rank's master shards of every FP8 buffer into the buffers' uint8 copies (module doc).

    shards: the optimizer's Shards; ddp: the DistributedDataParallel; tp_group: ps.tp_group.
    """

    def __init__(self, shards: list, ddp, tp_group):
        self.tp_group = tp_group
        # (buf, margin, pieces: [(shard, fragment, uint8 [n] destination)], each piece's weight index: list, tensor)
        self.buffers = []
        for buf in ddp.buffers:
            if not buf.fp8:
                continue
            where = {p: i for i, p in enumerate(buf.params)}
            pieces = [(s, f, buf.param8_of(s.bucket, s.start + f.lo, s.start + f.hi))
                      for s in shards if s.buf is buf for f in s.fragments]
            order = [where[f.param] for _, f, _ in pieces]
            index = torch.tensor(order, dtype=torch.long, device=buf.device)
            self.buffers.append((buf, buf.params[0].fp8_gather.margin, pieces, order, index))

    def cast(self) -> None:
        """Steps 1–2 of the module doc for every FP8 buffer. Collective over each buffer's group and
        TP: every rank calls it after each update of its masters."""
        for buf, margin, pieces, order, index in self.buffers:
            amax = torch.zeros(len(buf.params), dtype=wide(buf.params[0].dtype), device=buf.device)
            masters = [s.master[f.lo:f.hi] for s, f, _ in pieces]
            if masters:
                amax[index] = torch.stack(torch._foreach_norm(masters, float("inf"))).to(amax.dtype)
            for group in (buf.group, self.tp_group):
                if group is not None:
                    watchdog.call("all_reduce of the FP8 weights' amax", group, dist.all_reduce, amax,
                                  op=dist.ReduceOp.MAX, group=group)
            scales = scale_of(amax, E4M3, margin)
            torch._foreach_copy_([p.fp8_scale for p in buf.params], list(scales.unbind()))
            for master, (_, _, out), i in zip(masters, pieces, order):
                out.copy_(quantize(master, scales[i], E4M3).view(torch.uint8))
