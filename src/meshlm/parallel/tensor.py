"""Tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", §3) with sequence parallelism
(Korthikanti et al. 2022, §4.2.2), and full-weight helpers (the vocab-parallel cross-entropy is
in cross_entropy.py).

Activations are [s, b, h]. Under sequence parallelism (SP) the activations between TP regions
are [s/tp, b, h] (this rank's rows); a column-parallel layer all-gathers them, a row-parallel
layer reduce-scatters its output back to [s/tp, b, h].

Weights are layout-independent: each full weight is drawn from a generator seeded by its own key
(``ShardedInit``) and this rank keeps the rows (or columns) listed in ``partition_index``. Every
TP-split parameter carries:
  tensor_model_parallel = True, partition_dim (0 rows, 1 columns),
  partition_index: LongTensor, which rows/columns of the full weight this rank holds
                   (entries ≥ full_size are vocabulary padding, zero and never used),
  full_size: size of the full (TP=1, unpadded) weight along partition_dim.
``gather_full_state_dict`` and ``load_full_state_dict`` use them to convert between this rank's
shards and the full weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import at_least_fp32
from . import comm
from .fp8 import fp8_linear
from .random import derive_seed


def _zeros(n: int, dtype, device) -> nn.Parameter:
    """A bias of n zeros (``new_param``)."""
    return new_param(lambda: torch.zeros(n, dtype=dtype, device=device), (n,), dtype, device)


def contiguous_index(size: int, tp: int, rank: int) -> torch.Tensor:
    """Rows [rank·size/tp, (rank+1)·size/tp) of a dim of length size (divisible by tp)."""
    assert size % tp == 0, f"{size} rows do not split over TP {tp} (meshlm.validate checks this)"
    n = size // tp
    return torch.arange(rank * n, (rank + 1) * n)


@dataclass
class ShardedInit:
    """How a parallel layer draws its weight: normal(0, std) from a generator keyed by ``key``.

    full (--use-cpu-initialization, default): draw the full weight from derive_seed(*key) on the
    device the model lives on (a CUDA generator on the GPU, the CPU's otherwise) and keep this
    rank's slice, so the weight depends on the seed, the key and the device type, never on TP/PP.
    Otherwise draw only the local slice from derive_seed(*key, "tp_rank", tp_rank): lighter for
    very large weights, but the weights then depend on the TP degree.
    """

    key: tuple
    std: float
    full: bool = True
    tp_rank: int = 0

    def weight(self, full_shape, dim: int, index: torch.Tensor, dtype, device) -> torch.Tensor:
        """The local weight: full_shape with dim replaced by len(index); padding rows are zero."""
        shape, seed = list(full_shape), derive_seed(*self.key)
        if not self.full:
            shape[dim] = len(index)
            seed = derive_seed(*self.key, "tp_rank", self.tp_rank)
        g = torch.Generator(device=device).manual_seed(seed)
        w = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, self.std, generator=g)
        if self.full:
            return _take(w, dim, index.to(device)).to(dtype)
        padding = (index >= full_shape[dim]).nonzero().squeeze(1).to(device)
        return w.index_fill_(dim, padding, 0.0).to(dtype)


    def param(self, full_shape, dim: int, index: torch.Tensor, dtype, device) -> nn.Parameter:
        """The local weight (:meth:`weight`) as a parameter, drawn when ``new_param`` says."""
        shape = list(full_shape)
        shape[dim] = len(index)
        return new_param(lambda: self.weight(full_shape, dim, index, dtype, device), shape, dtype, device)


_deferring = [False]


@contextmanager
def deferred_init():
    """Inside, ``new_param`` makes placeholders: a parameter of the right shape, dtype and device
    over one element of storage (expanded), which keeps the function that draws its values. The
    DDP buffers (parallel/grad_buffer.py) draw each one straight into its bucket (``materialized``),
    so building never holds the rank's whole model beside the buffers, and under ZeRO-3 never holds
    it at all: each bucket is drawn, sharded and freed in turn (Megatron-LM's
    --init-model-with-meta-device). Until then only a placeholder's shape, dtype, device and
    attributes mean anything: an in-place write to it raises (its elements share one location)."""
    before, _deferring[0] = _deferring[0], True
    try:
        yield
    finally:
        _deferring[0] = before


def new_param(make: Callable[[], torch.Tensor], shape, dtype, device) -> nn.Parameter:
    """nn.Parameter(make()), or inside ``deferred_init`` a placeholder of ``shape`` that draws
    make() when ``materialized``. make: the values, a tensor of ``shape``, ``dtype`` on ``device``."""
    if not _deferring[0]:
        return nn.Parameter(make())
    p = nn.Parameter(torch.empty((), dtype=dtype, device=device).expand(tuple(shape)))
    p.materialize = make
    return p


def materialized(p: nn.Parameter) -> torch.Tensor:
    """p's values: drawn now for a placeholder of ``deferred_init`` (which the caller then points at
    real storage; ``del p.materialize`` after), else p's data."""
    make = getattr(p, "materialize", None)
    return p.data if make is None else make()


