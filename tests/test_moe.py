"""MoE at EP = 1: routing, balancing losses and capacity against megatron-core's own functions;
experts by grouped GEMM against the per-expert loop; the layer against a token-by-token sum;
zero-token experts; the layer pattern; a short run where aux loss / expert bias even out the load."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.config import Config, moe_layer_pattern
from meshlm.errors import ConfigError
from meshlm.model import moe
from meshlm.parallel.mesh import ParallelState
from meshlm.validate import validate

mcore = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _logits(T=32, E=8, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("score,pre,bias", [("softmax", False, False), ("softmax", True, False),
                                            ("sigmoid", False, True), ("sigmoid", False, False)])
def test_route_matches_megatron_core(score, pre, bias):
    logits = _logits()
    b = torch.linspace(-0.5, 0.5, 8, dtype=torch.float64) if bias else None
    gates, routing_map = moe.route(logits, 2, score, pre, b)
    want_gates, want_map = mcore.topk_routing_with_score_function(
        logits, 2, use_pre_softmax=pre, score_function=score, expert_bias=b)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(gates, want_gates, rtol=1e-6, atol=1e-7)  # megatron-core's softmax is fp32


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_loss_match_megatron_core(score):
    logits = _logits()
    loss, counts = moe.aux_loss(logits, 2, score, 1e-2)
    routing_map, scores = mcore.compute_routing_scores_for_aux_loss(logits, 2, score)
    want = mcore.switch_load_balancing_loss_func(scores, routing_map.sum(0), 32, 2, 8, 1e-2)
    assert torch.equal(counts, routing_map.sum(0).to(counts.dtype))
    torch.testing.assert_close(loss, want.to(loss.dtype), rtol=1e-6, atol=0)  # fp32 softmax there
    torch.testing.assert_close(moe.z_loss(logits, 1e-3), mcore.z_loss_func(logits, 1e-3), rtol=1e-12, atol=0)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_dropping_matches_arithmetic_and_megatron_core(factor):
    logits = _logits(T=40, E=4, seed=3)
    gates, routing_map = moe.route(logits, 2)
    cap = moe.capacity(40, 4, 2, factor)
    assert cap == mcore.get_capacity(40 * 2, 4, factor) == math.ceil(40 * 2 / 4 * factor)
    kept_gates, kept = moe.drop(gates, routing_map, cap, "probs")
    want_gates, want_map = mcore.apply_router_token_dropping(gates, routing_map, 2, factor, "probs")
    assert torch.equal(kept, want_map) and torch.equal(kept_gates, want_gates)
    expected_dropped = sum(max(0, int(n) - cap) for n in routing_map.sum(0))
    assert int(routing_map.sum() - kept.sum()) == expected_dropped
    print(f"capacity factor {factor}: capacity {cap}, dropped {expected_dropped}/{int(routing_map.sum())} routes")
    pos_gates, pos = moe.drop(gates, routing_map, cap, "position")
    assert int(routing_map.sum() - pos.sum()) == expected_dropped
    for e in range(4):  # position: each expert keeps its earliest routes
        chosen = routing_map[:, e].nonzero().squeeze(1)
        assert torch.equal(pos[:, e].nonzero().squeeze(1), chosen[:cap])
    assert torch.equal(pos_gates, gates * pos)


def _cfg(**moe_flags):
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 16, 4, 8, 64
    m.hidden_dropout = m.attention_dropout = 0.0
    m.num_experts, m.moe_ffn_hidden_size = 4, 8
    for k, v in moe_flags.items():
        setattr(m, k, v)
    cfg.data.mock_data = True
    validate(cfg, world=1, check_files=False)
    return cfg.model


def _layer(m, dtype=torch.float64, index=0, state=None):
    from meshlm.parallel.tensor import ShardedInit
    ps = ParallelState.single()
    init = lambda name: ShardedInit((1, index, name), 0.2)  # noqa: E731
    return moe.MoELayer(m, ps, index, init, init, state or moe.MoEState(), sequence_parallel=False, params_dtype=dtype)


@pytest.mark.parametrize("swiglu,shared", [(False, None), (True, 8)])
def test_layer_is_the_gate_weighted_sum_of_its_experts(swiglu, shared):
    m = _cfg(swiglu=swiglu, moe_shared_expert_intermediate_size=shared, add_bias_linear=not swiglu)
    layer = _layer(m)
    x = torch.randn(8, 2, 16, dtype=torch.float64)
    y = layer(x)
    tokens = x.reshape(-1, 16)
    gates, _ = moe.route(layer.router(tokens), 2)
    want = torch.stack([sum(gates[t, e] * layer.experts.local_experts[str(e)](tokens[t:t + 1])[0]
                            for e in range(4) if gates[t, e] > 0) for t in range(16)])
    if shared:
        want = want + layer.shared_experts(x).reshape(-1, 16)
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("factor", [None, 0.5])  # 0.5: dropped slots past the grouped GEMM's offsets
def test_grouped_gemm_equals_the_expert_loop(factor):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    m = _cfg(swiglu=True, add_bias_linear=True, moe_expert_capacity_factor=factor)
    layer = _layer(m, torch.float32)
    x = torch.randn(8, 2, 16)
    outs, grads = [], []
    for grouped in (False, True):
        layer.zero_grad()
        layer.experts.grouped = grouped
        y = layer(x)
        y.square().sum().backward()
        outs.append(y)
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("compiled", [False, True])
def test_stacked_experts_are_views_of_the_ddp_buffer_with_stacks_gradients(compiled):
    """Under the DDP each stack of a layer's experts (fc1/fc2 weights and biases, one of each local
    expert) lies back to back, ascending, in the param buffer, and ``Experts.stacked`` is a view of
    it (no copy) whose gradients equal ``torch.stack``'s exactly, eager and compiled with
    ``fullgraph=True`` (float64); the grouped GEMM path (fp32) gives what it gave with copies."""
    from meshlm.config import Config
    from meshlm.parallel.data import DistributedDataParallel
    m = _cfg(swiglu=True, add_bias_linear=True)
    layer = _layer(m)
    copies = _layer(m)
    DistributedDataParallel([layer], ParallelState.single(), Config())
    experts = layer.experts
    stacks = experts.stacks()
    assert sorted(experts.views) == sorted(stacks) == ["linear_fc1.bias", "linear_fc1.weight",
                                                      "linear_fc2.bias", "linear_fc2.weight"]
    for stack in stacks.values():
        n = stack[0].numel() * stack[0].element_size()
        assert [q.data_ptr() - stack[0].data_ptr() for q in stack] == [i * n for i in range(4)]
    x = torch.randn(6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss(ex):  # every stack, as the grouped GEMMs and the row biases take them
        w1, b1 = ex.stacked("linear_fc1", "weight"), ex.stacked("linear_fc1", "bias")
        w2, b2 = ex.stacked("linear_fc2", "weight"), ex.stacked("linear_fc2", "bias")
        y = torch.einsum("nh,efh->enf", x, w1) + b1.unsqueeze(1)
        y = torch.einsum("enf,ehf->enh", moe.swiglu(y), w2) + b2.unsqueeze(1)
        return y.square().sum(), w1
    run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
    torch._dynamo.reset()
    got, w1 = run(experts)
    got.backward()
    if not compiled:
        assert w1.data_ptr() == stacks["linear_fc1.weight"][0].data_ptr()
    want, _ = loss(copies.experts)
    want.backward()
    assert torch.equal(got, want)
    for (name, p), q in zip(layer.experts.named_parameters(), copies.experts.parameters()):
        assert torch.equal(p.grad, q.grad), name
    if compiled or not hasattr(torch, "_grouped_mm"):
        return
    layer, copies = _layer(m, torch.float32), _layer(m, torch.float32)
    DistributedDataParallel([layer], ParallelState.single(), Config())
    x = torch.randn(8, 2, 16)
    ys = []
    for one in (layer, copies):
        one.experts.grouped = True
        ys.append(one(x))
        ys[-1].square().sum().backward()
    assert layer.experts.views and torch.equal(ys[0], ys[1])
    for (name, p), q in zip(layer.named_parameters(), copies.parameters()):
        assert torch.equal(p.main_grad, q.grad), name


def test_half_grads_stack_buckets_take_the_stacks_gradient_uncopied(monkeypatch):
    """Under config.half_grads (forced here: it needs CUDA and bf16) each stack of experts is a DDP
    bucket of its own, and the fold makes the stacked gradient (one [E, out, in] tensor whose slices
    autograd hands the params) the bucket's grad without a copy; gradients that are not one run of
    memory (each param used alone) are copied as before. float64, against a DDP-free copy."""
    from meshlm.config import Config
    from meshlm.parallel import data
    monkeypatch.setattr(data, "half_grads", lambda *a, **k: True)
    m = _cfg(swiglu=True, add_bias_linear=True)
    layer, ref = _layer(m), _layer(m)
    ddp = data.DistributedDataParallel([layer], ParallelState.single(), Config())
    stacks = layer.experts.stacks()
    for stack in stacks.values():
        assert ddp.bucket_of(stack[0])[1].params == stack
    x = torch.randn(6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    copied = []
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copied.extend(dst), real_copy(dst, src)))

    def loss(ex):  # batched GEMMs whose weight gradients come out [E, out, in] contiguous, as the grouped GEMM's
        w1, b1 = ex.stacked("linear_fc1", "weight"), ex.stacked("linear_fc1", "bias")
        w2, b2 = ex.stacked("linear_fc2", "weight"), ex.stacked("linear_fc2", "bias")
        a = moe.swiglu((w1 @ x.t() + b1.unsqueeze(2)).transpose(1, 2))
        return (w2 @ a.transpose(1, 2) + b2.unsqueeze(2)).square().sum()
    ddp.zero_grad()  # as each step begins: the buckets' grads freed
    loss(layer.experts).backward()
    grads_at = {role: stack[0].grad.data_ptr() for role, stack in stacks.items()}
    ddp._fold(layer)
    loss(ref.experts).backward()
    for (name, p), q in zip(layer.experts.named_parameters(), ref.experts.parameters()):
        assert torch.equal(p.main_grad, q.grad), name
    for role, stack in stacks.items():
        assert ddp.bucket_of(stack[0])[1].grad.data_ptr() == grads_at[role], role
    assert not any(t is q.main_grad for t in copied for s in stacks.values() for q in s)
    ddp.zero_grad()
    sum(q.square().sum() for s in stacks.values() for q in s).backward()  # one gradient tensor a param
    copied.clear()
    ddp._fold(layer)
    for s in stacks.values():
        for q in s:
            assert torch.equal(q.main_grad, 2 * q.detach()) and any(t is q.main_grad for t in copied)


def test_unused_expert_gets_a_zero_gradient_and_one_expert_for_all_trains():
    m = _cfg(moe_router_topk=1)
    layer = _layer(m)
    with torch.no_grad():  # every token prefers expert 2
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
    x = torch.rand(8, 2, 16, dtype=torch.float64) + 0.1
    layer(x).square().sum().backward()
    for e in range(4):
        g = layer.experts.local_experts[str(e)].linear_fc1.weight.grad
        assert g is not None, f"expert {e} has no gradient"
        assert (g.abs().sum() > 0) == (e == 2), f"expert {e}"
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = layer(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses


def test_moe_layer_freq_and_validation():
    m = _cfg(num_layers=4, moe_layer_freq="2")
    assert moe_layer_pattern(m) == [True, False, True, False]
    m.moe_layer_freq = "([0]+[1])*2"
    assert moe_layer_pattern(m) == [False, True, False, True]
    m.moe_layer_freq = "[1]*3"
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        moe_layer_pattern(m)
    m.moe_layer_freq = "__import__('os')"
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        moe_layer_pattern(m)
    cfg = Config()
    cfg.model.num_experts, cfg.parallel.expert_model_parallel_size = 6, 4
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.data.mock_data = True
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=4, check_files=False)
    text = str(e.value)
    assert "--num-experts 6 is not divisible by --expert-model-parallel-size 4" in text
    assert "must divide DP × CP = 2" in text and "needs --sequence-parallel" in text


@pytest.mark.parametrize("pattern", ["[1]+5", "[1]*[1]", "[1]*100000000000",
                                     "+".join(["[1]"] * 5000)])
def test_moe_layer_freq_of_mixed_kinds_or_huge_repeats_is_one_config_error(pattern):
    """`[1]+5`, `[1]*[1]` were TypeError tracebacks, `[1]*100000000000` a MemoryError and a long sum a
    RecursionError: each is now the flag's one-line error."""
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        _cfg(num_layers=2, moe_layer_freq=pattern)


