"""Deferred weights (parallel/tensor.py ``deferred_init``): a model built inside holds placeholders of
one element each, and the DDP buffers draw every weight into its bucket with the values an eager
build draws, so that no rank holds its whole model beside its buffers (under ZeRO-3: at all)."""

import pytest
import torch

from meshlm.config import Config
from meshlm.model.chunks import build_model_chunks
from meshlm.parallel.data import DistributedDataParallel
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.tensor import deferred_init, materialized

VOCAB = 50


def _config() -> Config:
    """Every kind of parameter: LayerNorm weight and bias, biased linears, an untied output layer,
    MoE router and experts beside a dense layer, the embedding."""
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 16, 2, 8
    m.normalization, m.untie_embeddings_and_output_weights = "LayerNorm", True
    m.num_experts, m.moe_layer_freq, m.moe_ffn_hidden_size = 2, [0, 1], 24
    return cfg


def _build(deferred: bool):
    ps = ParallelState.single(torch.device("cpu"))
    with deferred_init() if deferred else torch.no_grad():
        return build_model_chunks(_config(), ps, VOCAB, torch.float64), ps


def test_a_deferred_build_holds_placeholders_that_draw_the_eager_values():
    (eager,), _ = _build(False)
    (lazy,), _ = _build(True)
    pairs = list(zip(eager.named_parameters(), lazy.named_parameters()))
    assert len(pairs) > 20 and all(a == b for (a, _), (b, _) in pairs)
    for (name, e), (_, p) in pairs:
        assert p.untyped_storage().nbytes() == p.element_size(), name  # one element, expanded
        assert (p.shape, p.dtype) == (e.shape, e.dtype), name
        assert torch.equal(materialized(p), e), name
    weight = lazy.layers["0"].self_attention.linear_qkv.weight
    with pytest.raises(RuntimeError):
        weight.data.mul_(2.0)  # a write before the buffers draw it is refused, not lost


def test_the_ddp_buffers_draw_each_placeholder_into_its_bucket():
    (eager,), _ = _build(False)
    (lazy,), ps = _build(True)
    ddp = DistributedDataParallel([lazy], ps, _config())
    views = 0
    for (name, e), (_, p) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert not hasattr(p, "materialize") and torch.equal(p.data, e), name
        buf, bucket = ddp.bucket_of(p)
        views += p.untyped_storage().data_ptr() == bucket.param.untyped_storage().data_ptr()
    assert views == len(list(lazy.parameters()))