def _take(full: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """full.index_select(dim, index), where indices ≥ full.shape[dim] give zero (padding) rows
    (``full`` itself when index is every row in order)."""
    n = full.shape[dim]
    if len(index) == n and bool((index == torch.arange(n, device=index.device)).all()):
        return full  # every row in order (TP=1, no padding): no copy
    extra = int(index.max()) + 1 - n
    if extra <= 0:  # no padding row asked for: one copy, not two
        return full.index_select(dim, index)
    pad = list(full.shape)
    pad[dim] = extra
    return torch.cat([full, full.new_zeros(pad)], dim).index_select(dim, index)


def mark_partitioned(p: nn.Parameter, dim: int, index: torch.Tensor, full_size: int) -> nn.Parameter:
    """Set the TP attributes of p (see the module docstring); returns p."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_index = index
    p.full_size = full_size
    return p


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split over TP: weight [out/tp, in], partition_dim 0.

    x: [s, b, in] replicated (or [s/tp, b, in] under sequence_parallel: all-gathered first, its
    grad reduce-scattered). Output [s, b, out/tp], or [s, b, out] with gather_output.
    fp8: an Fp8Recipe makes the GEMMs FP8 (parallel/fp8.py; under SP x is gathered in its own dtype,
    and backward keeps the gathered x in FP8 rather than this rank's rows).
    rows: which rows of the full [out, in] weight this rank holds (default: a contiguous 1/tp).
    parts: a fused weight's logical tensors along the rows, ((module name, rows), …) in order, set
    as ``fused_parts`` on weight and bias (checkpoints store the logical tensors:
    checkpoint/model_space.py).
    """

    def __init__(self, input_size: int, output_size: int, ps, init: ShardedInit, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 rows: torch.Tensor | None = None, parts: tuple | None = None, params_dtype=torch.float32):
        super().__init__()
        rows = contiguous_index(output_size, ps.tp, ps.tp_rank) if rows is None else rows
        self.group, self.gather_output, self.sequence_parallel = ps.tp_group, gather_output, sequence_parallel
        self.weight = mark_partitioned(init.param((output_size, input_size), 0, rows, params_dtype, ps.device),
                                       0, rows, output_size)
        self.bias = None
        if bias:
            self.bias = mark_partitioned(_zeros(len(rows), params_dtype, ps.device), 0, rows, output_size)
            self.bias.no_weight_decay = True
        if parts:
            for p in self.parameters():
                p.fused_parts = parts
        self.fp8 = None  # an Fp8Recipe: FP8 GEMMs (parallel/fp8.py), set by model.chunks.apply_fp8
        self.fp8_state = None  # its DelayedState under --fp8-recipe delayed (parallel/fp8_delayed.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:  # under SP the bf16 rows are gathered, then quantized
            x = comm.gather_from_sp(x, self.group) if self.sequence_parallel else comm.copy_to_tp(x, self.group)
            y = fp8_linear(x, self.weight, self.fp8, self.group, x_split=False, state=self.fp8_state)
            y = y if self.bias is None else y + self.bias
        elif self.sequence_parallel and comm.group_size(self.group) > 1:
            y = _GatheredLinear.apply(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(comm.copy_to_tp(x, self.group), self.weight, self.bias)
        return comm.gather_from_tp(y, self.group) if self.gather_output else y


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather_s(x) Wᵀ + b, keeping only the shard x [s/tp, b, in] for backward, which
    all-gathers it again for the weight gradient (Korthikanti et al. 2022, §4.2.2; Megatron's
    LinearWithGradAccumulationAndAsyncCommunication). Saves (tp − 1)·s/tp·b·in elements a layer
    against saving the gathered input. Backward: dx = reduce_scatter_s(dy W), dW = dyᵀ·all_gather_s(x),
    db = Σ dy. y: [s, b, out/tp]."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(comm.all_gather(x, group, 0), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = comm.reduce_scatter(dy.matmul(weight), ctx.group, 0)
        total = comm.all_gather(x, ctx.group, 0)
        dw = dy.reshape(-1, dy.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias else None
        return dx, dw, db, None


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split over TP: weight [out, in/tp], partition_dim 1.

    x: [s, b, in/tp] (input_is_parallel) or [s, b, in] (then scattered). The partial products are
    all-reduced to [s, b, out], or reduce-scattered to [s/tp, b, out] under sequence_parallel; the
    replicated bias is added after the reduction (under SP its grad is partial: sequence_parallel).
    fp8: an Fp8Recipe makes the GEMMs FP8 (parallel/fp8.py).
    """

    def __init__(self, input_size: int, output_size: int, ps, init: ShardedInit, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 cols: torch.Tensor | None = None, params_dtype=torch.float32):
        super().__init__()
        cols = contiguous_index(input_size, ps.tp, ps.tp_rank) if cols is None else cols
        self.group, self.input_is_parallel, self.sequence_parallel = ps.tp_group, input_is_parallel, sequence_parallel
        self.weight = mark_partitioned(init.param((output_size, input_size), 1, cols, params_dtype, ps.device),
                                       1, cols, input_size)
        self.bias = None
        if bias:
            self.bias = _zeros(output_size, params_dtype, ps.device)
            self.bias.no_weight_decay = True
            self.bias.sequence_parallel = sequence_parallel
        self.fp8 = None  # an Fp8Recipe: FP8 GEMMs (parallel/fp8.py), set by model.chunks.apply_fp8
        self.fp8_state = None  # its DelayedState under --fp8-recipe delayed (parallel/fp8_delayed.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.group)
        if self.fp8 is not None:
            y = fp8_linear(x, self.weight, self.fp8, self.group, x_split=True, state=self.fp8_state)
        else:
            y = F.linear(x, self.weight)
        y = comm.reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else comm.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Word embedding with vocabulary rows split over TP: weight [V_padded/tp, h], partition_dim 0.

    Rank r holds rows [r·V_padded/tp, (r+1)·V_padded/tp); V_padded = config.padded_vocab_size(
    vocab, make_vocab_size_divisible_by, tp). Ids outside the slice look up zeros; the partial
    embeddings are all-reduced ([s, b, h]) or reduce-scattered under sequence_parallel ([s/tp, b, h]).
    ids: [s, b] int64 < vocab_size.
    """

    def __init__(self, vocab_size: int, padded_vocab: int, hidden: int, ps, init: ShardedInit, *,
                 sequence_parallel: bool = False, params_dtype=torch.float32):
        super().__init__()
        rows = contiguous_index(padded_vocab, ps.tp, ps.tp_rank)
        self.group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.vocab_start, self.local_vocab = int(rows[0]), len(rows)
        self.weight = mark_partitioned(init.param((vocab_size, hidden), 0, rows, params_dtype, ps.device),
                                       0, rows, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(out, self.group)
        return comm.reduce_from_tp(out, self.group)


# ----------------------------------------------------------------------------- full weights

@torch.no_grad()
def gather_full_state_dict(model: nn.Module, ps) -> dict:
    """{name: full (TP=1) CPU tensor, at least fp32} for every parameter, the same on every TP rank.

    Collective over ps.tp_group. TP-split parameters are all-gathered and put back in full order
    using partition_index (padding rows dropped); replicated ones are copied.
    """
    out = {}
    for name, p in model.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            out[name] = at_least_fp32(p.detach()).cpu().clone()
            continue
        dim = p.partition_dim
        shards = comm.all_gather(at_least_fp32(p.detach()).unsqueeze(0), ps.tp_group, 0).cpu()
        index = comm.all_gather(p.partition_index.to(ps.device).unsqueeze(0), ps.tp_group, 0).cpu()
        shape = list(p.shape)
        shape[dim] = p.full_size
        full = torch.zeros(shape, dtype=shards.dtype)
        for shard, idx in zip(shards, index):
            keep = idx < p.full_size
            full.index_copy_(dim, idx[keep], shard.index_select(dim, keep.nonzero().squeeze(1)))
        out[name] = full
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict) -> None:
    """Copy full (TP=1) weights into this rank's shards (inverse of gather_full_state_dict).

    Raises KeyError for a parameter missing from ``full``. Padding rows are set to zero.
    Persistent buffers that ``full`` holds (the MoE expert bias of a checkpoint) are copied too;
    those it lacks (a Hugging Face import) keep their values.
    """
    for name, p in model.named_parameters():
        src = full[name].to(device=p.device, dtype=p.dtype)
        if getattr(p, "tensor_model_parallel", False):
            src = _take(src, p.partition_dim, p.partition_index.to(p.device))
        p.copy_(src)
    persistent = model.state_dict(keep_vars=True)
    for name, b in model.named_buffers():
        if name in full and name in persistent:
            b.copy_(full[name].to(device=b.device, dtype=b.dtype))