def test_moe_with_context_parallelism_validates_and_ep_stays_inside_dp_cp():
    cfg = Config()
    cfg.model.num_experts, cfg.parallel.context_parallel_size = 4, 2
    cfg.model.attention_dropout, cfg.data.mock_data, cfg.model.vocab_size = 0.0, True, 64
    cfg.parallel.expert_model_parallel_size = 4  # EP over DP 2 × CP 2
    validate(cfg, world=4, check_files=False)
    cfg.model.num_experts = cfg.parallel.expert_model_parallel_size = 8
    with pytest.raises(ConfigError, match="must divide DP × CP = 4"):
        validate(cfg, world=4, check_files=False)


# ----------------------------------------------------------------------------- balancing on real text

BALANCING = {  # run name → MoE flags; each balanced run is compared with its unbalanced twin
    "softmax": {},
    "softmax + aux loss": {"moe_aux_loss_coeff": 0.1},
    "sigmoid": {"moe_router_score_function": "sigmoid"},
    "sigmoid + expert bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                              "moe_router_bias_update_rate": 0.02},
}
BALANCE_ITERS, BALANCE_LOG = 40, 10


def _balancing_runs(rank, world, root, corpus):
    """Each BALANCING run, 40 steps of a 2-layer, 8-expert top-2 model on the embedded corpus;
    its metrics.jsonl records (one per 10 steps)."""
    import json
    import os

    from meshlm.training import trainer
    out = {}
    for name, flags in BALANCING.items():
        cfg = Config()
        m, t = cfg.model, cfg.training
        m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 64
        m.hidden_dropout = m.attention_dropout = 0.0
        m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = 8, 32, 2
        for k, v in flags.items():
            setattr(m, k, v)
        d = cfg.data
        d.data_path, d.split = corpus["data_path"], "1,0,0"
        d.tokenizer_type, d.tokenizer_model = "HuggingFaceTokenizer", corpus["tokenizer_model"]
        t.micro_batch_size, t.global_batch_size, t.train_iters = 8, 8, BALANCE_ITERS
        t.log_interval, t.eval_interval, t.seed = BALANCE_LOG, 1000, 1234
        cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 3e-3, 2
        cfg.logging.log_dir = os.path.join(root, name.replace(" ", ""))
        validate(cfg, world=1, check_files=True)
        trainer.pretrain(cfg)
        with open(os.path.join(cfg.logging.log_dir, "metrics.jsonl")) as fh:
            out[name] = [r for r in map(json.loads, fh) if "moe_tokens_per_expert" in r]
    return out


