"""GPTModel on one process: shapes, training, initialisation rules, dropout and recompute."""

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.model.recompute import Recompute
from meshlm.model.transformer import GPTModel
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.random import RNGTracker

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
           hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             add_bias_linear=False, untie_embeddings_and_output_weights=True,
             group_query_attention=True, num_query_groups=2)
VOCAB = 100
ONE = ParallelState.single()


def _batch(b=2, s=16, seed=0):
    t = torch.randint(0, VOCAB, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def _model(seed=3, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k in ("layer_ids", "pre_process", "post_process", "recompute",
                                                     "use_cpu_initialization")}
    return GPTModel(ModelConfig(**{**GPT, **kw}), ONE, VOCAB, seed=seed, **extra)


@pytest.mark.parametrize("flavour", [GPT, LLAMA], ids=["gpt", "llama"])
def test_loss_falls_on_a_repeated_batch(flavour):
    model = GPTModel(ModelConfig(**flavour), ONE, VOCAB, seed=1)
    tokens, labels = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(tokens, labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_forward_shapes_and_padded_vocabulary_is_never_predicted():
    model = _model().eval()
    tokens, labels = _batch()
    assert model.padded_vocab == 128  # 100 rounded up to --make-vocab-size-divisible-by 128
    loss = model(tokens, labels)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    logits = model(tokens)
    assert logits.shape == (2, 16, 128)
    assert torch.isneginf(logits[..., VOCAB:]).all() and torch.isfinite(logits[..., :VOCAB]).all()
    expected = torch.nn.functional.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1),
                                                 reduction="none").view(2, 16)
    torch.testing.assert_close(loss, expected)
    hidden = _model(post_process=False)(tokens)
    assert hidden.shape == (16, 2, 32)


def test_weights_depend_only_on_seed_layer_and_name():
    full = dict(_model().named_parameters())
    last = dict(_model(layer_ids=range(1, 2), pre_process=False).named_parameters())
    for name, p in last.items():
        if name.startswith("layers."):
            assert torch.equal(p, full[name]), name
    assert "layers.0.input_layernorm.weight" not in last
    # a last stage that is not the first holds its own copy of the tied word embedding
    out = last["output_layer.weight"]
    assert torch.equal(out, full["embedding.word_embeddings.weight"]) and out.shared_embedding
    assert not torch.equal(full["layers.0.mlp.linear_fc1.weight"][:32], full["layers.1.mlp.linear_fc1.weight"][:32])
    other_seed = dict(_model(seed=4).named_parameters())
    assert not torch.equal(other_seed["layers.0.mlp.linear_fc1.weight"], full["layers.0.mlp.linear_fc1.weight"])


def test_pipeline_chunks_compose_to_the_full_model():
    tokens, labels = _batch()
    full = _model()(tokens, labels)
    first = _model(layer_ids=range(0, 1), post_process=False)
    last = _model(layer_ids=range(1, 2), pre_process=False)
    torch.testing.assert_close(last(None, labels, hidden_states=first(tokens)), full, rtol=1e-6, atol=0)


