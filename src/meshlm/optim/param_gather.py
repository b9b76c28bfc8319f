"""ZeRO-3 parameter gathering (Rajbhandari et al. 2020, §5.3 P_os+g+p; Megatron's
``--data-parallel-sharding-strategy optim_grads_params``): each rank keeps 1/DP of every bucket's
parameters (``Bucket.param_shard``, parallel/data.py); the whole bucket exists only while a
*block* that reads it runs.

The blocks are those of ZeRO-1's overlapped gather (``parallel.grad_buffer.blocks``: the embedding,
each transformer layer, the final norm, the output layer), and under ZeRO-3 no bucket spans two
of them, so a block gathers whole buckets of its own (plus the tied word embedding for the output
layer on one stage). Per block k of a chunk, with one pipeline stage:

- forward: a pre-hook makes k's buckets whole (waits for their gather, or gathers now) and,
  under ``--overlap-param-gather``, starts the gather of block k + 1 (prefetch); a post-hook frees
  k's buckets and hooks k's output so that its backward finds them again;
- backward: when the gradient of k's output arrives (before k's backward runs) the buckets of the
  blocks after k are freed, k's are made whole and k − 1's gather starts; the end of the chunk's
  backward frees what is left. A forward re-run inside backward (full recompute) gathers and
  frees nothing it did not find.

So at most two blocks are whole at a time: the gathered working set is
max over k of bytes(buckets of block k ∪ block k + 1), each bucket padded to 64 × DP elements
(``working_set_bytes``; tests/test_zero_memory.py checks it against what ranks hold).

With pipeline parallelism (``reshard`` False) the gathered buckets stay whole from their first
use in a step to the optimizer's update, across every micro-batch of every chunk: under 1F1B a
chunk's forwards and backwards of different micro-batches interleave, and regathering each time
would multiply the all-gather volume by 2 × micro-batches (torchtitan keeps them gathered too,
reshard_after_forward=False). ZeRO-3 under PP then saves weight memory between steps, and
gradients and optimizer state always. ``--torch-fsdp2-no-reshard-after-forward`` (Megatron's flag)
asks for the same with one stage: one all-gather per bucket a step instead of 2 × micro-batches,
for a working set of every bucket of the rank's chunks (``working_set_bytes``).

Every gather goes through the optimizer's ``_gather`` (tests poison the asynchronous ones with
NaN until waited for), over the bucket's buffer group (DP × CP; expert-DP for MoE experts). All
ranks of a group run the same blocks in the same order, so their collectives match.

Under --fp8-param-gather a bucket of an FP8 buffer is gathered as its uint8 FP8 copy
(``param8`` from ``param8_shard``: one byte an element, optim/fp8_gather.py), which is all its
block's GEMMs read; ``gather_all`` gathers its params too (a save reads them), and freeing frees both.
"""

from __future__ import annotations

import torch

from ..parallel import comm, watchdog
from ..parallel.grad_buffer import block_params, blocks, restore_storage

