"""Parameters held by one rank of each pipeline stage, counted from the flags (no model is built).

Per layer: two norms, QKV and output projections, the MLP (or an MoE layer's router, experts and
shared expert); the embedding (+ learned positions) on the first stage, the final norm and an
untied output layer on the last. ``meshlm pretrain --dry-run`` prints these counts and the memory
estimate (planner/memory.py) is built on them.
"""

from __future__ import annotations

from typing import Optional

from ..config import (Config, ffn_hidden, head_dim, max_positions, moe_ffn, moe_layer_pattern, padded_vocab_size,
                      query_groups)
from ..parallel.pipeline import stage_layers


def stage_params(cfg: Config, vocab: int, *, expert: Optional[bool] = None) -> list:
    """Parameters held by one TP rank of each pipeline stage (TP-split weights / TP, the rest whole).

    expert: None, every parameter; True, only this EP rank's routed experts (E/EP expert MLPs per
    MoE layer: the params reduced over, and under ZeRO-1 sharded over, the expert-data-parallel
    group); False, all but those."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, ffn, bias = m.hidden_size, ffn_hidden(m), m.add_bias_linear
    qkv = (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m)
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    split = h * qkv + qkv * (bias or m.add_qkv_bias) + m.num_attention_heads * head_dim(m) * h \
        + h * ffn * (2 if m.swiglu else 1) + ffn * (2 if m.swiglu else 1) * bias + ffn * h
    qk_norms = 2 * norm // h * head_dim(m) if m.qk_layernorm else 0  # --qk-layernorm: per head dim, replicated
    layer = split / tp + 2 * norm + 2 * h * bias + qk_norms

    def mlp(width: int, split_over: int) -> float:  # fc1 (+ bias), fc2 over split_over ranks, fc2's bias whole
        return (h * width * (2 if m.swiglu else 1) + width * (2 if m.swiglu else 1) * bias + width * h) \
            / split_over + h * bias
    # an MoE layer's MLP (model/moe.py): the router [E, h], this EP rank's E/EP experts (TP = 1 each)
    # and the shared expert (TP-split), instead of the dense MLP
    experts = m.num_experts // max(1, p.expert_model_parallel_size) * mlp(moe_ffn(m), 1) if m.num_experts else 0
    moe_layer = layer - mlp(ffn, tp) + m.num_experts * h + experts + (
        mlp(m.moe_shared_expert_intermediate_size, tp) if m.moe_shared_expert_intermediate_size else 0
    ) if m.num_experts else layer
    moe = moe_layer_pattern(m)
    stages = stage_layers(cfg)  # stage s = chunk · PP + rank
    layers = [[n for s in range(r, len(stages), pp) for n in stages[s]] for r in range(pp)]
    routed = [sum(experts for n in mine if moe[n]) for mine in layers]
    if expert:
        return [int(x) for x in routed]
    params = [sum(moe_layer if moe[n] else layer for n in mine) for mine in layers]
    embedding = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp) * h / tp
    params[0] += embedding + (max_positions(m) * h if m.position_embedding_type == "learned_absolute" else 0)
    params[-1] += norm + (embedding if m.untie_embeddings_and_output_weights or pp > 1 else 0)
    return [int(x - (r if expert is False else 0)) for x, r in zip(params, routed)]