def test_initialisation_scales_output_projections():
    model = _model(num_layers=8, hidden_size=64, ffn_hidden_size=1024, init_method_std=0.02)
    params = dict(model.named_parameters())
    assert params["layers.0.mlp.linear_fc1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.0.mlp.linear_fc2.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.05)  # /√(2·8)
    assert params["layers.0.input_layernorm.weight"].eq(1).all()
    assert params["layers.0.mlp.linear_fc1.bias"].eq(0).all()


def test_parameter_attributes_for_optimizer_and_ddp():
    params = dict(GPTModel(ModelConfig(**GPT), ONE, VOCAB, seed=3, sequence_parallel=False).named_parameters())
    assert params["embedding.word_embeddings.weight"].shared_embedding
    qkv = params["layers.0.self_attention.linear_qkv.weight"]
    assert qkv.tensor_model_parallel and qkv.partition_dim == 0
    proj = params["layers.0.self_attention.linear_proj.weight"]
    assert proj.tensor_model_parallel and proj.partition_dim == 1
    no_decay = {n for n, p in params.items() if getattr(p, "no_weight_decay", False)}
    assert no_decay == {n for n in params if n.endswith(".bias") or "layernorm" in n}


def test_llama_has_no_biases_and_untied_output():
    params = dict(_model(**{k: v for k, v in LLAMA.items() if k not in GPT}).named_parameters())
    assert not [n for n in params if n.endswith(".bias")]
    assert "output_layer.weight" in params and not params["output_layer.weight"].shared_embedding
    assert "embedding.position_embeddings.weight" not in params


def test_dropout_is_reproducible_from_the_seed_and_off_in_eval():
    tokens, labels = _batch()
    kw = dict(hidden_dropout=0.3, attention_dropout=0.3)
    a, b, c = _model(**kw), _model(**kw), _model(seed=5, **kw)
    c.load_state_dict(a.state_dict())  # same weights, different dropout seed
    la, lb, lc = a(tokens, labels), b(tokens, labels), c(tokens, labels)
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    assert not torch.equal(la, a(tokens, labels))  # the next call draws new masks
    a.eval(), c.eval()
    assert torch.equal(a(tokens, labels), c(tokens, labels))


PLANS = [Recompute(), Recompute("selective"), Recompute("full", "uniform", 1), Recompute("full", "uniform", 2),
         Recompute("full", "block", 2)]


def test_recompute_replays_the_same_dropout_masks():
    tokens, labels = _batch()
    kw = dict(hidden_dropout=0.3, attention_dropout=0.3, num_layers=3)
    grads = []
    for plan in PLANS:
        model = _model(recompute=plan, **kw)
        model(tokens, labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-6, atol=1e-9)


def test_recompute_segments_follow_megatron():
    assert Recompute().segments(5) == [(0, 5, False)]
    assert Recompute("selective").segments(5) == [(0, 5, False)]
    assert Recompute("full", "uniform", 2).segments(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert Recompute("full", "block", 2).segments(5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert Recompute("full", "block", 4).segments(3) == [(0, 1, True), (1, 2, True), (2, 3, True)]


def _saved_bytes(plan, **kw) -> int:
    """Bytes autograd keeps for backward after one forward (distinct storages)."""
    model, (tokens, labels) = _model(recompute=plan, **kw), _batch()
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels).mean()
    return sum(kept.values())


def test_selective_recompute_keeps_less_and_full_recompute_less_still():
    """CPU SDPA (a flash kernel, dropout included) keeps no s² scores: selective drops the
    attention outputs and log-sum-exps, full keeps one input per layer."""
    kw = dict(attention_dropout=0.3, num_layers=3, seq_length=64)
    none, selective, full = (_saved_bytes(p, **kw) for p in (PLANS[0], PLANS[1], PLANS[2]))
    assert full < selective < none


def test_fork_restores_the_default_generator():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    tracker = RNGTracker(seed=1, device=torch.device("cpu"))
    with tracker.fork(tracker.head_stream(0), 0, "attention", 1):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected) and not torch.equal(inside, expected)


def test_sequence_parallel_dropout_mask_is_the_full_mask_sliced():
    tracker = RNGTracker(seed=1, device=torch.device("cpu"))
    full = tracker.dropout(torch.ones(8, 2, 4), 0.5, ("k",))
    second_half = tracker.dropout(torch.ones(4, 2, 4), 0.5, ("k",), full_rows=8, rows=slice(4, 8))
    assert torch.equal(second_half, full[4:])


def test_per_rank_initialisation_materialises_only_the_local_slice():
    a = dict(_model(use_cpu_initialization=False).named_parameters())
    b = dict(_model().named_parameters())
    w = "layers.0.mlp.linear_fc1.weight"
    assert a[w].shape == b[w].shape and not torch.equal(a[w], b[w])
    assert a[w].std().item() == pytest.approx(0.02, rel=0.1)
    assert a["embedding.word_embeddings.weight"][VOCAB:].eq(0).all()  # padding rows stay zero


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_stores_the_weight_from_zero_and_scales_by_one_plus_it(norm):
    """--apply-layernorm-1p (Megatron's zero-centred norm weights): the weight starts at 0 and the
    norm is the standard one with weight 1 + w; a 1p model's HF export writes 1 + w."""
    import torch.nn.functional as F
    from meshlm.checkpoint.hf import to_hf_tensors
    from meshlm.checkpoint.megatron import model_from_args
    from meshlm.model.transformer import Norm
    cfg = ModelConfig(hidden_size=8, normalization=norm, apply_layernorm_1p=True)
    n = Norm(cfg, False, torch.float64, torch.device("cpu"))
    assert torch.equal(n.weight, torch.zeros(8, dtype=torch.float64))
    with torch.no_grad():
        n.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, dtype=torch.float64)
    want = F.rms_norm(x, (8,), 1 + n.weight, cfg.norm_epsilon) if norm == "RMSNorm" else \
        F.layer_norm(x, (8,), 1 + n.weight, n.bias, cfg.norm_epsilon)
    torch.testing.assert_close(n(x), want, rtol=0, atol=0)
    m = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    ffn_hidden_size=16, apply_layernorm_1p=True)
    full = {name: torch.full((rows, 8), 0.25) for name, rows in _hf_rows(m).items()}
    full["final_layernorm.weight"] = full["layers.0.input_layernorm.weight"] = n.weight.detach()
    out = to_hf_tensors(full, "llama", m)
    for hf_name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        torch.testing.assert_close(out[hf_name], 1 + n.weight.detach())
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], torch.full((8, 8), 0.25))  # the rest as is
    # a Megatron-LM run's args with --apply-layernorm-1p: the same model (it was refused)
    import argparse
    assert model_from_args(argparse.Namespace(apply_layernorm_1p=True, num_layers=2)).apply_layernorm_1p


def _hf_rows(m):
    """{meshlm tensor: its rows} of a llama export (a fused tensor's parts summed)."""
    from meshlm.checkpoint.hf import rules
    return {r.name: sum(r.sizes) if r.sizes else 8 for r in rules("llama", m)}
