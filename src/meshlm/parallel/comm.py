"""Every tensor-/sequence-parallel collective, with its autograd rule beside it.

The conjugate pairs of Megatron-LM (Shoeybi et al. 2019, §3 "f" and "g"; Korthikanti et al.
2022, §4.2.2 "g" and "ḡ" for sequence parallelism). Activations are [s, b, h]; "TP" functions
split or gather the last (hidden) dim, "SP" functions the sequence dim 0.

    function               forward                     backward
    copy_to_tp             identity                    all-reduce
    reduce_from_tp         all-reduce                  identity
    scatter_to_tp          keep this rank's last-dim   all-gather last dim
    gather_from_tp         all-gather last dim         keep this rank's slice
    scatter_to_sp          keep this rank's s/tp rows  all-gather dim 0
    gather_from_sp         all-gather dim 0            reduce-scatter dim 0
    reduce_scatter_to_sp   reduce-scatter dim 0        all-gather dim 0
    gather_reduce_tp       all-gather last dim         reduce-scatter last dim

All take the group (``ps.tp_group``) and are the identity when it is None or of size 1.

Communication accounting: every collective adds to ``stats[op]`` (op ∈ all_reduce, all_gather,
reduce_scatter) ``calls``, ``bytes`` = numel × element size of the tensor *entering* the
collective on this rank (the full tensor for all-reduce and reduce-scatter, the local shard for
all-gather), and ``ring_bytes`` = bytes this rank sends under a ring algorithm over p ranks:
all-reduce 2(p−1)/p·bytes, reduce-scatter (p−1)/p·bytes, all-gather (p−1)·bytes. Read it with
``snapshot_stats()``, clear it with ``reset_stats()``.

Every blocking collective here is bracketed by ``watchdog.enter``/``leave`` (hang reports name it).

Exposed time (what metrics.jsonl's ``comm_s`` reports): these collectives run inline, so the
step waits for all of their time. Between ``start_timing()`` and ``stop_timing()`` (the trainer's
log iterations only) each one is timed under its kind ("tp" here, "cp" for context parallelism's
K/V, parallel/context.py; parallel/p2p.py times "pp", parallel/experts.py "ep"):
wall time on CPU; on CUDA two events on the compute stream around it, read after the step's one
host sync, so no extra sync. Off, a collective pays one global check. Collectives traced by
torch.compile (the compiled layers of the CUDA fast path) are not timed: the check reads
``torch.compiler.is_compiling()`` first, so dynamo adds no guard and no graph break.

gloo lacks reduce-scatter on older torch: ``reduce_scatter`` falls back to all-reduce + slice
there (same result, recorded as one reduce-scatter); NCCL uses the native op.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

from . import watchdog

stats: dict = defaultdict(lambda: {"calls": 0, "bytes": 0, "ring_bytes": 0.0})

_RING_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p,
                "reduce_scatter": lambda p: (p - 1) / p,
                "all_gather": lambda p: p - 1}


def reset_stats() -> None:
    """Forget every recorded collective on this process."""
    stats.clear()


def snapshot_stats() -> dict:
    """A copy of the counters: {op: {"calls": int, "bytes": int, "ring_bytes": float}}."""
    return copy.deepcopy(dict(stats))


def _record(op: str, t: torch.Tensor, size: int) -> None:
    nbytes = t.numel() * t.element_size()
    s = stats[op]
    s["calls"] += 1
    s["bytes"] += nbytes
    s["ring_bytes"] += _RING_FACTOR[op](size) * nbytes


# ----------------------------------------------------------------------------- exposed-time timing

_timing: Optional[dict] = None  # kind → [(start mark, end mark)] while timing is on


def start_timing() -> None:
    """Time every collective from now until ``stop_timing`` (see the module doc)."""
    global _timing
    _timing = defaultdict(list)


def stop_timing() -> dict:
    """Stop timing; return {kind: seconds} of the collectives timed since ``start_timing``
    (empty if it was not started). On CUDA call it after a host sync (the events have fired)."""
    global _timing
    spans, _timing = _timing or {}, None
    return {kind: sum(elapsed(a, b) for a, b in marks) for kind, marks in spans.items()}


def begin_timed(device: torch.device):
    """The start mark of a collective when timing is on (and not under torch.compile), else None."""
    if torch.compiler.is_compiling() or _timing is None:
        return None
    return mark(device)


def end_timed(kind: str, start, device: torch.device) -> None:
    """Close the span opened by ``begin_timed`` (nothing when it returned None)."""
    if start is not None and _timing is not None:
        _timing[kind].append((start, mark(device)))


def mark(device: torch.device):
    """A point in time on this rank's compute timeline: perf_counter on CPU; on CUDA an event on
    the current stream, which fires when the work queued before it (backward, or a collective once
    waited on) is done — so spans measure what the GPU waited, with no host sync."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(a, b) -> float:
    """Seconds from mark a to mark b (on CUDA, waits for b to fire)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------- raw collectives

def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, kind: str = "tp") -> torch.Tensor:
    """In-place all-reduce of t over group (no-op on a group of one); returns t. Timed under
    ``kind`` ("cp" for context parallelism's loss-token count)."""
    size = group_size(group)
    if size == 1:
        return t
    _record("all_reduce", t, size)
    watchdog.enter("all_reduce", group)
    start = begin_timed(t.device)
    try:
        dist.all_reduce(t, op=op, group=group)
    finally:
        watchdog.leave()
    end_timed(kind, start, t.device)
    return t


def all_gather(t: torch.Tensor, group, dim: int, kind: str = "tp") -> torch.Tensor:
    """Concatenate every rank's t along dim (rank order): [.., n, ..] → [.., p·n, ..]; timed under
    ``kind`` ("cp" for context parallelism's K/V)."""
    size = group_size(group)
    if size == 1:
        return t
    _record("all_gather", t, size)
    t = t.movedim(dim, 0).contiguous()
    watchdog.enter("all_gather", group)
    start = begin_timed(t.device)
    try:
        if dist.get_backend(group) == "nccl":
            out = torch.empty((size * t.shape[0],) + t.shape[1:], dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t, group=group)
        else:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            out = torch.cat(parts)
    finally:
        watchdog.leave()
    end_timed(kind, start, t.device)
    return out.movedim(0, dim)


def reduce_scatter(t: torch.Tensor, group, dim: int, kind: str = "tp") -> torch.Tensor:
    """Sum t over group and keep this rank's 1/p slice along dim: [.., p·n, ..] → [.., n, ..];
    timed under ``kind``."""
    size = group_size(group)
    if size == 1:
        return t
    _record("reduce_scatter", t, size)
    t = t.movedim(dim, 0).contiguous()
    watchdog.enter("reduce_scatter", group)
    start = begin_timed(t.device)
    try:
        if dist.get_backend(group) == "nccl":
            out = torch.empty((t.shape[0] // size,) + t.shape[1:], dtype=t.dtype, device=t.device)
            dist.reduce_scatter_tensor(out, t, group=group)
        else:
            t = t.clone()  # never sum into the caller's tensor
            dist.all_reduce(t, group=group)
            out = t.chunk(size)[group_rank(group)].contiguous()
    finally:
        watchdog.leave()
    end_timed(kind, start, t.device)
    return out.movedim(0, dim)


def split(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous 1/p slice of t along dim (no communication)."""
    size = group_size(group)
    if size == 1:
        return t
    return t.chunk(size, dim)[group_rank(group)].contiguous()


# ----------------------------------------------------------------------------- autograd pairs

def _identity(t, group, dim):
    return t


def _summed(t, group, dim):
    """All-reduce of a copy (autograd must not see its input modified in place)."""
    return all_reduce(t.clone(memory_format=torch.contiguous_format), group)


class _Conjugate(torch.autograd.Function):
    """One row of the table above: ``fwd(x, group, dim)`` forward, ``bwd(grad, group, dim)``
    backward, each one of _identity, _summed, split, all_gather, reduce_scatter."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.group, ctx.dim), None, None, None, None


def _active(group) -> bool:
    return group_size(group) > 1


def copy_to_tp(x, group):
    """Megatron f: identity forward, all-reduce of the grad. x: any shape, replicated over TP."""
    return _Conjugate.apply(x, group, -1, _identity, _summed) if _active(group) else x


def reduce_from_tp(x, group):
    """Megatron g: all-reduce forward (sum of partial outputs), identity backward."""
    return _Conjugate.apply(x, group, -1, _summed, _identity) if _active(group) else x


def scatter_to_tp(x, group):
    """[.., h] → [.., h/tp] this rank's slice; backward all-gathers the grad."""
    return _Conjugate.apply(x, group, -1, split, all_gather) if _active(group) else x


def gather_from_tp(x, group):
    """[.., h/tp] → [.., h]; backward keeps this rank's slice of the grad."""
    return _Conjugate.apply(x, group, -1, all_gather, split) if _active(group) else x


def gather_reduce_tp(x, group):
    """[.., n/tp] → [.., n] where every rank then uses all of it: backward reduce-scatters."""
    return _Conjugate.apply(x, group, -1, all_gather, reduce_scatter) if _active(group) else x


def scatter_to_sp(x, group):
    """[s, b, h] → [s/tp, b, h] this rank's rows; backward all-gathers the grad."""
    return _Conjugate.apply(x, group, 0, split, all_gather) if _active(group) else x


def gather_from_sp(x, group):
    """[s/tp, b, h] → [s, b, h] before a TP-split op; backward reduce-scatters (Korthikanti §4.2.2 g)."""
    return _Conjugate.apply(x, group, 0, all_gather, reduce_scatter) if _active(group) else x


def reduce_scatter_to_sp(x, group):
    """Partial sums [s, b, h] → summed rows [s/tp, b, h]; backward all-gathers (Korthikanti ḡ)."""
    return _Conjugate.apply(x, group, 0, reduce_scatter, all_gather) if _active(group) else x
