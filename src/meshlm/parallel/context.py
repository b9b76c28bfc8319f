"""Context parallelism: one sequence split over the CP group, causal attention across it.

Load-balanced split (Megatron-core ``get_batch_on_this_cp_rank``; Llama 3, arXiv 2407.21783
§3.3.2): the sequence of length s is cut into 2·CP chunks of c = s/(2·CP) tokens and CP rank r
holds chunks r and 2·CP−1−r, in that order, so every rank has the same causal-attention work
(a query chunk i costs ∝ i + ½). Tokens, labels, loss mask and position ids follow the split
(``split_batch``); positions are the true ones, so RoPE and learned positions see what one
process sees.

Attention (``attention``) over the two held chunks, with the keys/values of all 2·CP chunks:

- ``p2p`` (ring; Liu et al. 2023, arXiv 2310.01889): K/V of rank r − i arrive at step i while the
  block already held is attended. With the zigzag split, step 0 is plain causal attention over
  the local 2c rows; a block from rank src < r is attended by all local queries through its
  first chunk only; from src > r, by the second local query chunk through both chunks — no
  masked work. The backward sends K/V round the ring again, each with a dK/dV accumulator that
  every rank adds to and passes on; after CP hops it is back at its owner.
- ``all_gather``: K/V of every rank gathered (cheap with GQA), each local query chunk i attends
  chunks < i fully and chunk i causally; the backward re-gathers and reduce-scatters dK/dV.

Every piece is one attention call returning (out, lse); pieces merge through their log-sum-exp
in at least fp32 (``_merge``). A piece is only ever a full block or a causal diagonal block, so no
row of it is fully masked; with packed documents (--reset-attention-mask) a piece carries the
document mask and a fully masked row has lse −inf and weight 0 (never the 0 a fused kernel would
return). The backward of each piece is taken against the merged output and lse (Dao 2023,
FlashAttention-2, Alg. 2): P = exp(S − lse), dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)),
dQ = dS·K/√d, dK = dSᵀ·Q/√d. On CUDA with bf16/fp16 and no document mask the pieces run a fused
kernel that returns the lse: cuDNN's (``aten._scaled_dot_product_cudnn_attention`` and its
backward; the backend public SDPA picks on Hopper) where it runs this head size, else the flash
kernels (``aten._scaled_dot_product_flash_attention``); elsewhere the matmul form below, computed
in ``wide(dtype)`` (float64 stays float64).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..dtypes import HALF, wide
from ..fast import eager
from . import comm, watchdog

COMM_TYPES = ("p2p", "all_gather")


# ----------------------------------------------------------------------------- the split

def local_positions(cp: int, rank: int, seq_length: int, device=None) -> torch.Tensor:
    """int64 [s/cp]: the global positions CP rank ``rank`` holds, chunks r then 2·cp−1−r of
    2·cp chunks of seq_length/(2·cp) (seq_length % (2·cp) == 0: checked by meshlm.validate)."""
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def split_batch(batch: dict, cp: int, rank: int) -> dict:
    """One micro-batch {"tokens", "labels", "loss_mask", ["position_ids"], ["document_ids"]: [b, s]}
    → this CP rank's part: every [b, s] tensor becomes [b, s/cp] at ``local_positions``, and
    "position_ids" is added (0..s−1 when the batch has none) so positions stay global.
    "document_ids" stays whole [b, s]: the attention reads the documents of every chunk."""
    if cp == 1:
        return batch
    b, s = batch["tokens"].shape
    keep = local_positions(cp, rank, s)
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s).expand(b, s)
    for key, t in out.items():
        if key != "document_ids":
            out[key] = t[:, keep].contiguous()
    return out


def split_batches(batches, ps):
    """The micro-batches of an iterable, each through ``split_batch`` for this rank of
    ParallelState ps (the iterable itself when CP = 1)."""
    if ps.cp == 1:
        return batches
    return (split_batch(batch, ps.cp, ps.cp_rank) for batch in batches)


def sequence_loss_tokens(loss_mask: torch.Tensor, ps) -> torch.Tensor:
    """Loss tokens of one micro-batch over the whole sequence: sum(loss_mask) [b, s/cp] summed over
    the CP group (no autograd), ≥ 1 — so a CP rank whose tokens are all masked divides 0 by the
    sequence's count, never 0 by 0 (Megatron#1764)."""
    n = loss_mask.sum()
    if ps.cp > 1:
        n = comm.all_reduce(n.clone(), ps.cp_group, kind="cp")  # CP's cost, not TP's (meshlm analyze)
    return n.clamp(min=1)


# ----------------------------------------------------------------------------- one piece

