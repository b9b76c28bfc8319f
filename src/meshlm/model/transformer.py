"""GPTModel: a pre-norm decoder, GPT-2 or Llama flavoured by the ModelConfig fields.

GPT: learned absolute positions, LayerNorm, GeLU, biases. Llama: --position-embedding-type rope,
--normalization RMSNorm, --swiglu, --group-query-attention, --disable-bias-linear. Layout inside is
[s, b, h] ([s/tp, b, h] between TP regions under sequence parallelism).

Parameter names follow Megatron-core (embedding.word_embeddings, layers.<global index>.
self_attention.linear_qkv, …, final_layernorm, output_layer) and are the same in every layout.

Initialisation (Megatron): normal(0, init_method_std) for embeddings, linears and the output
layer; the attention and MLP output projections use std / sqrt(2 · num_layers) (GPT-2 §2.3;
Megatron "scaled_init_method_normal"); biases and norm shifts 0, norm scales 1. Under --use-mup
(meshlm/mup.py, Tensor Programs V Table 8) the hidden matrices' std is divided by √(width
multiplier) and their parameters carry ``lr_mult`` = 1/width multiplier (read by optim/), the
embedding output is multiplied by --mup-embedding-mult and the logits by the output multiplier.
Each full weight is drawn from a generator keyed by (seed, global layer index, parameter name) and sliced (see
parallel/tensor.py ShardedInit), so TP=1 and TP=k start identical.

Dropout follows parallel/random.py: identical masks in every layout, except attention dropout on
the fast path (meshlm/fast.py), which draws one per-TP-rank stream as Megatron does.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import mup
from ..config import max_positions, moe_layer_pattern, padded_vocab_size
from ..fast import compile_module
from ..parallel import comm
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.context import local_positions
from ..parallel.random import RNGTracker
from ..parallel.tensor import ShardedInit, VocabParallelEmbedding, contiguous_index, mark_partitioned
from .attention import SelfAttention, attention_mask
from .mlp import MLP
from .moe import MoELayer, MoEState, forward_pass
from .norm import Norm
from .recompute import Recompute

EMBEDDING_KEY = (-1, "embedding.word_embeddings.weight")  # (layer, name) of the word embedding


class SequenceSlice:
    """Which rows of the sequence this rank holds: all of them, s/tp under SP, and of those the
    two chunks of its CP rank under CP (parallel/context.py ``local_positions``)."""

    def __init__(self, ps, sequence_parallel: bool):
        self.tp, self.rank = (ps.tp, ps.tp_rank) if sequence_parallel else (1, 0)
        self.cp, self.cp_rank, self.device = ps.cp, ps.cp_rank, ps.device

    def rows(self, local_rows: int) -> tuple:
        """(the CP rank's sequence length s/cp, this rank's first row of it)."""
        return local_rows * self.tp, local_rows * self.rank

    def dropout_rows(self, local_rows: int) -> tuple:
        """(full sequence length s, this rank's rows of it: a slice, or under CP int64 positions)
        for a replicated-region dropout mask (parallel/random.py)."""
        rows, first = self.rows(local_rows)
        if self.cp == 1:
            return rows, slice(first, first + local_rows)
        positions = local_positions(self.cp, self.cp_rank, rows * self.cp, self.device)
        return rows * self.cp, positions[first:first + local_rows]


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))). x: [s, b, h] or [s/tp, b, h].

    fast: the forward runs under torch.compile (meshlm/fast.py); ``call`` is read only when
    dropout is on, so with dropout 0 the compiled code never depends on it. recompute_core:
    selective recompute of core attention (model/recompute.py).

    Hidden dropout on the fast path, when each TP rank holds its own rows (TP = 1, or under SP),
    is ``F.dropout`` on the default generator (one stream per TP rank, Megatron's model-parallel
    RNG), which torch.compile fuses; the keyed streams of parallel/random.py cannot be traced and
    would split each compiled layer. Without SP at TP > 1 the residual stream is replicated over TP,
    so its masks must agree across TP ranks: the keyed streams stay.

    moe_state: the chunk's MoEState when this layer's MLP is a mixture of experts (model/moe.py;
    compiled too: at EP = 1 one graph, the losses' attachment and statistics traced; at EP > 1
    the all-to-all's host read of the counts splits it).
    """

    def __init__(self, cfg, ps, layer: int, init, scaled_init, rng, seq: SequenceSlice, *,
                 sequence_parallel: bool, params_dtype, fast: bool = False, recompute_core: bool = False,
                 moe_state: MoEState | None = None):
        super().__init__()
        self.layer, self.rng, self.seq, self.p = layer, rng, seq, cfg.hidden_dropout
        self.plain_dropout = fast and (ps.tp == 1 or sequence_parallel)
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.input_layernorm = Norm(cfg, sequence_parallel, params_dtype, ps.device)
        self.self_attention = SelfAttention(cfg, ps, layer, init, scaled_init, rng, fast=fast,
                                            recompute_core=recompute_core, **kw)
        self.pre_mlp_layernorm = Norm(cfg, sequence_parallel, params_dtype, ps.device)
        self.mlp = MLP(cfg, ps, init, scaled_init, **kw) if moe_state is None else \
            MoELayer(cfg, ps, layer, init, scaled_init, moe_state, **kw)

        if fast:
            compile_module(self)

    def forward(self, x: torch.Tensor, call: int, positions=None, mask=None) -> torch.Tensor:
        """positions, mask: see SelfAttention (None: 0..s-1 and causal)."""
        h = self.self_attention(self.input_layernorm(x), call, positions, mask)
        x = x + self._dropout(h, "attention_out", call)
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)), "mlp_out", call)

    def _dropout(self, h: torch.Tensor, site: str, call: int) -> torch.Tensor:
        if not (self.p and self.training):
            return h
        if self.plain_dropout:
            return F.dropout(h, self.p)
        return self.rng.dropout(h, self.p, (self.layer, site, call), *self.seq.dropout_rows(h.shape[0]))


