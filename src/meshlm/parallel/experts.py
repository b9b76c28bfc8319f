"""Token dispatch: routes to their experts (and EP ranks, by all-to-all) and back.

At EP = 1 (``_local``) the dispatch has fixed shapes and never reads the device from the host, so
it compiles into the MoE layer's graph (meshlm/fast.py). Its T·k slots are the k routes each token
chose before any capacity dropping (``chosen``; a dropped route keeps its slot with gate 0), so
token t's slots are t·k … t·k + k − 1 in token-major order; one stable argsort by expert gives the
expert-major order ``perm`` (by expert, then token: nonzero's order) and its inverse ``inv``. The
slots the capacity dropped sort after every expert's (key E), past the counts' last offset: the
grouped GEMM skips them, and two ``torch.where`` zero their rows and their rows' gradients (a
GEMM leaves rows past its last offset undefined), so dropping does less expert work. The
rows are one gather (backward: a gather and a sum over each token's k slots, no atomics), the
experts run on the counts per expert as a device tensor, and the results come back by the inverse
gather and a gate-weighted sum over the k slots in fp32 (``_Gather``: both directions are
permutations, so no backward scatters).

At EP > 1 ``dispatch_combine`` follows Megatron's MoEAlltoAllTokenDispatcher, in order:
  1. permute: the routes (token, expert) of routing_map [T, E], expert-major (stable: by expert,
     then token), their rows gathered; counts [E] routes per expert;
  2. counts exchange: one all_to_all_single of the counts over the EP group, so each rank learns
     how many rows every source sends to each of its local experts; then one host read of the
     counts for the split sizes;
  3. all_to_all_single of the rows with those split sizes (autograd: the backward is the reverse
     all-to-all); the rows arrive [source rank][local expert] and are regrouped expert-major;
     with a shared expert, the exchange is started asynchronously and the shared expert's
     forward runs before it is waited for (the overlap of Megatron's
     --moe-shared-expert-overlap); in backward the same: the reverse exchange of the rows'
     gradients starts where the wait was (``_Wait.backward``) and is waited for where the exchange
     started (``_AllToAllStart.backward``), and autograd runs the shared expert's backward between
     the two (its nodes were made between them, and the engine runs the latest-made ready node first);
  4. the experts (``experts(x, counts)``);
  5. the inverse regrouping, the reverse all-to-all, and the gate-weighted sum of each token's k
     results in token order (index_add).
EP rank r holds experts [r·E/EP, (r+1)·E/EP); the EP group is ParallelState.ep_group (None at
EP = 1: steps 2–3 and 5's exchange vanish). Every exchange (forward and backward) is watched
(``watchdog``: a hang names it) and, on the trainer's log iterations, timed under the kind "ep"
(metrics.jsonl's ``comm_s``; parallel/comm.py's exposed-time timing). Every token's result is the same function of the
token as on one process: the layout changes where a row is computed, never its arithmetic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import watchdog
from .comm import begin_timed, end_timed, group_size


def _exchange(name: str, out: torch.Tensor, x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """dist.all_to_all_single(out, x, ...) over the EP group, watched and timed as "ep"."""
    watchdog.enter(name, group)
    start = begin_timed(x.device)
    try:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    finally:
        watchdog.leave()
    end_timed("ep", start, x.device)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [Σ in_splits, h] → [Σ out_splits, h] over ``group``; backward the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return _exchange("all_to_all of the MoE tokens", out, x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        dx = dy.new_empty((sum(in_splits),) + tuple(dy.shape[1:]))
        _exchange("all_to_all of the MoE token gradients", dx, dy.contiguous(), in_splits, out_splits, ctx.group)
        return dx, None, None, None


def _wait(work, name: str, group, device: torch.device) -> None:
    """Wait for an async exchange ``work`` (watched as ``name``, timed as "ep": the exposed wait)."""
    watchdog.enter(name, group)
    start = begin_timed(device)
    try:
        work.wait()
    finally:
        watchdog.leave()
    end_timed("ep", start, device)


class _AllToAllStart(torch.autograd.Function):
    """The forward exchange of ``_AllToAll`` started (async_op) and not waited for: the output's
    rows are valid once ``_Wait`` has run; the work handle goes onto ``pending``, the list this node
    shares with its ``_Wait``. Backward: waits for the reverse exchange ``_Wait.backward`` started
    and returns its rows."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.group, ctx.pending = group, pending
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        pending.append((dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True), x))
        return out

    @staticmethod
    def backward(ctx, _):
        work, dx, _dy = ctx.pending.pop()
        _wait(work, "all_to_all of the MoE token gradients", ctx.group, dx.device)
        return dx, None, None, None, None