def _allowed(pos_q, pos_k, docs):
    """bool [b, 1, sq, sk]: key j visible to query i (same document and pos_k ≤ pos_q)."""
    d_q, d_k = docs[:, pos_q], docs[:, pos_k]
    same = d_q[:, :, None] == d_k[:, None, :]
    return (same & (pos_k[None, :] <= pos_q[:, None]))[:, None]


KERNELS = ["cudnn", "flash"]  # the fused kernels the pieces try, in order (bench/cp_attention.py sets it)
_RUNS: dict = {}  # (kernel, dtype, head dim, causal, device) → whether the kernel ran a tiny piece


def _kernel(q, mask, causal: bool):
    """The fused kernel for a piece: "cudnn", "flash", or None (the matmul form: CPU, float32/64,
    or a document mask). cuDNN is taken where a tiny forward and backward of this dtype, head size
    and causality ran once in this process (its plans do not cover every head size and GPU)."""
    if not (q.is_cuda and q.dtype in HALF and mask is None):
        return None
    for name in KERNELS:
        if name == "flash":
            return name
        key = (name, q.dtype, q.shape[-1], causal, q.device)
        if key not in _RUNS:
            _RUNS[key] = _cudnn_runs(q, causal)
        if _RUNS[key]:
            return name
    return None


def _cudnn_runs(q, causal: bool) -> bool:
    t = torch.randn(1, 1, 64, q.shape[-1], device=q.device, dtype=q.dtype)
    try:
        out, lse, state = _cudnn_forward(t, t, t, causal)
        _cudnn_backward(torch.ones_like(t), t, t, t, out.to(t.dtype), lse, causal, state)
        torch.cuda.synchronize(q.device)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _cudnn_forward(q, k, v, causal):
    """cuDNN attention with its lse ([b, n, sq, 1] fp32 → [b, n, sq]); state for the backward."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal)
    return out.float(), lse.view(lse.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, causal, state):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *(t.contiguous() for t in (dout, q, k, v, out)), lse.float().unsqueeze(-1).contiguous(), seed, offset,
        None, cum_q, cum_k, max_q, max_k, 0.0, causal)


def _expand(t, heads):
    """K/V [b, g, s, d] → [b, heads, s, d] (each group repeated for its query heads)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t, groups):
    """dK/dV [b, heads, s, d] → [b, groups, s, d]: the sum over each group's query heads."""
    b, n, s, d = t.shape
    return t if n == groups else t.view(b, groups, n // groups, s, d).sum(2)


def _scores(q, k, causal, mask):
    w = wide(q.dtype)
    s = (q.to(w) @ _expand(k, q.shape[1]).to(w).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    elif causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _finite(lse):
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def piece_forward(q, k, v, causal: bool, mask=None):
    """softmax(q·kᵀ/√d + mask)·v of one piece: q [b, n, sq, d], k/v [b, g, sk, d] (g | n), causal
    (top-left, sq == sk) or ``mask`` bool [b, 1, sq, sk] (True = attend) → (out [b, n, sq, d] in
    ``wide(q.dtype)``, lse [b, n, sq] natural log in ``wide``; −inf on a row that sees no key,
    kernel state for ``piece_backward``: None, or (the fused kernel's name, its outputs the backward
    takes))."""
    kernel, n = _kernel(q, mask, causal), q.shape[1]
    if kernel == "cudnn":
        out, lse, state = _cudnn_forward(q, _expand(k, n), _expand(v, n), causal)
        return out, lse, (kernel, state)
    if kernel == "flash":
        out, lse, cum_q, cum_k, _, _, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), _expand(k, n).contiguous(), _expand(v, n).contiguous(), 0.0, causal)
        return out.float(), lse, (kernel, (cum_q, cum_k, rng, unused))
    s = _scores(q, k, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return p @ _expand(v, q.shape[1]).to(s.dtype), lse, None


def piece_backward(dout, q, k, v, out, lse, causal: bool, mask=None, state=None):
    """Grads of one piece given the *merged* out [b, n, sq, d] (q's dtype) and lse [b, n, sq], and
    the piece's kernel ``state`` from piece_forward: (dq [b, n, sq, d], dk, dv [b, g, sk, d]) in
    ``wide(q.dtype)``."""
    n, g = q.shape[1], k.shape[1]
    if state is not None:
        kernel, outputs = state
        if kernel == "cudnn":
            dq, dk, dv = _cudnn_backward(dout, q, _expand(k, n), _expand(v, n), out, lse, causal, outputs)
        else:
            cum_q, cum_k, rng, unused = outputs
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                *(t.contiguous() for t in (dout, q, _expand(k, n), _expand(v, n), out, lse)), cum_q, cum_k,
                q.shape[2], k.shape[2], 0.0, causal, rng, unused)
        return dq.float(), _fold(dk.float(), g), _fold(dv.float(), g)
    s = _scores(q, k, causal, mask)
    w = s.dtype
    p = torch.exp(s - _finite(lse.to(w))[..., None])
    do = dout.to(w)
    dv = p.transpose(-1, -2) @ do
    dp = do @ _expand(v, n).to(w).transpose(-1, -2)
    ds = p * (dp - (do * out.to(w)).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    dq = ds @ _expand(k, n).to(w)
    dk = ds.transpose(-1, -2) @ q.to(w)
    return dq, _fold(dk, g), _fold(dv, g)


def _merge(acc_out, acc_lse, rows, out, lse):
    """Fold one piece's (out, lse) into the accumulators at query ``rows`` (a slice), in place:
    L = logaddexp(L_a, L_b), O = O_a·exp(L_a − L) + O_b·exp(L_b − L) (−inf rows stay 0)."""
    la, oa = acc_lse[..., rows], acc_out[..., rows, :]
    lse = lse.to(la.dtype)
    new = torch.logaddexp(la, lse)
    safe = _finite(new)
    acc_out[..., rows, :] = oa * torch.exp(la - safe)[..., None] + out * torch.exp(lse - safe)[..., None]
    acc_lse[..., rows] = new


# ----------------------------------------------------------------------------- pieces of each scheme

def _ring_pieces(r: int, src: int, c: int) -> list:
    """(q rows, k rows, causal) of the block from rank ``src`` at rank r, as slices of the local
    2c rows and of the block's 2c rows (module doc)."""
    whole = slice(0, 2 * c)
    if src == r:
        return [(whole, whole, True)]
    if src < r:
        return [(whole, slice(0, c), False)]
    return [(slice(c, 2 * c), whole, False)]


def _gather_pieces(cp: int, r: int, c: int) -> list:
    """(q rows, k rows, causal) of the local chunks against all 2·cp chunks in natural order."""
    pieces = []
    for slot, chunk in ((0, r), (1, 2 * cp - 1 - r)):
        rows = slice(slot * c, (slot + 1) * c)
        if chunk:
            pieces.append((rows, slice(0, chunk * c), False))
        pieces.append((rows, slice(chunk * c, (chunk + 1) * c), True))
    return pieces


class _Pieces:
    """The pieces of one block: attends them (forward) or takes their grads (backward), with the
    document mask from the global positions when ``docs`` (int64 [b, s]) is given. ``states``: a
    list shared by a forward and its backward, the pieces' kernel states in call order."""

    def __init__(self, pieces, pos_q, pos_k, docs, states: list):
        self.pieces, self.pos_q, self.pos_k, self.docs, self.states = pieces, pos_q, pos_k, docs, states

    def _mask(self, qs, ks):
        return None if self.docs is None else _allowed(self.pos_q[qs], self.pos_k[ks], self.docs)

    def forward(self, q, k, v, acc_out, acc_lse):
        for qs, ks, causal in self.pieces:
            out, lse, state = piece_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], causal,
                                            self._mask(qs, ks))
            self.states.append(state)
            _merge(acc_out, acc_lse, qs, out, lse)

    def backward(self, dout, q, k, v, out, lse, dq, dkv):
        for qs, ks, causal in self.pieces:
            a, b, c = piece_backward(dout[..., qs, :], q[..., qs, :], k[..., ks, :], v[..., ks, :],
                                     out[..., qs, :], lse[..., qs], causal, self._mask(qs, ks),
                                     self.states.pop(0))
            dq[..., qs, :] += a
            dkv[0][..., ks, :] += b
            dkv[1][..., ks, :] += c


