"""--qk-layernorm and --add-qkv-bias (Qwen3's and Qwen2's attention): the parameters they add, as
the planner counts them, and where the per-head norm acts. Their TP parity is in
tests/test_parity_matrix.py."""

import pytest
import torch

from meshlm.config import Config
from meshlm.model.chunks import build_model_chunks
from meshlm.parallel.mesh import ParallelState
from meshlm.planner.params import stage_params

VOCAB = 64


def _config(**model) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 8
    m.group_query_attention, m.num_query_groups, m.position_embedding_type = True, 2, "rope"
    for k, v in model.items():
        setattr(m, k, v)
    return cfg


@pytest.mark.parametrize("model", [dict(qk_layernorm=True, normalization="RMSNorm"), dict(qk_layernorm=True),
                                   dict(add_bias_linear=False, add_qkv_bias=True), dict(add_bias_linear=False)])
def test_the_planner_counts_the_q_k_norms_and_qkv_biases_the_model_builds(model):
    cfg = _config(**model)
    (chunk,) = build_model_chunks(cfg, ParallelState.single(), VOCAB)
    names = dict(chunk.named_parameters())
    assert stage_params(cfg, VOCAB) == [sum(p.numel() for p in names.values())]
    qk = "layers.0.self_attention.q_layernorm.weight" in names
    assert qk == bool(model.get("qk_layernorm")) and ("layers.1.self_attention.k_layernorm.bias" in names) == (
        qk and "normalization" not in model)
    assert ("layers.0.self_attention.linear_qkv.bias" in names) == (model.get("add_qkv_bias", False)
                                                                     or model.get("add_bias_linear", True))
    assert ("layers.0.self_attention.linear_proj.bias" in names) == model.get("add_bias_linear", True)


def test_each_heads_query_and_key_are_normalised_over_the_head_dim_before_rope():
    """With RMSNorm q/k norms of weight 1 every head's query and key reach the core attention with
    unit RMS over its 8 features (RoPE rotates pairs: the norm is kept)."""
    cfg = _config(qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-12)  # eps: not to blur the RMS
    (chunk,) = build_model_chunks(cfg, ParallelState.single(), VOCAB)
    attn = chunk.layers["0"].self_attention
    seen = []
    attn._core = lambda q, k, v, call, mask=None: seen.append((q, k)) or torch.zeros_like(q)
    attn(torch.randn(8, 2, 32), call=0)
    (q, k), = seen
    for t in (q, k):
        assert torch.allclose(t.pow(2).mean(-1), torch.ones(()), atol=1e-5)