class _Wait(torch.autograd.Function):
    """y = x once ``pending``'s exchange is done. Backward: starts the reverse exchange of dy
    (async_op; its handle, result and input onto ``pending``) and hands dy on unchanged: the rows'
    gradients are ``_AllToAllStart.backward``'s, once it has waited."""

    @staticmethod
    def forward(ctx, x, pending, group, out_splits, in_splits):
        ctx.pending, ctx.group, ctx.splits = pending, group, (out_splits, in_splits)
        work, _ = pending.pop()
        _wait(work, "all_to_all of the MoE tokens", group, x.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        dy = dy.contiguous()
        dx = dy.new_empty((sum(in_splits),) + tuple(dy.shape[1:]))
        work = dist.all_to_all_single(dx, dy, in_splits, out_splits, group=ctx.group, async_op=True)
        ctx.pending.append((work, dx, dy))  # dy kept alive until the exchange is waited for
        return dy, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows: send x's rows in ``in_splits`` chunks to the
    group's ranks in order, receive ``out_splits`` rows from each."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _regroup(x: torch.Tensor, sizes: list, outer: int, inner: int) -> torch.Tensor:
    """Chunks of x laid out [outer][inner] (``sizes`` flat, row-major) → laid out [inner][outer]."""
    if outer == 1 or inner == 1:
        return x
    chunks = x.split(sizes)
    return torch.cat([chunks[o * inner + i] for i in range(inner) for o in range(outer)])


def dispatch_combine(tokens: torch.Tensor, gates: torch.Tensor, routing_map: torch.Tensor, experts,
                     group, chosen: torch.Tensor, k: int, side=None) -> tuple:
    """(Σ_e gates[t, e] · expert_e(tokens[t]) for each token t over its routes (module doc), side()).

    tokens [T, h]; gates [T, E] (fp32 or wider, zero off the routes); routing_map [T, E] bool;
    experts(x [N, h] sorted by local expert, counts [E_local] int64, expert_idx [N] each row's
    local expert, or None at EP > 1, blocks: at EP > 1 the rows of each (local expert, source rank)
    in x's order, expert-major, host ints) → [N, h]. chosen [T, E] bool: the k routes of each token
    before capacity dropping (EP = 1's fixed slots; routing_map ⊆ chosen). side: a callable of no
    arguments (the shared expert) or None; at EP > 1 it runs while the rows' all-to-all is in
    flight (started async_op, waited for after it), so the exchange hides behind its compute, and
    its backward while the reverse exchange of the rows' gradients is (module doc).
    Returns ([T, h] in tokens' dtype, side()'s result or None). Collective over ``group`` (the EP
    group; None at EP = 1).
    """
    T, E = routing_map.shape
    ep = group_size(group)
    if ep == 1:
        y = _local(tokens, gates, chosen, None if routing_map is chosen else routing_map, experts, k)
        return y, (side() if side is not None else None)
    local = E // ep
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)  # expert-major, then token
    rows = tokens.index_select(0, token_idx)
    counts = routing_map.sum(0)
    received = _exchange("all_to_all of the MoE token counts", torch.empty_like(counts), counts, None, None,
                         group)
    sent_list, recv_list = counts.tolist(), received.tolist()  # the one host read of the exchange
    send = [sum(sent_list[r * local:(r + 1) * local]) for r in range(ep)]
    recv = [sum(recv_list[r * local:(r + 1) * local]) for r in range(ep)]
    if side is None:
        x, side_out = all_to_all(rows, recv, send, group), None
    else:
        pending: list = []
        x = _AllToAllStart.apply(rows, recv, send, group, pending)
        side_out = side()  # overlaps the exchange
        x = _Wait.apply(x, pending, group, recv, send)
    x = _regroup(x, recv_list, ep, local)
    local_counts = received.view(ep, local).sum(0)
    by_expert = [recv_list[s * local + e] for e in range(local) for s in range(ep)]
    y = experts(x, local_counts, None, by_expert)
    y = all_to_all(_regroup(y, by_expert, local, ep), send, recv, group)
    return _combine(y, gates, token_idx, expert_idx, T), side_out


