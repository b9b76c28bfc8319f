"""Causal self-attention split over TP by whole heads: fused QKV, GQA, RoPE, SDPA.

Full fused QKV weight layout (TP=1): rows [Q (a·d); K (g·d); V (g·d)], a query heads, g key/value
groups (query_groups), d head_dim. (Megatron-core interleaves Q/K/V per group instead; the
checkpoint converters reorder; checkpoints store Q, K and V as logical tensors, see
checkpoint/model_space.py.) Rank r owns query heads [r·a/tp, (r+1)·a/tp) — the matching rows
of Q and columns of the output projection — and:
- g ≥ tp: the g/tp groups those heads read, i.e. their K and V rows; no extra communication.
- g < tp: several ranks need the same group. Each rank holds a unique 1/tp of the [K; V] rows,
  computes that slice of k/v, and the slices are all-gathered over TP (backward reduce-scatters
  the grads, so each weight row gets the sum from every rank that used it). Every parameter stays
  uniquely sharded, so gradient norms and optimizer sharding need no special case.

``attention_mask``: the block-diagonal causal mask of packed documents (--reset-attention-mask,
data/packing.py's ``document_ids``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import mup
from ..config import head_dim, max_positions, query_groups, rotary_dim
from ..dtypes import at_least_fp32, wide
from ..parallel import comm, context
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, contiguous_index
from .norm import Norm


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, "RoFormer", §3.4), rotate-half (GPT-NeoX / HF)
    convention, from cos/sin tables built once for positions 0..max_positions-1.

    Partial rotary (--rotary-percent, Megatron-core RotaryEmbedding): the frequencies are
    base^(−2i/dim) for i < ceil(dim/2), with dim = ``rotary_dim`` (int(head_dim × percent)); the
    first r = 2·ceil(dim/2) dimensions of each head are rotated as pairs (j, j + r/2), the other
    head_dim − r pass through unchanged. Full rotary is dim = r = head_dim.

    Tables [s, 1, 1, head_dim] in ``wide(dtype)`` (fp32 for bf16/fp16 params, float64 stays
    float64), computed in float64: (cos, cos, 1) and (−sin, +sin, 0) over the two halves of the r
    rotated dimensions and the passed ones, so that with x split into (x1, x2, x3) the rotation is
    x·cos + (x2, x1, x3)·sin = (x1·cos − x2·sin, x2·cos + x1·sin, x3) — one formula for full and
    partial rotary (x3·1 + x3·0 is x3 exactly). The half swap is a cat: under torch.compile
    (torch 2.11) it fuses with the qkv split into one kernel, while a cat-free swap (flip of a
    [2, d/2] view) measured 0.46 ms a layer in backward and needs Inductor's coalescing analysis
    off to compile at all (bench/RESULTS.md, 2026-12-01).
    """

    def __init__(self, head_dim: int, base: float, max_positions: int, dtype, device,
                 rotary_dim: int | None = None):
        super().__init__()
        dim = rotary_dim or head_dim
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        self.rotated = 2 * inv_freq.numel()
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)[:, None, None, :]
        cos, sin = angles.cos(), angles.sin()
        passed = angles.new_zeros(angles.shape[:-1] + (head_dim - self.rotated,))
        wide_dtype = wide(dtype)
        self.register_buffer("cos", torch.cat([cos, cos, passed + 1], -1).to(device=device, dtype=wide_dtype),
                             persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin, passed], -1).to(device=device, dtype=wide_dtype),
                             persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [s, b, n, d] at positions 0..s-1, or at ``positions`` int64 [b, s] (--reset-position-ids)
        → same shape and dtype (computed in at least fp32)."""
        if positions is None:
            cos, sin = self.cos[:x.shape[0]], self.sin[:x.shape[0]]
        else:
            cos, sin = self.cos[:, 0][positions.t()], self.sin[:, 0][positions.t()]  # [s, b, 1, d]
        xf = at_least_fp32(x)
        half = self.rotated // 2
        parts = [xf[..., half:self.rotated], xf[..., :half]]
        if self.rotated < xf.shape[-1]:
            parts.append(xf[..., self.rotated:])
        return (xf * cos + torch.cat(parts, dim=-1) * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """x [s, b, h] ([s/tp, b, h] under SP) → [s, b, h] (or [s/tp, b, h]); heads split over TP.

    forward's ``positions`` int64 [b, s] feed RoPE (--reset-position-ids; default 0..s-1) and
    ``mask`` bool [b, 1, s, s] (True = attend; data/packing.py) replaces the causal mask
    (--reset-attention-mask).

    With --attention-dropout > 0 in training: on the fast path (meshlm/fast.py) one SDPA call whose
    dropout draws from the device's default generator (a per-TP-rank stream, as Megatron's); else
    one SDPA call per head with its own keyed stream (masks independent of TP), which is slower.
    Under --use-mup q is multiplied by ``mup.query_scale`` first, so every core attention (SDPA,
    per head, CP's ring) scales the logits by μP's softmax scale instead of 1/√d.
    recompute_core: selective recompute (model/recompute.py): core attention re-runs in backward.

    Under context parallelism (ps.cp > 1) x holds this CP rank's two sequence chunks
    (parallel/context.py), ``positions`` their global positions, and ``mask`` is instead the whole
    sequence's document_ids int64 [b, s] (or None): core attention is ``context.attention`` over
    ps.cp_group with --cp-comm-type (attention dropout 0: checked by meshlm.validate).
    """

    def __init__(self, cfg, ps, layer: int, init, scaled_init, rng, *, sequence_parallel: bool,
                 params_dtype, fast: bool = False, recompute_core: bool = False):
        super().__init__()
        self.recompute_core = recompute_core
        a, g, d, tp, r = cfg.num_attention_heads, query_groups(cfg), head_dim(cfg), ps.tp, ps.tp_rank
        self.layer, self.rng, self.group = layer, rng, ps.tp_group
        self.cp_group = ps.cp_group if ps.cp > 1 else None
        self.cp_comm_type = cfg.cp_comm_type
        self.heads, self.groups, self.d = a // tp, g, d
        self.first_head = r * self.heads
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = Rotary(d, cfg.rotary_base, max(max_positions(cfg), cfg.seq_length), params_dtype,
                                 ps.device, rotary_dim(cfg))
        self.dropout, self.fast = cfg.attention_dropout, fast
        self.query_scale = mup.query_scale(cfg)  # 1.0 unless μP's softmax scale (meshlm/mup.py)
        q_rows = contiguous_index(a * d, tp, r)
        if g >= tp:
            self.kv_gather, self.local_groups = False, g // tp
            k_rows = a * d + contiguous_index(g * d, tp, r)
            kv_rows = torch.cat([k_rows, k_rows + g * d])
        else:  # 2·g·d % tp == 0: checked by meshlm.validate
            self.kv_gather, self.local_groups = True, 1
            self.group_of_rank = r // (tp // g)
            kv_rows = a * d + contiguous_index(2 * g * d, tp, r)
        bias = cfg.add_bias_linear
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size, (a + 2 * g) * d, ps, init("self_attention.linear_qkv.weight"),
            bias=bias or cfg.add_qkv_bias,
            sequence_parallel=sequence_parallel, rows=torch.cat([q_rows, kv_rows]),
            parts=(("linear_q", a * d), ("linear_k", g * d), ("linear_v", g * d)), params_dtype=params_dtype)
        self.linear_proj = RowParallelLinear(
            a * d, cfg.hidden_size, ps, scaled_init("self_attention.linear_proj.weight"), bias=bias,
            sequence_parallel=sequence_parallel, cols=q_rows, params_dtype=params_dtype)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # over each head's d features; a TP rank sees its heads only (Norm's tp_group)
            self.q_layernorm, self.k_layernorm = (Norm(cfg, False, params_dtype, ps.device, size=d, tp_group=ps.tp_group)
                                                  for _ in range(2))

    def _split_qkv(self, qkv):
        s, b, _ = qkv.shape
        d, nq = self.d, self.heads
        q, kv = qkv.split([nq * d, qkv.shape[-1] - nq * d], dim=-1)
        if self.kv_gather:
            kv = comm.gather_reduce_tp(kv, self.group)  # [s, b, 2·g·d], every group
            k_start = self.group_of_rank * d
            v_start = self.groups * d + k_start
            k, v = kv[..., k_start:k_start + d], kv[..., v_start:v_start + d]
        else:
            k, v = kv.chunk(2, dim=-1)
        nkv = self.local_groups
        return q.reshape(s, b, nq, d), k.reshape(s, b, nkv, d), v.reshape(s, b, nkv, d)

    def forward(self, x: torch.Tensor, call: int, positions=None, mask=None) -> torch.Tensor:
        q, k, v = self._split_qkv(self.linear_qkv(x))
        if self.q_layernorm is not None:  # --qk-layernorm: before RoPE, as Megatron-core and Qwen3
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.query_scale != 1.0:  # SDPA's 1/√d becomes --use-mup's softmax scale, in every core
            q = q * self.query_scale
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if self.recompute_core and self.training:
            out = checkpoint(self._core, q, k, v, call, mask, use_reentrant=False)
        else:
            out = self._core(q, k, v, call, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.d)
        return self.linear_proj(out)

    def _core(self, q, k, v, call, mask=None):
        """Core attention: q [b, n, s, d], k/v [b, n_kv, s, d] → softmax(qkᵀ/√d + causal or ``mask``)·v
        [b, n, s, d]."""
        if self.cp_group is not None:
            return context.attention(q, k, v, self.cp_group, self.cp_comm_type, mask)
        p = self.dropout if self.training else 0.0
        if p == 0.0 or self.fast:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        return torch.cat([self._head_with_dropout(q, k, v, i, p, call, mask) for i in range(self.heads)], dim=1)

    def _head_with_dropout(self, q, k, v, i, p, call, mask):
        """Head i alone, its attention dropout drawn from its own keyed stream (parallel/random.py)."""
        kv = i // (self.heads // k.shape[1])
        # contiguous: same memory layout in every TP layout, so SDPA picks the same kernel (and mask)
        q, k, v = (t[:, j:j + 1].contiguous() for t, j in ((q, i), (k, kv), (v, kv)))
        with self.rng.fork(self.rng.head_stream(self.first_head + i), self.layer, "attention", call):
            return _ContiguousGrad.apply(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                                        is_causal=mask is None))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the grad contiguous: CUDA flash attention's dropout backward
    (torch 2.11) gives different results for differently strided grads, and the stride of a head's
    grad slice depends on how many heads this rank holds."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids int64 [b, s] → bool [b, 1, s, s], True where query i may attend to key j:
    j ≤ i and both in one document (SDPA's boolean convention; Megatron's mask is its negation)."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]
