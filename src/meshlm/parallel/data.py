"""Data parallelism: contiguous gradient buffers, buckets, and their reduction over DP × CP.

Every trainable parameter of every model chunk lives in a flat *param buffer*; buckets (ranges of
about ``--ddp-bucket-size`` elements) of it each own a flat *grad* tensor, and ``p.main_grad`` is
p's view into its bucket's (fp32 under ``--accumulate-allreduce-grads-in-fp32``, the default).
Each backward's ``p.grad`` is added into ``p.main_grad`` and freed, so the gradients of all
micro-batches sum in place, in fp32:
- under ``--overlap-grad-reduce`` a post-accumulate-grad hook on every param does it as each
  gradient arrives, so a bucket's reduction can start as soon as its last gradient is in;
- otherwise it happens once at the end of each backward pass (an autograd callback queued when
  the backward reaches a chunk's output), as one multi-tensor add over the chunk's params: no
  Python hook per parameter, a few kernels instead of one per parameter. A param used twice in one
  backward (tied embedding and output layer on one stage) then has its two contributions summed
  in ``p.grad``'s dtype first, as eager PyTorch does.
Where one backward a step is all the gradients get and nothing sums or rescales them before the
optimizer (``config.half_grads``: the CUDA fast path, DP × CP 1, one micro-batch, …), bf16 params'
buckets are bf16: a bf16 gradient widens to fp32 exactly, so they hold what fp32 buckets would, and
the fold, the grad norm and the update each move 2 bytes a parameter less; the optimizer widens
them as it reads. A second backward into them in one step is refused (``_fold``).
Params enter the buffers in reverse order of creation, so buckets fill in the order backward
produces gradients, except that each *stack* of the MoE experts (model/moe.py ``Experts.stacks``:
one param of each local expert, ascending) enters whole where its first member would: the grouped
GEMMs produce a stack's gradients together, and a stack whose params lie back to back in a
buffer's one param storage (not ZeRO-3's per-bucket storage, not an FP8 buffer) is named in the
module's ``views`` (``_bind_views``), which the grouped GEMMs then take as a view of the buffer
instead of a copy of the weights each call. Under ``config.half_grads`` each stack is a bucket of its
own, and the stack's gradient, which the grouped GEMM writes as one [E, out, in] tensor whose slices
autograd hands the params, becomes that bucket's grad as it is (``adopt``): the fold copies nothing
for the experts (4 bytes a parameter: most of an MoE model's).

Gradient memory lives only from a bucket's first gradient to the next ``zero_grad``: zero_grad
frees every bucket's grad, and the first gradient of the next backward allocates its bucket
(zeroed for the hooks; uninitialised and copied into, padding zeroed, by the end-of-backward add). So during the forward and at the start of backward — where activations peak — no
gradient memory is held (4 bytes a parameter for fp32 main_grads; ~4.2 GiB for a 1.1B model),
the same as eager PyTorch with ``zero_grad(set_to_none=True)``; Megatron keeps its grad buffer
for the whole run.

Buckets hold ``--ddp-bucket-size`` elements, by default max(40M, 1M × DP), or ``ONE_RANK_BUCKET``
(2^30) at DP × CP 1, where there is no reduction and a bucket is only the optimizer's unit.
Reduction (group ``ps.dp_cp_group``): each bucket is divided by the group size and then
all-reduced, or reduce-scattered under ``--use-distributed-optimizer`` (each rank keeps 1/DP of
every bucket: ZeRO-1, Rajbhandari et al. 2020 §5.1). With ``--overlap-grad-reduce`` a bucket's
reduction starts during the last micro-batch's backward as soon as its last gradient arrives;
otherwise ``finish_grad_sync`` runs them all. Buckets of one buffer always launch in order, so
every DP rank issues the same collectives in the same order and results are bitwise identical
with overlap on and off.

Under --check-for-nan-in-loss-and-grad (the default) each bucket's sum is taken just before its
reduction (no host sync): ``local_grads_finite`` tells, after a failed NaN/inf check, whether
this rank's own gradients were the non-finite ones (training/faults.py). Where nothing would
change the gradients before that question is asked (DP × CP of 1, no SP or tied-embedding
all-reduce, no fp16 unscale: ``lazy_check``) the sums are taken only when it is asked, sparing a
read of every gradient (4 bytes a parameter) each step.

MoE expert params (``p.expert``, model/moe.py) live in buffers of their own, reduced over the
expert-data-parallel group ``ps.edp_group`` (the ranks holding the same experts) but divided by
DP × CP like every other gradient, not by that group's size: the expert-parallel all-to-all's
backward has already summed the contributions of the tokens of all EP ranks into the owner
(Megatron's expert_gradient_scaling_factor). Under ZeRO-1 their buckets are sharded over that
group.

ZeRO-2 (``--data-parallel-sharding-strategy optim_grads``, Rajbhandari et al. 2020 §5.2 P_os+g):
every backward of every micro-batch reduce-scatters its buckets (divided by DP × CP) and adds the
result into the bucket's persistent ``shard_grad`` [n/DP], the only gradient a rank keeps; the
full bucket lives from its first gradient to the wait for its reduction. Accumulation over M
micro-batches therefore costs M reduce-scatters per step instead of one (DeepSpeed's ZeRO-2 and
FSDP2 do the same); the gain is that no rank ever holds the whole model's gradients. The
reduction of a bucket is waited for when the same bucket is launched again (the next micro-batch)
or in ``finish_grad_sync``. ZeRO-3 (``optim_grads_params``) reduces the same way and also gives
each bucket its own parameter storage (``Bucket.param``), freed and all-gathered per block by
optim/param_gather.py; under it buckets never span two blocks (``blocks``: the units gathered).

Under --fp8-param-gather the FP8 layers' linear weights (marked ``fp8_gather`` by
model.chunks.apply_fp8) get buffers of their own, whose buckets also hold a uint8 ``param8``: the
weights cast to E4M3, written shard by shard by the optimizer and all-gathered in place of the
params (one byte an element; optim/fp8_gather.py). Each such weight carries ``fp8_data`` (its E4M3
view of ``param8``) and ``fp8_scale`` (0-dim, the master's dtype), which parallel/fp8.py's GEMMs take.

After the DP reduction, ``finish_grad_sync`` all-reduces over TP the gradients of replicated
params marked ``sequence_parallel`` (under ``--sequence-parallel``), and over the embedding
group the ``shared_embedding`` params' gradients (tied embeddings, PP > 1), then moves the MoE
routers' expert biases (``update_expert_bias``, Megatron's finalize_model_grads; the routers are
model/moe.py's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ONE_RANK_BUCKET, half_grads, zero_stage
from ..dtypes import HALF, wide
from . import watchdog
from .comm import begin_timed, end_timed, elapsed as _elapsed, group_rank, group_size, mark as _mark
from .grad_buffer import Bucket, ParamAndGradBuffer, adopt, blocks, stacks_of, stacks_together, update_group
from .mesh import ParallelState

# Flat-tensor collectives (torch >= 2.13 names, older names before): [n·size] → [n] and back.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def supports_single_tensor_collectives(group) -> bool:
    """Whether reduce_scatter/all_gather into one flat tensor work on this group's backend.

    NCCL always; gloo only in recent torch. Probed once with a tiny collective (every rank of
    the group must call this together).
    """
    if group is None or dist.get_backend(group) != "gloo":
        return True
    size = group_size(group)
    try:
        reduce_scatter_flat(torch.zeros(1), torch.zeros(size), group=group)
        all_gather_flat(torch.zeros(size), torch.zeros(1), group=group)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@dataclass
class GradSyncStats:
    """Communication of the last ``finish_grad_sync``.

    bytes_reduced: payload bytes handed to collectives (DP buckets + SP norms + embeddings).
    exposed_s: seconds the step waited for gradient communication after backward (not hidden
        behind it): wall time on CPU; on CUDA the time between the backward's last kernel and the
        last reduction's end on the compute stream (CUDA events), so queued compute is not counted.
    bucket_exposed_s: the wait on each DP bucket, seconds, in launch order.
    Both are computed when first read, from the marks taken during the sync: read after the step's
    one host sync (the optimizer's), the CUDA events have fired and reading them costs no sync.
    """

    bytes_reduced: int = 0
    marks: tuple = (0.0, 0.0)  # (start, end) marks of the whole sync
    spans: list = field(default_factory=list)  # (start, end) marks of each bucket's wait

    @property
    def exposed_s(self) -> float:
        return _elapsed(*self.marks)

    @property
    def bucket_exposed_s(self) -> list:
        return [_elapsed(a, b) for a, b in self.spans]


class DistributedDataParallel:
    """Gradient buffers, hooks and DP reduction for a list of model chunks (see module doc).

    chunks: the model chunks of this rank (1, or v under interleaved PP). ps: the ParallelState.
    cfg: the Config (reads cfg.parallel, cfg.model.untie_embeddings_and_output_weights and the
    expert-bias rate). Attributes read by the optimizer: ``buffers`` (list of ParamAndGradBuffer,
    each with its reduction group), ``group`` (ps.dp_cp_group), ``use_distributed_optimizer``
    (ZeRO stage ≥ 1), ``stage`` (config.zero_stage); ``stats`` (GradSyncStats) for metrics.
    """

    def __init__(self, chunks, ps: ParallelState, cfg):
        p = cfg.parallel
        self.ps, self.group = ps, ps.dp_cp_group
        self.size, self.rank = group_size(self.group), group_rank(self.group)
        self.stage = zero_stage(p)
        self.use_distributed_optimizer = self.stage >= 1
        self.shard_grads = self.stage >= 2
        self.overlap = p.overlap_grad_reduce
        self.check_local_grads = cfg.training.check_for_nan_in_loss_and_grad
        self._local_sums = []  # one 0-dim sum per bucket launched this step, taken before its reduction
        self._checked_sums = []  # the last finished step's
        self.sequence_parallel = p.sequence_parallel and ps.tp > 1
        self.tied_embeddings = ps.pp > 1 and not cfg.model.untie_embeddings_and_output_weights
        # nothing changes the gradients between the backward and a failed check when this rank's
        # grads are never reduced or re-summed (no DP × CP, SP or tied-embedding all-reduce, no
        # fp16 unscale): the check then reads them when asked, not each step (4 bytes a parameter)
        self.lazy_check = (self.size == 1 and not (p.sequence_parallel and ps.tp > 1) and not self.tied_embeddings
                           and not cfg.training.fp16)
        # one backward a step and nothing summing the grads: bf16 params' buckets stay bf16 (config.half_grads)
        self.half_grads = half_grads(cfg, ps.world_size, ps.device.type == "cuda")
        # at DP × CP 1 nothing is reduced, so buckets would only cut the optimizer's flat runs (a
        # kernel launch each): ONE_RANK_BUCKET elements (int32 indexing)
        self.bucket_size = p.ddp_bucket_size or (max(40_000_000, 1_000_000 * ps.dp) if self.size > 1
                                                 else ONE_RANK_BUCKET)
        self.single_tensor_collectives = supports_single_tensor_collectives(self.group)
        self.chunks, self.bias_rate = list(chunks), cfg.model.moe_router_bias_update_rate
        has_experts = any(getattr(q, "expert", False) for c in chunks for q in c.parameters())
        expert_single = supports_single_tensor_collectives(ps.edp_group) if has_experts else True
        # ZeRO-1/2/3 + tied embeddings: the shared weight gets its own bucket so the first and last
        # stage shard it identically and the embedding all-reduce can follow the reduce-scatter;
        # ZeRO-3 closes a bucket at every block boundary (a block gathers whole buckets)
        shared = self.use_distributed_optimizer and self.tied_embeddings
        self.buffers, self._where, self._chunk_buffers = [], {}, {}
        for chunk in reversed(list(chunks)):
            block_of = {q: i for i, blk in enumerate(blocks(chunk)) for q in blk.parameters()} \
                if self.stage == 3 else {}

            # under half_grads each stack of experts is a bucket of its own, which can take the stack's
            # gradient as it comes from the grouped GEMM, uncopied (``adopt``)
            stack_of = stacks_of(chunk) if self.half_grads else {}

            def unit(q, block_of=block_of, stack_of=stack_of):
                return (block_of.get(q), shared and getattr(q, "shared_embedding", False) and id(q),
                        id(stack_of[q][0]) if q in stack_of else None)

            params = stacks_together(chunk, [q for q in chunk.parameters() if q.requires_grad][::-1])

            def kind(q):  # one buffer per (dtype, expert or not, FP8 weight under --fp8-param-gather or not)
                return q.dtype, getattr(q, "expert", False), hasattr(q, "fp8_gather")

            for dtype, expert, fp8 in dict.fromkeys(kind(q) for q in params):
                group = [q for q in params if kind(q) == (dtype, expert, fp8)]
                # --grad-reduce-in-bf16: bf16 params accumulate and reduce in bf16 (Megatron's)
                narrow = not p.accumulate_allreduce_grads_in_fp32 or (p.grad_reduce_in_bf16 and dtype == torch.bfloat16)
                grad_dtype = dtype if narrow else wide(dtype)
                if self.half_grads and dtype in HALF:
                    grad_dtype = dtype
                hybrid = ps.instances > 1 and not expert
                reduce_group = ps.edp_group if expert else ps.shard_group if hybrid else self.group
                # padded for ZeRO to 64 × the ranks its shards split over (all DP × CP under hybrid)
                pad_to = 64 * group_size(ps.edp_group if expert else self.group) if self.use_distributed_optimizer else 1
                buf = ParamAndGradBuffer(group, grad_dtype, self.bucket_size, pad_to, unit, group=reduce_group,
                                         expert=expert, stage=self.stage,
                                         replica=ps.replica_group if hybrid else None,
                                         optim_across=hybrid and p.outer_dp_sharding_strategy == "optim", fp8=fp8,
                                         single_tensor=expert_single if expert else self.single_tensor_collectives,
                                         # one flat-AdamW run a bucket and update group (the expert stacks as built)
                                         order=None if expert else update_group)
                self.buffers.append(buf)
                self._chunk_buffers.setdefault(id(chunk), []).append(buf)
                for b in buf.buckets:
                    for q in b.params:
                        self._where[q] = (buf, b)
        self._bind_views()
        if self.overlap:
            for q in self._where:
                q.register_post_accumulate_grad_hook(self._on_grad)
        if not self.overlap or self.shard_grads:  # ZeRO-2/3 reduce at the end of every backward
            for chunk in chunks:
                chunk.register_forward_hook(self._arm_fold)
        self._sync = True
        self._bytes = 0  # payload of the reductions of the step in flight
        self.stats = GradSyncStats()

    def _bind_views(self) -> None:
        """Name in each experts module's ``views`` its stacks whose params lie back to back,
        ascending, in one buffer's param storage (module doc)."""
        for chunk in self.chunks:
            for m in chunk.modules():
                if hasattr(m, "stacks"):
                    m.views = frozenset(role for role, stack in m.stacks().items() if self._back_to_back(stack))

    def _back_to_back(self, stack: list) -> bool:
        """Whether the params of ``stack`` are consecutive elements of one buffer's ``param_data``,
        the first 16-byte aligned (as a fresh copy is: the grouped GEMM's operands must be)."""
        buf = self._where[stack[0]][0] if stack[0] in self._where else None
        if buf is None or buf.param_data is None or buf.fp8 or stack[0].data_ptr() % 16:
            return False
        start, n = buf.index[stack[0]][0], stack[0].numel()
        return all(q in self._where and self._where[q][0] is buf and buf.index[q][0] == start + i * n
                   and q.shape == stack[0].shape and q.is_contiguous() for i, q in enumerate(stack))

    def shard_pieces(self) -> tuple:
        """(every ZeRO-3-sharded param, every buffer's ``ParamAndGradBuffer.shard_pieces``): the params
        whose values live only in shards, and this rank's pieces of them (empty when none is sharded)."""
        return ({p for buf in self.buffers if buf.sharded_params for p in buf.params},
                [piece for buf in self.buffers for piece in buf.shard_pieces()])

    def bucket_of(self, p: torch.Tensor) -> tuple:
        """(ParamAndGradBuffer, Bucket) holding param p."""
        return self._where[p]

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: fold p.grad into p.main_grad (allocating its bucket's grad
        on the step's first gradient); maybe launch its bucket."""
        buf, bucket = self._where[p]
        if bucket.grad is None:
            buf.allocate_grad(bucket)
        p.main_grad.add_(p.grad)
        p.grad = None
        if not self._sync and not self.shard_grads:  # registered under --overlap-grad-reduce only
            return
        if bucket.launched:
            raise RuntimeError("a gradient arrived after its bucket's DP reduction started: run every "
                               "backward but the last micro-batch's inside ddp.no_sync()")
        bucket.ready.add(p)
        while buf.next_launch < len(buf.buckets):
            nxt = buf.buckets[buf.next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(buf, nxt)

    def _arm_fold(self, chunk, args, out) -> None:
        """Forward hook of a chunk: when backward reaches its output, queue ``_fold`` to run at the
        end of that backward pass."""
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward(chunk)))

    def _end_backward(self, chunk) -> None:
        """End of one backward pass of ``chunk``: fold its grads (unless the hooks did); under
        ZeRO-2/3 launch the reduction of every bucket of its buffers not launched yet (this
        micro-batch's) and make them ready for the next micro-batch's gradients."""
        if not self.overlap:
            self._fold(chunk)
        if not self.shard_grads:
            return
        for buf in self._chunk_buffers[id(chunk)]:
            while buf.next_launch < len(buf.buckets):
                self._launch(buf, buf.buckets[buf.next_launch])
            buf.next_launch = 0
            for bucket in buf.buckets:
                bucket.ready.clear()
                bucket.launched = False

    def _fold(self, chunk) -> None:
        """Add every ``p.grad`` of the chunk into ``p.main_grad`` and free it. A bucket that gets
        its first gradients of the step here, one for each of its params, is allocated uninitialised
        and the gradients are copied in (only its padding zeroed): no zero fill, no read of zeros;
        under half_grads one whose gradients are already one run of memory takes it (``adopt``)."""
        params = [q for q in chunk.parameters() if q.grad is not None and q in self._where]
        fresh = {}  # id(bucket) → (buffer, bucket, its params with a gradient here)
        for q in params:
            buf, bucket = self._where[q]
            if bucket.grad is None:
                fresh.setdefault(id(bucket), (buf, bucket, []))[2].append(q)
        copied, adopted = [], []
        for buf, bucket, got in fresh.values():
            whole = len(got) == len(bucket.params)
            if whole and self.half_grads and adopt(buf, bucket):
                adopted += got
                continue
            buf.allocate_grad(bucket, zero=not whole)
            if whole:
                used = sum(q.numel() for q in bucket.params)
                bucket.grad[used:].zero_()  # ZeRO-1 padding
                copied += got
        skip = set(copied) | set(adopted)
        add = [q for q in params if q not in skip]
        if self.half_grads and any(id(self._where[q][1]) not in fresh and self._where[q][0].grad_dtype in HALF
                                   for q in add):
            raise RuntimeError("a second backward in one step reached bf16 gradient buckets, which hold one "
                               "backward's gradients exactly (config.half_grads): the step must run one micro-batch")
        if copied:
            torch._foreach_copy_([q.main_grad for q in copied], [q.grad for q in copied])
        if add:
            torch._foreach_add_([q.main_grad for q in add], [q.grad for q in add])
        for q in params:
            q.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients only (every micro-batch's backward but the last)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _launch(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        """Start the async reduction of one bucket: ÷ DP × CP, then all-reduce/reduce-scatter over
        the buffer's group."""
        buf.next_launch += 1
        bucket.launched = True
        if self.shard_grads:  # the previous micro-batch's reduction of this bucket: a wait inside
            start = begin_timed(self.ps.device)  # backward, exposed communication of kind "zero"
            self._drain(buf, bucket)
            end_timed("zero", start, self.ps.device)
        if bucket.grad is None:  # no param of the bucket got a gradient this step
            buf.allocate_grad(bucket)
        if self.check_local_grads and not self.lazy_check:  # NaN/inf anywhere makes the sum non-finite
            self._local_sums.append(bucket.grad.sum())
        data = bucket.grad
        if self.size > 1:
            data.div_(self.size)
        if self.shard_grads:
            self._launch_shard(buf, bucket)
            return
        if buf.group is None:
            return
        if self.use_distributed_optimizer and buf.single_tensor:
            shard = bucket.grad_range(*bucket.shard(buf.rank, buf.size))
            bucket.handle = reduce_scatter_flat(shard, data, group=buf.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(data, group=buf.group, async_op=True)
        self._bytes += data.numel() * data.element_size()

    def _launch_shard(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        """ZeRO-2/3: start reducing this micro-batch's full bucket grad (already ÷ DP × CP) into a
        new [n/DP] shard and free the bucket for the next micro-batch's gradients."""
        data, handle, out = bucket.grad, None, None
        if buf.group is not None and buf.single_tensor:
            out = torch.empty(data.numel() // buf.size, dtype=data.dtype, device=data.device)
            handle = reduce_scatter_flat(out, data, group=buf.group, async_op=True)
        elif buf.group is not None:
            handle = dist.all_reduce(data, group=buf.group, async_op=True)
        bucket.inflight = (handle, data, out)
        buf.release_grad(bucket)
        if buf.group is not None:
            self._bytes += data.numel() * data.element_size()

    def _drain(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        """ZeRO-2/3: wait for the bucket's reduction in flight, if any, and add its shard into
        ``shard_grad`` (the first one of the step becomes it)."""
        if bucket.inflight is None:
            return
        handle, data, out = bucket.inflight
        if handle is not None:
            what = "expert " if buf.expert else ""
            watchdog.call(f"reduce_scatter of {what}DP gradient bucket", buf.group, handle.wait)
        piece = out if out is not None else data[bucket.local(*bucket.shard(buf.rank, buf.size))]
        self._across_replicas(buf, piece)
        bucket.shard_grad = piece if bucket.shard_grad is None else bucket.shard_grad.add_(piece)
        bucket.inflight = None

    def _across_replicas(self, buf: ParamAndGradBuffer, shard: torch.Tensor) -> None:
        """Hybrid sharding: sum a reduced gradient shard over the replicas (the same shard of every
        replica), so that it holds the whole DP × CP sum."""
        if buf.replica is not None:
            watchdog.call("all_reduce of a gradient shard across replicas", buf.replica, dist.all_reduce, shard,
                          group=buf.replica)
            self._bytes += shard.numel() * shard.element_size()

    # ------------------------------------------------------------------ after backward
    def finish_grad_sync(self) -> None:
        """Finish the DP reduction of every bucket, then the SP-norm and tied-embedding all-reduces.

        Under ZeRO-1 only this rank's shard of each bucket holds the reduced gradient afterwards.
        Records ``stats`` (bytes, exposed seconds). Collective over DP × CP, TP and the embedding
        group: every rank calls it once per step.
        """
        stats = GradSyncStats()
        t0 = _mark(self.ps.device)  # on CUDA: fires when the backward's kernels are done
        for buf in self.buffers:
            while not self.shard_grads and buf.next_launch < len(buf.buckets):
                self._launch(buf, buf.buckets[buf.next_launch])
        spans = []
        kind = "reduce_scatter" if self.use_distributed_optimizer else "all_reduce"
        for buf in self.buffers:
            for i, bucket in enumerate(buf.buckets):
                t = _mark(self.ps.device)
                if self.shard_grads:
                    self._drain(buf, bucket)
                    if bucket.shard_grad is None:  # no backward reached this bucket this step
                        n = (bucket.end - bucket.start) // buf.size
                        bucket.shard_grad = torch.zeros(n, dtype=buf.grad_dtype, device=self.ps.device)
                else:
                    # no handle: a group of one rank, e.g. hybrid sharding with one rank per replica,
                    # whose shard must still be summed over the replicas below
                    if bucket.handle is not None:
                        what = "expert " if buf.expert else ""
                        watchdog.enter(f"{kind} of {what}DP gradient bucket {i}", buf.group)
                        try:
                            bucket.handle.wait()
                        finally:
                            watchdog.leave()
                    if self.use_distributed_optimizer:
                        self._across_replicas(buf, bucket.grad_range(*bucket.shard(buf.rank, buf.size)))
                spans.append((t, _mark(self.ps.device)))
        if self.sequence_parallel:
            self._all_reduce_marked("sequence_parallel", self.ps.tp_group)
        if self.tied_embeddings and self.ps.embedding_group is not None:
            self._all_reduce_marked("shared_embedding", self.ps.embedding_group)
        update_expert_bias(self.chunks, self.ps, self.bias_rate)
        stats.marks, stats.spans = (t0, _mark(self.ps.device)), spans
        stats.bytes_reduced = self._bytes
        self.stats = stats
        self._reset()

    def _all_reduce_marked(self, attr: str, group) -> None:
        """Sum main_grad of the params carrying ``attr`` over ``group``, in one flat collective
        (under ZeRO-2/3 the part of each in this rank's gradient shards: the ranks of the TP and
        embedding groups have the same bucket layout, so the same parts)."""
        if self.shard_grads:
            grads = []
            for q in self._where:
                buf, bucket = self._where[q]
                s, e = buf.index[q]
                lo, hi = bucket.shard(buf.rank, buf.size)
                if getattr(q, attr, False) and max(s, lo) < min(e, hi):
                    grads.append(buf.owned_grad(max(s, lo), min(e, hi), bucket))
        else:
            grads = [q.main_grad for q in self._where if getattr(q, attr, False)]
        if not grads or group is None:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        watchdog.enter(f"all_reduce of the {attr} gradients", group)
        try:
            dist.all_reduce(flat, group=group)
        finally:
            watchdog.leave()
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
        self._bytes += flat.numel() * flat.element_size()

    def local_grads_finite(self):
        """Whether this rank's gradients of the last step were finite before the DP reduction
        (None when --no-check-for-nan-in-loss-and-grad). Reads device values: call only after a
        failed global check."""
        if not self.check_local_grads:
            return None
        if self.lazy_check:
            return bool(all(torch.isfinite(buf.owned_grad(b.start, b.end, b).sum()) for buf in self.buffers
                            for b in buf.buckets if (b.shard_grad if buf.shard_grads else b.grad) is not None))
        return bool(all(torch.isfinite(s) for s in self._checked_sums))

    def _reset(self) -> None:
        self._checked_sums, self._local_sums = self._local_sums, []
        for buf in self.buffers:
            buf.next_launch = 0
            for bucket in buf.buckets:
                bucket.ready.clear()
                bucket.handle, bucket.launched = None, False
        self._bytes = 0

    def zero_grad(self) -> None:
        """Start of an iteration: free every bucket's grad (re-allocated, zeroed, by the bucket's
        first gradient of the next backward, or by ``finish_grad_sync`` if it gets none)."""
        for buf in self.buffers:
            buf.release_grads()
        for q in self._where:
            q.grad = None
        self._reset()


def update_expert_bias(chunks, ps, rate: float) -> None:
    """Aux-loss-free balancing step (DeepSeek-V3 §2.1.2): for each router with an expert bias (a
    module with an ``expert_bias``, model/moe.py's Router, as in Megatron's finalize_model_grads),
    sum its step's tokens per expert over every rank of the pipeline stage (TP, then DP × CP), then
    bias += rate · sign(mean load − load), identical on every rank; reset the counts. Collective
    over TP and DP × CP: every rank calls it once per step."""
    routers = [m for c in chunks for m in c.modules() if hasattr(m, "expert_bias") and m.use_bias]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])
    for group in (ps.tp_group, ps.dp_cp_group):
        if group is not None:
            dist.all_reduce(counts, group=group)
    for r, c in zip(routers, counts):
        r.expert_bias += rate * torch.sign(c.mean() - c)
        r.tokens_per_expert.zero_()