def _accumulators(q):
    w = wide(q.dtype)
    return (torch.zeros(q.shape, dtype=w, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=w, device=q.device))


def _lse_for_backward(q, lse):
    """The merged lse as the piece kernels take it: fp32 for the fused (cuDNN, flash) kernels."""
    return lse.float() if q.is_cuda and q.dtype in HALF else lse


# ----------------------------------------------------------------------------- ring (p2p)

def _exchange(t: torch.Tensor, group, ranks: list, r: int):
    """Start sending t to the next rank of the ring and receiving the previous rank's: (buffer, reqs)."""
    p = len(ranks)
    buf = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, ranks[(r + 1) % p], group),
           dist.P2POp(dist.irecv, buf, ranks[(r - 1) % p], group)]
    return buf, dist.batch_isend_irecv(ops)


def _wait(reqs, group, ranks: list, r: int, device):
    """Wait for a ring exchange, watched (the two neighbours) and timed as "cp"."""
    p = len(ranks)
    watchdog.enter("cp ring K/V exchange", group, tuple(dict.fromkeys((ranks[(r + 1) % p], ranks[(r - 1) % p]))))
    start = comm.begin_timed(device)
    try:
        for req in reqs:
            req.wait()
    finally:
        watchdog.leave()
    comm.end_timed("cp", start, device)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, docs):
        ranks, r = dist.get_process_group_ranks(group), dist.get_rank(group)
        p, c = len(ranks), q.shape[2] // 2
        pos = [local_positions(p, i, 2 * p * c, q.device) for i in range(p)]
        kv = torch.stack([k, v]).contiguous()
        acc_out, acc_lse = _accumulators(q)
        ctx.states = []
        for i in range(p):
            src = (r - i) % p
            if i < p - 1:
                incoming, reqs = _exchange(kv, group, ranks, r)
            _Pieces(_ring_pieces(r, src, c), pos[r], pos[src], docs, ctx.states).forward(
                q, kv[0], kv[1], acc_out, acc_lse)
            if i < p - 1:
                _wait(reqs, group, ranks, r, q.device)
                kv = incoming
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse, docs)
        ctx.group, ctx.ranks, ctx.r, ctx.pos = group, ranks, r, pos
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        group, ranks, r, pos = ctx.group, ctx.ranks, ctx.r, ctx.pos
        p, c = len(ranks), q.shape[2] // 2
        dout, lse = dout.contiguous(), _lse_for_backward(q, lse)
        w = wide(q.dtype)
        dq = torch.zeros(q.shape, dtype=w, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=w, device=q.device)
        for i in range(p):
            src = (r - i) % p
            if i < p - 1:
                incoming, reqs = _exchange(kv, group, ranks, r)
            _Pieces(_ring_pieces(r, src, c), pos[r], pos[src], docs, ctx.states).backward(
                dout, q, kv[0], kv[1], out, lse, dq, dkv)
            dkv, dreqs = _exchange(dkv, group, ranks, r)  # after CP hops back at its owner
            _wait(dreqs + (reqs if i < p - 1 else []), group, ranks, r, q.device)
            if i < p - 1:
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# ----------------------------------------------------------------------------- all-gather

