"""The gradient buffers of data parallelism: flat param and main_grad storage, its buckets, and the
units a bucket may not span (parallel/data.py's module doc tells how DDP fills, reduces and frees them).

``ParamAndGradBuffer`` lays one model chunk's trainable params of one dtype end to end: each param's
``.data`` becomes a view of the buffer and its ``main_grad`` a view of its bucket's grad. ``blocks``
are the units ZeRO-1's overlapped gather waits for and ZeRO-3 gathers (a bucket never spans two under
ZeRO-3); the experts' stacks (model/moe.py ``Experts.stacks``) enter a buffer whole
(``stacks_together``), and under ``config.half_grads`` a stack's bucket takes the grouped GEMM's
gradient uncopied (``adopt``). ``free_storage`` / ``restore_storage`` release and return a tensor's
memory (ZeRO-3's params between uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..dtypes import wide
from .comm import group_rank, group_size
from .tensor import materialized
from .fp8 import E4M3


def blocks(chunk: torch.nn.Module) -> list:
    """The chunk's children that run a forward, looking inside containers that have none
    (ModuleDict/ModuleList: the transformer layers): the embedding, each layer, the final norm,
    the output layer. ZeRO-1's overlapped gather waits, and ZeRO-3 gathers, per block."""
    out = []
    for child in chunk.children():
        if isinstance(child, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            out += blocks(child)
        else:
            out.append(child)
    return out


def block_params(chunk: torch.nn.Module, block: torch.nn.Module) -> list:
    """The trainable params the block reads: its own, and for the chunk's ``output_layer`` the
    weight ``chunk.output_weight()`` hands it (the word embedding when tied on one stage)."""
    own = [q for q in block.parameters() if q.requires_grad]
    if block is getattr(chunk, "output_layer", None) and hasattr(chunk, "output_weight"):
        own.append(chunk.output_weight())
    return list(dict.fromkeys(own))


@dataclass
class Bucket:
    """Elements [start, end) of a buffer (end padded to a multiple of 64 × DP under ZeRO-1/2/3).

    param: the bucket's [end - start] view of the buffer's params (under ZeRO-3 a tensor of its
    own whose storage is freed between uses; param_shard then holds this rank's [n/DP]).
    param8 / param8_shard: the same for the FP8 copy (uint8) of an FP8 buffer (--fp8-param-gather).
    shard_grad: under ZeRO-2/3, this rank's reduced [n/DP] gradient of the step (None until
    its first reduction is waited for); inflight: the reduction not yet waited for."""

    start: int
    end: int
    params: list
    ready: set = field(default_factory=set)
    handle: object = None
    launched: bool = False
    grad: Optional[torch.Tensor] = None  # flat main_grad [end - start]; None until first needed
    param: Optional[torch.Tensor] = None
    param_shard: Optional[torch.Tensor] = None
    param8: Optional[torch.Tensor] = None
    param8_shard: Optional[torch.Tensor] = None
    shard_grad: Optional[torch.Tensor] = None
    inflight: Optional[tuple] = None  # (handle or None, full grad, reduce-scattered [n/DP] or None)

    def grad_range(self, start: int, end: int) -> torch.Tensor:
        """This bucket's grad for buffer elements [start, end) (must lie inside the bucket)."""
        return self.grad[start - self.start:end - self.start]

    def shard(self, rank: int, size: int) -> tuple:
        """Buffer range [s, e) of the rank-th of ``size`` equal shards of this bucket."""
        n = (self.end - self.start) // size
        return self.start + rank * n, self.start + (rank + 1) * n

    def local(self, start: int, end: int) -> slice:
        """Buffer elements [start, end) as a slice of this bucket's flat tensors."""
        return slice(start - self.start, end - self.start)


def update_group(p) -> tuple:
    """The key of param p's optimizer update (optim/optimizer.py ``Fragment``): (no weight decay, LR
    multiplier, the word embedding or output layer, which --decoupled-lr sets apart). Params of one
    key laid out together in a bucket make one flat-AdamW run (parallel/data.py lays buckets out by it)."""
    return getattr(p, "no_weight_decay", False), getattr(p, "lr_mult", 1.0), getattr(p, "embedding_or_output", False)


class ParamAndGradBuffer:
    """Flat param and main_grad storage for one model chunk's trainable params of one dtype.

    ``index[p] = (start, end)``: p's elements in the buffer. ``param_data`` has p's dtype; each
    bucket's ``grad`` has ``grad_dtype`` (fp32 for half params by default) and exists from
    ``allocate_grad`` to ``release_grads``. Each param's ``.data`` becomes a view into
    ``param_data`` (so ZeRO-1 can all-gather a bucket in one call) and ``p.main_grad`` a view into
    its bucket's grad (None while released). Built with every grad allocated and zero.

    group: the group its buckets are reduced over (None: no reduction), with this rank's ``rank``
    and the ``size``; expert: it holds MoE expert params; single_tensor: the group supports the
    flat reduce-scatter / all-gather (``supports_single_tensor_collectives``).

    replica: hybrid sharding's replica group (the same shard in every replica; ``group`` is then the
    shard group inside one replica): reduced gradient shards are all-reduced over it; with
    optim_across the optimizer splits each shard over it too (``replica_size`` parts).
    unit(p): a bucket closes where this key changes between consecutive params (a shared
    embedding alone, ZeRO-3's blocks). stage: the ZeRO stage: ≥ 2 keeps reduced gradients in
    ``Bucket.shard_grad`` (no grads allocated at build); 3 with a group of more than one rank
    (``sharded_params``) gives each bucket its own param storage, keeps ``param_shard`` and frees
    the rest (``param_data`` is then None). fp8: the params are FP8 weights (--fp8-param-gather):
    each bucket gets ``param8`` (and under ZeRO-3 ``param8_shard``, ``param8`` freed), each param
    ``fp8_data`` and ``fp8_scale`` (module doc). order(p): a key by which each bucket's params are
    laid out (a stable sort; None keeps ``params``' order), e.g. the optimizer's (decay, LR) group, so
    that each group is one contiguous range of a bucket: one flat-AdamW run (optim/adamw.py), where
    a GPT layer's weights and biases alternating made 8, each a kernel that torch.compile generates.
    """

    def __init__(self, params: list, grad_dtype: torch.dtype, bucket_size: int, pad_to: int,
                 unit=lambda p: None, *, group=None, expert: bool = False, single_tensor: bool = True,
                 stage: int = 0, replica=None, optim_across: bool = False, fp8: bool = False, order=None):
        self.params, self.group, self.expert, self.single_tensor = params, group, expert, single_tensor
        self.fp8 = fp8
        self.size, self.rank = group_size(group), group_rank(group)
        self.replica, self.replica_size, self.replica_rank = replica, group_size(replica), group_rank(replica)
        self.optim_across = optim_across and self.replica_size > 1
        self.shard_grads = stage >= 2
        self.sharded_params = stage == 3 and self.size > 1
        self.index, self.buckets, self.next_launch = {}, [], 0
        members, current, filled = [], [], 0  # each bucket's params, in ``params``' order
        for p in params:
            if current and unit(p) != unit(current[-1]):
                members.append(current)
                current, filled = [], 0
            current.append(p)
            filled += p.numel()
            if filled >= bucket_size:
                members.append(current)
                current, filled = [], 0
        members += [current] * bool(current)
        offset = 0
        for laid in (sorted(m, key=order) if order else m for m in members):  # stable; each bucket padded
            start = offset
            for p in laid:
                self.index[p] = (offset, offset + p.numel())
                offset += p.numel()
            offset = -(-offset // pad_to) * pad_to
            self.buckets.append(Bucket(start, offset, laid))
        device, dtype = params[0].device, params[0].dtype
        self.grad_dtype, self.numel, self.device = grad_dtype, offset, device
        self.param_data = None if self.sharded_params else torch.zeros(offset, dtype=dtype, device=device)
        for b in self.buckets:
            b.param = torch.zeros(b.end - b.start, dtype=dtype, device=device) if self.sharded_params \
                else self.param_data[b.start:b.end]
            for p in b.params:  # a deferred_init placeholder is drawn here, into its bucket
                s, e = self.index[p]
                b.param[b.local(s, e)].copy_(materialized(p).reshape(-1))
                p.data = b.param[b.local(s, e)].view(p.shape)
                if hasattr(p, "materialize"):
                    del p.materialize
            if fp8:
                self._add_fp8(b)
            if self.sharded_params:
                b.param_shard = b.param[b.local(*b.shard(self.rank, self.size))].clone()
                self.free_param(b)
            if not self.shard_grads:
                self.allocate_grad(b)

    def _add_fp8(self, b: Bucket) -> None:
        """Give bucket b its uint8 FP8 copy (zeros until the optimizer's first cast) and its params
        their E4M3 views of it and a scale (one, until the cast)."""
        b.param8 = torch.zeros(b.end - b.start, dtype=torch.uint8, device=self.device)
        for p in b.params:
            # a tensor of its own over the bucket's bytes (as ``p.data``), so that a gather into param8
            # does not count as modifying what backward saved (ZeRO-3 gathers it again for backward)
            p.fp8_data = torch.empty(0, dtype=E4M3, device=self.device)
            p.fp8_data.data = b.param8[b.local(*self.index[p])].view(E4M3).view(p.shape)
            p.fp8_scale = torch.ones((), dtype=wide(p.dtype), device=self.device)
        if self.sharded_params:
            b.param8_shard = b.param8[b.local(*b.shard(self.rank, self.size))].clone()

    def allocate_grad(self, bucket: Bucket, zero: bool = True) -> None:
        """Give ``bucket`` a grad tensor (zeroed, or uninitialised for a caller that writes every
        element) and point its params' ``main_grad`` into it."""
        new = torch.zeros if zero else torch.empty
        bucket.grad = new(bucket.end - bucket.start, dtype=self.grad_dtype, device=self.device)
        for p in bucket.params:
            p.main_grad = bucket.grad_range(*self.index[p]).view(p.shape)

    def release_grads(self) -> None:
        """Free every bucket's grad, reduced shard (and the params' main_grad views of them)."""
        for b in self.buckets:
            self.release_grad(b)
            b.shard_grad = b.inflight = None

    def release_grad(self, bucket: Bucket) -> None:
        """Free one bucket's full grad (the params' main_grad views become None)."""
        bucket.grad = None
        for p in bucket.params:
            p.main_grad = None

    def shard_pieces(self) -> list:
        """ZeRO-3 (``sharded_params``): [(param, p_lo, view)] of this rank's param shards, view [n]
        holding elements [p_lo, p_lo + n) of the flattened param, so that a checkpoint saves and
        loads the weights where they live (checkpoint/state.py ``model_state``), nothing gathered.
        [] when the params are whole."""
        out = []
        for b in self.buckets if self.sharded_params else ():
            lo, hi = b.shard(self.rank, self.size)
            for p in b.params:
                s, e = self.index[p]
                if max(s, lo) < min(e, hi):
                    out.append((p, max(s, lo) - s, b.param_shard[max(s, lo) - lo:min(e, hi) - lo]))
        return out

    def free_param(self, bucket: Bucket) -> None:
        """ZeRO-3: release the bucket's whole params. Storage that cannot be resized (a checkpoint
        read aliased it through numpy) is first replaced by a fresh copy the params view."""
        if not bucket.param.untyped_storage().resizable():
            bucket.param = bucket.param.clone()
            for p in bucket.params:
                p.data = bucket.param[bucket.local(*self.index[p])].view(p.shape)
        free_storage(bucket.param)
        if bucket.param8 is not None:
            free_storage(bucket.param8)

    def param_of(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """The params of buffer elements [start, end) of ``bucket`` (inside this rank's shard under
        ZeRO-3, where they are a view of ``param_shard``; else of the bucket's whole params)."""
        if not self.sharded_params:
            return bucket.param[bucket.local(start, end)]
        lo = bucket.shard(self.rank, self.size)[0]
        return bucket.param_shard[start - lo:end - lo]

    def param8_of(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """``param_of`` for the bucket's FP8 copy (uint8)."""
        if not self.sharded_params:
            return bucket.param8[bucket.local(start, end)]
        lo = bucket.shard(self.rank, self.size)[0]
        return bucket.param8_shard[start - lo:end - lo]

    def owned_grad(self, start: int, end: int, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradient of buffer elements [start, end) of ``bucket`` (inside its
        shard under ZeRO-1/2/3): a view of ``shard_grad`` under ZeRO-2/3, else of the full grad."""
        if not self.shard_grads:
            return bucket.grad_range(start, end)
        lo = bucket.shard(self.rank, self.size)[0]
        return bucket.shard_grad[start - lo:end - lo]


def free_storage(t: torch.Tensor) -> None:
    """Release t's memory, keeping the tensor (and its views) for ``restore_storage``."""
    t.untyped_storage().resize_(0)


def restore_storage(t: torch.Tensor) -> None:
    """Give t (freed by ``free_storage``) memory again; its contents are undefined until written."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(t.numel() * t.element_size())


def stacks_of(chunk: torch.nn.Module) -> dict:
    """{param: its stack} for every param of a stack of chunk's experts modules (model/moe.py
    ``Experts.stacks``)."""
    return {q: stack for m in chunk.modules() if hasattr(m, "stacks") for stack in m.stacks().values() for q in stack}


def adopt(buf: "ParamAndGradBuffer", bucket: Bucket) -> bool:
    """Make the params' gradients the bucket's grad, uncopied, where they are consecutive views of
    one storage in the bucket's order, of its grad dtype, filling it (no padding): a stack of
    experts' gradient as the grouped GEMM wrote it (model/moe.py ``StackedView``). The params'
    ``main_grad`` become those views; False (nothing changed) otherwise."""
    first = bucket.params[0].grad
    n, size = bucket.end - bucket.start, first.element_size()
    if first.dtype != buf.grad_dtype or (first.storage_offset() + n) * size > first.untyped_storage().nbytes():
        return False
    base = first.untyped_storage().data_ptr()
    for q in bucket.params:
        g, (s, e) = q.grad, buf.index[q]
        if (g.dtype != first.dtype or not g.is_contiguous() or g.untyped_storage().data_ptr() != base
                or g.data_ptr() != first.data_ptr() + (s - bucket.start) * size):
            return False
    if buf.index[bucket.params[-1]][1] != bucket.end:
        return False
    bucket.grad = first.as_strided((n,), (1,))
    for q in bucket.params:
        q.main_grad = q.grad
    return True


def stacks_together(chunk: torch.nn.Module, params: list) -> list:
    """params (buffer order) with each stack of chunk's experts modules (model/moe.py
    ``Experts.stacks``) whole, ascending, where its first member was (module doc); a stack with a
    member not in params stays as it was."""
    stack_of = stacks_of(chunk)
    present = set(params)
    out, placed = [], set()
    for q in params:
        stack = stack_of.get(q)
        if stack is None or not all(s in present for s in stack):
            out.append(q)
        elif id(stack[0]) not in placed:
            placed.add(id(stack[0]))
            out += stack
    return out