def _run_layers(layers: list, x: torch.Tensor, call: int, positions=None, mask=None,
                moe_state: MoEState | None = None) -> torch.Tensor:
    """x through consecutive layers (one unit of full recompute; ``moe.forward_pass`` tells the MoE
    layers of moe_state whether it is the recompute, which records no routing statistics)."""
    with forward_pass(moe_state) if moe_state is not None else contextlib.nullcontext():
        for layer in layers:
            x = layer(x, call, positions, mask)
    return x


class Embedding(nn.Module):
    """tokens [b, s] → [s, b, h] ([s/tp, b, h] under SP): vocab-parallel words + learned positions,
    then hidden dropout (``F.dropout`` on the fast path where each TP rank holds its own rows, as in
    TransformerLayer; keyed otherwise)."""

    def __init__(self, cfg, ps, vocab_size, padded_vocab, init, rng, seq, *, sequence_parallel, params_dtype,
                 fast: bool = False):
        super().__init__()
        self.rng, self.seq, self.p = rng, seq, cfg.hidden_dropout
        self.mult = mup.embedding_mult(cfg)
        self.plain_dropout = fast and (ps.tp == 1 or sequence_parallel)
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, padded_vocab, cfg.hidden_size, ps, init(*EMBEDDING_KEY),
            sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            n = max_positions(cfg)
            w = init(-1, "embedding.position_embeddings.weight").param(
                (n, cfg.hidden_size), 0, torch.arange(n), params_dtype, ps.device)
            self.position_embeddings = nn.Embedding(n, cfg.hidden_size, _weight=w)
            self.position_embeddings.weight = w  # the parameter itself: a deferred one keeps how to draw it
            self.position_embeddings.weight.sequence_parallel = sequence_parallel

    def forward(self, tokens: torch.Tensor, call: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions: int64 [b, s] (--reset-position-ids), default 0..s-1."""
        x = self.word_embeddings(tokens.t())
        _, offset = self.seq.rows(x.shape[0])
        if self.position_embeddings is not None and positions is not None:
            x = x + self.position_embeddings(positions[:, offset:offset + x.shape[0]].t())
        elif self.position_embeddings is not None:  # read through the module: see OutputLayer
            rows = torch.arange(offset, offset + x.shape[0], device=x.device)
            x = x + self.position_embeddings(rows).unsqueeze(1)
        if self.mult != 1.0:
            x = x * self.mult
        p = self.p if self.training else 0.0
        if self.plain_dropout:
            return F.dropout(x, p) if p else x
        return self.rng.dropout(x, p, (-1, "embedding", call), *self.seq.dropout_rows(x.shape[0]))


class OutputLayer(nn.Module):
    """x [s, b, h] → logits [s, b, V_padded/tp]; ``mask_padding`` sets the padded vocabulary
    columns to −inf (the loss excludes them itself, without that pass over the logits).

    Owns the output weight [V_padded/tp, h] (untied, or the last stage's copy of a tied embedding
    when PP > 1); with tied embeddings on one stage it owns none and the caller passes the word
    embedding (``GPTModel.output_weight()``), which the embedding's forward has already read. So
    every parameter is first read inside the forward of a block that contains it, and a forward
    pre-hook there is a safe place to wait for it (ZeRO-1 --overlap-param-gather waits there).
    """

    def __init__(self, weight: nn.Parameter | None, padded_logits: torch.Tensor):
        super().__init__()
        if weight is not None:
            self.weight = weight
        self.register_buffer("padded_logits", padded_logits, persistent=False)
        self.has_padding = bool(padded_logits.any())
        self.valid = int((~padded_logits).sum())  # real vocabulary columns: the first ones

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V_padded/tp] with the padded columns at −inf (a copy when there are any)."""
        return logits.masked_fill(self.padded_logits, float("-inf")) if self.has_padding else logits


class GPTModel(nn.Module):
    """One model chunk: the layers ``layer_ids`` (global indices), with the embedding if
    pre_process and the final norm, output layer and loss if post_process. See docs/interfaces.md.

    vocab_size: the tokenizer's vocabulary; the embedding and output are padded to
    padded_vocab_size(vocab_size, --make-vocab-size-divisible-by, tp) rows, and the padded logits
    are −inf (never predicted, never in the loss). recompute: what to re-run in backward
    (model/recompute.py: core attention, or whole layers by torch.utils.checkpoint).
    use_cpu_initialization: see ShardedInit. fast: compiled layers and loss, one-call attention
    dropout (meshlm/fast.py); the same function either way.

    Sizes split over TP (--seq-length under SP, --ffn-hidden-size, query groups) are checked by
    meshlm.validate before any worker starts.
    """

    def __init__(self, cfg, ps, vocab_size: int, *, seed: int, layer_ids: range | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 params_dtype=torch.float32, recompute: Recompute = Recompute(),
                 use_cpu_initialization: bool = True, fast: bool = False):
        super().__init__()
        assert not sequence_parallel or cfg.seq_length % ps.tp == 0, "checked by meshlm.validate"
        self.pre_process, self.post_process, self.recompute, self.fast = pre_process, post_process, recompute, fast
        self.sequence_parallel, self.group, self.cp = sequence_parallel, ps.tp_group, ps.cp
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, ps.tp)
        self.rng = RNGTracker(seed, ps.device)
        seq = SequenceSlice(ps, sequence_parallel)

        def init(layer, name, std=cfg.init_method_std):
            return ShardedInit((seed, layer, name), std, use_cpu_initialization, ps.tp_rank)

        hidden_std = mup.hidden_init_std(cfg)
        scaled_std = hidden_std / math.sqrt(2 * cfg.num_layers)
        self.output_mult = mup.output_mult(cfg)
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        if pre_process:
            self.embedding = Embedding(cfg, ps, vocab_size, self.padded_vocab, init, self.rng, seq, fast=fast, **kw)
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.moe_state, moe = MoEState(ps.device), moe_layer_pattern(cfg)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(cfg, ps, i, lambda name, i=i: init(i, name, hidden_std),
                                     lambda name, i=i: init(i, name, scaled_std), self.rng, seq, fast=fast,
                                     recompute_core=recompute.selective,
                                     moe_state=self.moe_state if moe[i] else None, **kw)
            for i in layer_ids})
        if post_process:
            self.final_layernorm = Norm(cfg, sequence_parallel, params_dtype, ps.device)
            rows = contiguous_index(self.padded_vocab, ps.tp, ps.tp_rank)
            self.vocab_start = int(rows[0])
            tied = not cfg.untie_embeddings_and_output_weights
            w = None
            if not (tied and pre_process):
                key = EMBEDDING_KEY if tied else (-1, "output_layer.weight")
                w = init(*key).param((vocab_size, cfg.hidden_size), 0, rows, params_dtype, ps.device)
            self.output_layer = OutputLayer(w, (rows >= vocab_size).to(ps.device))
            if w is not None:
                mark_partitioned(self.output_layer.weight, 0, rows, vocab_size)
                self.output_layer.weight.shared_embedding = tied
        if pre_process and not cfg.untie_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.shared_embedding = True
        # the input and output layers (Megatron's is_embedding_or_output_parameter): --decoupled-lr's params
        for q in ([self.embedding.word_embeddings.weight] if pre_process else []) + \
                ([self.output_layer.weight] if post_process and hasattr(self.output_layer, "weight") else []):
            q.embedding_or_output = True
        if cfg.use_mup:
            for layer in self.layers.values():
                for p in layer.parameters():
                    if p.dim() == 2:  # QKV, attention output, fc1, fc2: the hidden matrices
                        p.lr_mult = mup.hidden_lr_mult(cfg)

    def output_weight(self) -> torch.Tensor:
        """[V_padded/tp, h]: the output layer's weight (the word embedding when tied on this stage)."""
        if hasattr(self.output_layer, "weight"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, tokens, labels=None, hidden_states=None, position_ids=None, document_ids=None):
        """See docs/interfaces.md: per-token loss [b, s] fp32, logits [b, s, V_padded/tp], or hidden
        [s, b, h] ([s/tp, b, h] under SP) for the next pipeline stage. position_ids / document_ids:
        int64 [b, s] of packed documents (data/packing.py), None for 0..s-1 and one causal mask."""
        call = self.rng.next_call() if self.training else 0
        x = self.embedding(tokens, call, position_ids) if self.pre_process else hidden_states
        if self.cp > 1:  # the CP attention masks each block itself (parallel/context.py)
            mask = document_ids
        else:
            mask = None if document_ids is None else attention_mask(document_ids)
        layers = list(self.layers.values())
        for start, end, checkpointed in self.recompute.segments(len(layers)):
            if checkpointed and self.training:
                x = checkpoint(_run_layers, layers[start:end], x, call, position_ids, mask, self.moe_state,
                               use_reentrant=False)
            else:
                x = _run_layers(layers[start:end], x, call, position_ids, mask)
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        x = comm.gather_from_sp(x, self.group) if self.sequence_parallel else comm.copy_to_tp(x, self.group)
        logits = self.output_layer(x, self.output_weight())  # [s, b, V/tp]
        if self.output_mult != 1.0:
            logits = logits * self.output_mult
        if labels is None:
            return self.output_layer.mask_padding(logits).transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, labels.t(), self.vocab_start, self.group,
                                            valid=self.output_layer.valid, fast=self.fast, inplace=True).t()