def _natural_order(cp: int) -> torch.Tensor:
    """For each chunk 0..2·cp−1 in sequence order, its index in the all-gathered (rank-order) layout,
    where rank j contributed chunks j then 2·cp−1−j."""
    where = {}
    for j in range(cp):
        where[j], where[2 * cp - 1 - j] = 2 * j, 2 * j + 1
    return torch.tensor([where[t] for t in range(2 * cp)])


def _gather_kv(k, v, group, cp):
    """K/V of every rank, [2, b, g, s, d] in sequence order."""
    kv = comm.all_gather(torch.stack([k, v]), group, dim=3, kind="cp")
    two, b, g, s, d = kv.shape
    order = _natural_order(cp).to(kv.device)
    return kv.view(two, b, g, 2 * cp, s // (2 * cp), d)[:, :, :, order].reshape(two, b, g, s, d)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, docs):
        p, r, c = dist.get_world_size(group), dist.get_rank(group), q.shape[2] // 2
        kv = _gather_kv(k, v, group, p)
        pieces = _Pieces(_gather_pieces(p, r, c), local_positions(p, r, 2 * p * c, q.device),
                         torch.arange(2 * p * c, device=q.device), docs, [])
        acc_out, acc_lse = _accumulators(q)
        pieces.forward(q, kv[0], kv[1], acc_out, acc_lse)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.pieces = group, pieces
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, p = ctx.group, dist.get_world_size(ctx.group)
        kv = _gather_kv(k, v, group, p)
        w = wide(q.dtype)
        dq = torch.zeros(q.shape, dtype=w, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=w, device=q.device)
        ctx.pieces.backward(dout.contiguous(), q, kv[0], kv[1], out, _lse_for_backward(q, lse), dq, dkv)
        two, b, g, s, d = dkv.shape
        inverse = torch.argsort(_natural_order(p)).to(dkv.device)
        dkv = dkv.view(two, b, g, 2 * p, s // (2 * p), d)[:, :, :, inverse].reshape(two, b, g, s, d)
        dkv = comm.reduce_scatter(dkv, group, dim=3, kind="cp")
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


@eager  # ring p2p inside: compiled layers (--fast-path) run it eagerly
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, comm_type: str = "p2p",
              document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence split on ``group``.

    q [b, n, 2c, d], k/v [b, g, 2c, d] (GQA: g divides n): the rows of chunks r and 2·CP−1−r
    (``local_positions``); document_ids int64 [b, s] of the whole sequence, or None (one document).
    Returns [b, n, 2c, d] in q's dtype, softmax(q·kᵀ/√d + causal/document mask)·v — what one process
    computes for these rows (dropout 0). comm_type: "p2p" (ring) or "all_gather" (module doc).
    Collective over the group: every CP rank calls it with the same shapes.
    """
    scheme = {"p2p": _Ring, "all_gather": _AllGather}[comm_type]
    return scheme.apply(q, k, v, group, document_ids)