@pytest.fixture(scope="module")
def balancing(tmp_path_factory):
    from distributed import run_distributed
    from meshlm.data.corpus import prepare_default_corpus
    root = tmp_path_factory.mktemp("balancing")
    corpus = prepare_default_corpus(str(root), max_bytes=300_000, vocab_size=512)
    (runs,) = run_distributed(_balancing_runs, 1, str(root), corpus)
    return runs


@pytest.mark.slow
def test_aux_loss_and_expert_bias_even_out_the_load_on_real_text(balancing):
    """Imbalance = max / mean routes per expert (1: even), per 10-step interval: the balanced run
    ends clearly more even than its twin (figures printed)."""
    for name, records in balancing.items():
        figures = " ".join(f"{r['moe_tokens_per_expert']['imbalance']:.2f}" for r in records)
        extra = f" aux {records[-1]['moe_aux_loss']:.3f}" if records[-1]["moe_aux_loss"] is not None else ""
        print(f"{name:>22}: imbalance per 10 steps {figures}{extra}")
    last = {name: records[-1]["moe_tokens_per_expert"]["imbalance"] for name, records in balancing.items()}
    assert len(balancing["softmax"]) == BALANCE_ITERS // BALANCE_LOG
    assert last["softmax"] > 1.3 and last["sigmoid"] > 1.3  # without balancing the load is uneven
    assert last["softmax + aux loss"] < 1.0 + 0.5 * (last["softmax"] - 1.0), last
    assert last["sigmoid + expert bias"] < 1.0 + 0.5 * (last["sigmoid"] - 1.0), last