def _combine(y: torch.Tensor, gates: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor,
             T: int) -> torch.Tensor:
    """Σ over a token's routes of gate · expert output: y [N, h], indices [N] → [T, h] in y's dtype."""
    weighted = y.to(gates.dtype) * gates[token_idx, expert_idx].unsqueeze(1)
    out = torch.zeros((T, y.shape[1]), dtype=gates.dtype, device=y.device)
    return out.index_add(0, token_idx, weighted).to(y.dtype)


def permute(chosen: torch.Tensor, k: int, kept: torch.Tensor | None = None) -> tuple:
    """(perm, inv, expert_idx, counts, slot_expert) of chosen [T, E] bool with exactly k per row, no
    host read: perm [T·k] the token-major slots (t·k + j: token t's j-th expert, ascending) in
    expert-major order (by expert, then token), inv [T·k] its inverse, expert_idx [T·k] int64 the
    expert of each expert-major slot, counts [E] int64 slots per expert, slot_expert [T, k] the
    expert of each token-major slot. kept [T, E] bool ⊆ chosen (the routes the capacity kept) or
    None: a dropped slot's expert_idx is E (it sorts last) and counts count the kept slots only."""
    T, E = chosen.shape
    # contiguous: the gates' gather keeps this index for backward, and a view would keep the whole
    # [T, E] int64 sort result alive (8·T·E bytes a layer instead of 8·T·k)
    slot_expert = torch.sort(chosen.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k].contiguous()
    key = slot_expert if kept is None else torch.where(kept.gather(1, slot_expert), slot_expert, E)
    flat = key.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(T * k, device=perm.device))
    return perm, inv, flat.index_select(0, perm), (chosen if kept is None else kept).sum(0), slot_expert


class _Gather(torch.autograd.Function):
    """x.index_select(0, idx), whose backward is a gather too: g.index_select(0, back) summed over
    each ``group`` consecutive rows (back: the inverse of idx as a map of slots; no scatter)."""

    @staticmethod
    def forward(ctx, x, idx, back, group):
        ctx.save_for_backward(back)
        ctx.group = group
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        g = g.index_select(0, back)
        if ctx.group > 1:
            g = g.view(-1, ctx.group, g.shape[-1]).sum(1)
        return g, None, None, None


def _local(tokens, gates, chosen, kept, experts, k: int) -> torch.Tensor:
    """dispatch_combine at EP = 1, fixed shapes and no host read (module doc); kept: the routes the
    capacity kept, or None when nothing is dropped."""
    T, h = tokens.shape
    E = chosen.shape[1]
    perm, inv, expert_idx, counts, slot_expert = permute(chosen, k, kept)
    rows = _Gather.apply(tokens, torch.div(perm, k, rounding_mode="floor"), inv, k)
    if kept is None:
        out = experts(rows, counts, expert_idx)
    else:  # the dropped slots (key E, last) are past the GEMM's offsets: zero them both ways
        live = (expert_idx < E).unsqueeze(1)
        out = torch.where(live, experts(torch.where(live, rows, 0), counts, expert_idx), 0)
    y = _Gather.apply(out, inv, perm, 1).view(T, k, h)
    g = gates.gather(1, slot_expert)  # [T, k] in token-major slot order
    return (y.to(gates.dtype) * g.unsqueeze(2)).sum(1).to(tokens.dtype)