FREED, PENDING, WHOLE = "freed", "pending", "whole"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParamGather:
    """Gathers and frees the ZeRO-3 buckets of ``chunks`` around each block (see module doc).

    ddp: the DistributedDataParallel (``bucket_of``); gather(full, shard, async_op, buf=): the
    optimizer's all-gather; prefetch: start the next block's gather early (--overlap-param-gather);
    reshard: free after each forward and backward (one pipeline stage), else keep until ``free_all``.
    ``gathered_bytes`` / ``peak_bytes``: bytes of whole buckets now / the most since ``reset_peak``;
    ``gathers``: all-gathers started since then (2 × micro-batches per bucket a step with reshard).
    """

    def __init__(self, chunks, ddp, gather, *, prefetch: bool, reshard: bool):
        self.gather, self.prefetch, self.reshard = gather, prefetch, reshard
        self.state, self.handles = {}, {}  # id(bucket) → FREED/PENDING/WHOLE; → handle while PENDING
        self.buckets = {}  # id(bucket) → (buf, bucket), sharded ones only
        self.params_whole = set()  # FP8 buffers' buckets whose params gather_all made whole too
        self.gathered_bytes = self.peak_bytes = self.gathers = 0
        self.chunk_blocks = []  # per chunk: [[id(bucket)] of each block]
        for chunk in chunks:
            per_block = []
            for block in blocks(chunk):
                ids = []
                for p in block_params(chunk, block):
                    buf, bucket = ddp.bucket_of(p)
                    if buf.sharded_params and id(bucket) not in ids:
                        ids.append(id(bucket))
                        self.buckets[id(bucket)] = (buf, bucket)
                        self.state[id(bucket)] = FREED
                per_block.append(ids)
            order = [k for k, ids in enumerate(per_block) if ids]
            for k, block in enumerate(blocks(chunk)):
                if per_block[k]:
                    nxt = order[order.index(k) + 1] if order.index(k) + 1 < len(order) else None
                    prv = order[order.index(k) - 1] if order.index(k) > 0 else None
                    self._hook(block, per_block, k, nxt, prv)
            chunk.register_forward_hook(self._arm_end)
            self.chunk_blocks.append(per_block)

    # ------------------------------------------------------------------ one bucket
    def _gathered(self, b: int, params: bool = False) -> tuple:
        """(whole, shard) that a block's use of bucket b gathers: the FP8 copy of an FP8 buffer's
        bucket (its params with ``params``), else its params."""
        buf, bucket = self.buckets[b]
        return (bucket.param8, bucket.param8_shard) if buf.fp8 and not params else (bucket.param, bucket.param_shard)

    def _nbytes(self, b: int, params: bool = False) -> int:
        whole = self._gathered(b, params)[0]
        return whole.numel() * whole.element_size()

    def _start(self, b: int, async_op: bool) -> None:
        """Make bucket b's storage and all-gather its shards into it (FREED → PENDING or WHOLE)."""
        buf, bucket = self.buckets[b]
        whole, shard = self._gathered(b)
        restore_storage(whole)
        self.gathers += 1
        self.gathered_bytes += self._nbytes(b)
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)
        handle = self.gather(whole, shard, async_op, buf=buf)
        if async_op:
            self.state[b], self.handles[b] = PENDING, handle
        else:
            self.state[b] = WHOLE

    def ensure(self, ids: list) -> None:
        """Make every bucket of ``ids`` whole (wait for its gather, or gather it now). The time the
        step waits here is exposed communication of kind "zero" (parallel/comm.py's timing)."""
        for b in ids:
            if self.state[b] == WHOLE:
                continue
            start = comm.begin_timed(self.buckets[b][1].param.device)
            if self.state[b] == FREED:
                self._start(b, async_op=False)
            else:
                watchdog.call("all_gather of the ZeRO-3 params", self.buckets[b][0].group, self.handles.pop(b).wait)
                self.state[b] = WHOLE
            comm.end_timed("zero", start, self.buckets[b][1].param.device)

    def start(self, ids: list) -> None:
        """Start the asynchronous gather of the buckets of ``ids`` that are freed (prefetch)."""
        for b in ids:
            if self.state[b] == FREED:
                self._start(b, async_op=True)

    def free(self, ids: list) -> None:
        """Free the buckets of ``ids`` (a gather in flight is waited for first)."""
        self.ensure([b for b in ids if self.state[b] == PENDING])
        for b in ids:
            if self.state[b] == WHOLE:
                self.buckets[b][0].free_param(self.buckets[b][1])
                self.gathered_bytes -= self._nbytes(b) + (self._nbytes(b, True) if b in self.params_whole else 0)
                self.params_whole.discard(b)
                self.state[b] = FREED

    def gather_all(self) -> None:
        """Make every bucket whole (checkpoint save/load, export); the FP8
        buffers' buckets with their params too."""
        self.ensure(list(self.buckets))
        for b, (buf, bucket) in self.buckets.items():
            if buf.fp8 and b not in self.params_whole:
                restore_storage(bucket.param)
                self.gather(bucket.param, bucket.param_shard, False, buf=buf)
                self.params_whole.add(b)
                self.gathered_bytes += self._nbytes(b, True)
                self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)

    def free_all(self) -> None:
        """Free every bucket (after the optimizer's update: the whole buckets are stale)."""
        self.free(list(self.buckets))

    def reset_peak(self) -> None:
        self.peak_bytes, self.gathers = self.gathered_bytes, 0

    def working_set_bytes(self) -> int:
        """The most bytes whole at once (module doc): with reshard, max over adjacent blocks k, k + 1
        of a chunk of the bytes of their buckets' union; without, every bucket's."""
        if not self.reshard:
            return sum(self._nbytes(b) for b in self.buckets)
        best = 0
        for per_block in self.chunk_blocks:
            ids = [i for i in per_block if i]
            for k in range(len(ids)):
                union = set(ids[k]) | (set(ids[k + 1]) if k + 1 < len(ids) else set())
                best = max(best, sum(self._nbytes(b) for b in union))
        return best

    # ------------------------------------------------------------------ hooks
    def _hook(self, block, per_block: list, k: int, nxt, prv) -> None:
        mine = per_block[k]
        later = [b for j in range(k + 1, len(per_block)) for b in per_block[j]
                 if b not in mine and (prv is None or b not in per_block[prv])]

        def before_forward(module, args):
            self.ensure(mine)
            if self.prefetch and nxt is not None:
                self.start(per_block[nxt])

        def before_backward(grad):
            if self.reshard:
                self.free(later)
            self.ensure(mine)
            if self.prefetch and prv is not None:
                self.start(per_block[prv])

        def after_forward(module, args, out):
            if not self.reshard or _in_backward():
                return
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(torch._dynamo.disable(before_backward))
            self.free(mine)

        block.register_forward_pre_hook(torch._dynamo.disable(before_forward))
        block.register_forward_hook(torch._dynamo.disable(after_forward))

    def _arm_end(self, chunk, args, out) -> None:
        """Forward hook of a chunk: free its buckets when its backward ends (with reshard)."""
        if self.reshard and isinstance(out, torch.Tensor) and out.requires_grad and not _in_backward():
            ids = [b for per_block in self.chunk_blocks for ids in per_block for b in ids]
            out.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.free(ids)))