def test_model_flops_count_the_k_experts_a_token_uses_and_the_router():
    """Each MoE layer's MLP costs a token 2·h·k·f_e·2 (GeLU: fc1, fc2 of its k experts) + 2·h·E
    (the router) instead of the dense 2·h·4h·2; ×3 with backward, × B·s tokens."""
    from meshlm.flops import flops_per_iteration
    moe_cfg = _cfg(num_layers=4, moe_layer_freq="2", moe_router_topk=2)  # layers 0, 2: 4 experts of 8
    dense = _cfg(num_layers=4)
    dense.num_experts = None
    B, V, h, s, k, f_e, E = 3, 64, 16, 8, 2, 8, 4
    per_layer = 2 * h * k * f_e * 2 + 2 * h * E - 2 * h * 4 * h * 2
    assert flops_per_iteration(moe_cfg, B, V) - flops_per_iteration(dense, B, V) == 3 * B * s * 2 * per_layer


def test_fixed_slot_dispatch_is_nonzero_order_and_equals_index_add_with_dropping():
    """EP = 1's fixed T·k slots (parallel/experts.py): the experts see the routes in nonzero's
    expert-major order, the dropped routes' slots carry gate 0, and output and gradients equal the
    index_select / index_add formulation (float64)."""
    from meshlm.parallel import experts as dispatch
    g = torch.Generator().manual_seed(3)
    T, E, k, h = 12, 4, 2, 5
    probs, chosen = moe.route(torch.randn(T, E, generator=g, dtype=torch.float64), k)
    probs.requires_grad_()
    gates, kept = moe.drop(probs, chosen, moe.capacity(T, E, k, 0.75), "probs")
    assert (kept != chosen).any(), "the case must drop routes"
    perm, inv, expert_idx, counts, _ = dispatch.permute(chosen, k)
    e_ref, t_ref = chosen.t().nonzero(as_tuple=True)
    assert torch.equal(expert_idx, e_ref) and torch.equal(torch.div(perm, k, rounding_mode="floor"), t_ref)
    assert torch.equal(inv[perm], torch.arange(T * k)) and torch.equal(counts, chosen.sum(0))
    perm, inv, expert_idx, counts, _ = dispatch.permute(chosen, k, kept)  # the dropped slots go last
    e_ref, t_ref = kept.t().nonzero(as_tuple=True)
    n = len(e_ref)
    assert torch.equal(expert_idx[:n], e_ref) and torch.equal(torch.div(perm[:n], k, rounding_mode="floor"), t_ref)
    assert (expert_idx[n:] == E).all() and torch.equal(counts, kept.sum(0)) and torch.equal(inv[perm], torch.arange(T * k))
    w = torch.randn(E, h, h, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, h, generator=g, dtype=torch.float64, requires_grad=True)

    def experts(rows, counts, idx):  # a different linear map per expert, row by row; NaN past the counts
        y = torch.einsum("nh,nhf->nf", rows, w[idx.clamp(max=E - 1)])
        return y if counts is None else torch.where((torch.arange(len(idx)) < counts.sum()).unsqueeze(1), y, torch.nan)

    y, _ = dispatch.dispatch_combine(x, gates, kept, experts, None, chosen, k)
    out = torch.randn(T, h, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((y * out).sum(), (x, w, probs), retain_graph=True)  # a dropped gate's own gradient differs
    e_idx, t_idx = kept.t().nonzero(as_tuple=True)
    weighted = experts(x.index_select(0, t_idx), None, e_idx) * gates[t_idx, e_idx].unsqueeze(1)
    want_y = torch.zeros(T, h, dtype=torch.float64).index_add(0, t_idx, weighted)
    want = torch.autograd.grad((want_y * out).sum(), (x, w, probs))
    torch.testing.assert_close(y, want_y, rtol=1e-13, atol=1e-14)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("per_token", [False, True])
def test_compiled_moe_layer_is_one_graph_and_equals_eager_in_float64(per_token):
    """The MoE layer as dynamo captures it on the fast path (float64, sigmoid scores with the expert
    bias, z-loss, aux loss, capacity dropping; AOT autograd without Inductor's codegen, which
    tests/test_moe_parallel.py's compiled parity runs), under full recompute: one graph with
    ``fullgraph=True`` (the losses' attachment and the statistics traced: no graph break), which
    the recompute and another layer run again (no recompile); output, gradients (the aux losses' scale a float, or a tensor under
    --calculate-per-token-loss), routing statistics and the expert bias's counts equal eager's, each
    recorded once per call (not again by the recompute)."""
    from torch.utils.checkpoint import checkpoint

    from meshlm import fast
    m = _cfg(swiglu=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.0,
             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = _layer(m)
    layer.state.scale = torch.tensor(0.25, dtype=torch.float64) if per_token else 0.5
    other = _layer(m, index=1, state=layer.state)
    x = torch.randn(8, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    runs = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            fast._before_compile()
            layer.compile(backend="aot_eager", fullgraph=True)
        layer.zero_grad()
        x.grad = None

        def unit(x):  # as model/transformer.py's _run_layers
            with moe.forward_pass(layer.state):
                return layer(x)
        y = checkpoint(unit, x, use_reentrant=False)
        y.square().sum().backward()
        stats = (layer.routing_counts.clone(), layer.routing_losses.clone(), layer.router.tokens_per_expert.clone())
        for t in (layer.routing_counts, layer.routing_losses, layer.router.tokens_per_expert):
            t.zero_()
        runs.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}, stats))
    other.compile(backend="aot_eager", fullgraph=True)
    other(x).sum().backward()
    assert other.routing_counts[-1] == 1 and layer.routing_counts[-1] == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # for both layers, and the recompute
    assert not torch._dynamo.utils.counters["graph_break"]
    (y0, gx0, g0, s0), (y1, gx1, g1, s1) = runs
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-14)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-12, atol=1e-14, msg=n)
    assert s0[0][-1] == 1 and s0[0][4] == 16 * 2 > s0[0][:4].sum()  # one call (not the recompute's); some dropped
    assert torch.equal(s1[0], s0[0]) and torch.equal(s1[2], s0[0][:4].float())
    torch.testing.assert_close(s1[1], s0[1], rtol=1e-12, atol=0)
    assert (s0[1] > 0).all()


def test_routing_stats_sum_the_layers_buffers_and_reset_them():
    """routing_stats sums each MoE layer's buffers (on the device) into one table, leaves out a
    layer that recorded no call, means the losses over the calls, and zeroes the buffers."""
    m = _cfg(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=0.0)
    chunk = torch.nn.ModuleList([_layer(m, index=i) for i in (0, 1)])
    chunk[0].routing_counts.copy_(torch.tensor([6, 2, 0, 7, 17, 2]))
    chunk[0].routing_losses.copy_(torch.tensor([1.5, 0.0]))
    got = moe.routing_stats([chunk], ParallelState.single(), m)
    assert got == {0: {"tokens": [6.0, 2.0, 0.0, 7.0], "routes": 17.0, "aux": 0.75, "z": None}}
    assert not any(layer.routing_counts.any() or layer.routing_losses.any() for layer in chunk)
    assert moe.routing_stats([chunk], ParallelState.single(), m) == {}


def test_swiglu_one_pass_backward_is_autograds_in_float64():
    """model/swiglu.py's activation (the experts' SwiGLU): value and gradient equal autograd's of
    silu(gate) · up in float64, eagerly and as dynamo captures it (no graph break)."""
    from meshlm import fast
    from meshlm.model.swiglu import swiglu
    gen = torch.Generator().manual_seed(3)
    y = (torch.randn(5, 3, 2 * 7, dtype=torch.float64, generator=gen) * 3).requires_grad_()
    dz = torch.randn(5, 3, 7, dtype=torch.float64, generator=gen)
    gate, up = y.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    (want_dy,) = torch.autograd.grad(want, y, dz)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fast._before_compile()
    for fn in (swiglu, torch.compile(swiglu, backend="aot_eager", fullgraph=True)):
        z = fn(y)
        (dy,) = torch.autograd.grad(z, y, dz)
        torch.testing.assert_close(z, want, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(dy, want_dy, rtol=1e-12, atol=1e-14)
    assert not torch._dynamo.utils.counters["graph_break"]
