"""The planner's MoE and context-parallel models (planner/moe_cp.py) against what meshlm does.

Model state: the planner's weights, grads and optimizer bytes equal, to the byte, what a built run's
optimizer reports (the "memory rank R" line at start) for an EP run under ZeRO-1 (experts sharded
over DP × CP / EP) and a CP run (sharded over DP × CP). FLOPs: an MoE layer's forward counted by
torch's FlopCounterMode equals the formula. Activations: the bytes a MoELayer saves for backward
equal moe_mlp_terms. Communication: the all-to-all and ring formulas as their docstrings state them,
the search trying EP and CP, analyze attributing "ep" time, which the dispatch now records.
"""

import argparse
import dataclasses

import pytest
import torch

from distributed import run_distributed
from meshlm.config import add_config_args, config_from_args, ffn_hidden, moe_ffn
from meshlm.planner.analyze import analyze
from meshlm.planner.gpus import COLLECTIVE_LATENCY_S, PRESETS
from meshlm.planner.layout import Layout
from meshlm.planner.memory import estimate, layer_bytes
from meshlm.planner.moe_cp import cp_seconds, ep_seconds, kv_bytes, moe_mlp_terms
from meshlm.planner.search import evaluate, search
from meshlm.flops import mlp_flops_per_token

H100 = PRESETS["H100-80GB"]


def cfg_of(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(list(argv)))


# ----------------------------------------------------------------------------- model state, exactly

def _built_state(rank, world, argv):
    from meshlm.optim.distributed import build_optimizer
    from meshlm.parallel.data import DistributedDataParallel
    from meshlm.parallel.mesh import ParallelState
    from meshlm.model.chunks import build_model_chunks
    cfg = cfg_of(*argv)
    p = cfg.parallel
    ps = ParallelState.build(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                             p.expert_model_parallel_size)
    chunks = build_model_chunks(cfg, ps, 256, torch.float32)
    ddp = DistributedDataParallel(chunks, ps, cfg)
    r = build_optimizer(cfg, ps, chunks, ddp).memory_report()  # what the trainer prints at start
    return {"weights": r["weights_bytes"], "grads": r["grads_bytes"], "optimizer": r["optimizer_bytes"]}


@pytest.mark.parametrize("world,flags", [
    (4, ["--model", "mixtral-tiny", "--expert-model-parallel-size", "2"]),  # DP 4: dense /4, experts /2
    (2, ["--model", "tiny", "--context-parallel-size", "2"]),  # CP 2 × DP 1: /2 (over DP × CP)
])
def test_planned_state_is_the_built_runs_bytes_under_zero1(world, flags):
    argv = flags + ["--vocab-size", "256", "--micro-batch-size", "1", "--global-batch-size", str(world),
                    "--use-distributed-optimizer", "--nproc-per-node", str(world)]
    built = run_distributed(_built_state, world, argv)
    cfg = cfg_of(*argv)
    lay = Layout.of(cfg, world)
    assert lay.distributed_optimizer
    mem = estimate(cfg, lay, 256, half=False)  # CPU trains in fp32: 4 + 4 + 8 bytes before sharding
    for rank in built:
        assert {"weights": mem.weights, "grads": mem.grads, "optimizer": mem.optimizer} == rank


# ----------------------------------------------------------------------------- FLOPs and activations

def _moe(swiglu: bool, shared, dtype=torch.float64):
    from test_moe import _cfg, _layer
    m = _cfg(swiglu=swiglu, moe_shared_expert_intermediate_size=shared, add_bias_linear=not swiglu)
    m.num_experts, m.moe_router_topk = 8, 2
    return m, _layer(m, dtype)


@pytest.mark.parametrize("swiglu,shared", [(False, None), (True, 8)])
def test_moe_layer_forward_flops_are_the_formulas(swiglu, shared):
    from torch.utils.flop_counter import FlopCounterMode
    m, layer = _moe(swiglu, shared)
    x = torch.randn(8, 2, m.hidden_size, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    T, h, k, f_e, E = 16, m.hidden_size, 2, m.moe_ffn_hidden_size, 8
    # router 2·h·E; k experts: fc1 (2 halves under SwiGLU) and fc2; a shared expert of width 8 likewise
    per_token = 2 * h * E + k * (2 * h * f_e * (2 if swiglu else 1) + 2 * f_e * h) \
        + (2 * h * 8 * 2 + 2 * 8 * h if shared else 0)
    assert counter.get_total_flops() == T * per_token == T * mlp_flops_per_token(m, True)


@pytest.mark.parametrize("dtype,act", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_moe_layer_saves_the_planned_bytes_for_backward(dtype, act):
    m, layer = _moe(False, 8, dtype)
    keep = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(8, 2, 16, dtype=dtype, requires_grad=True)
    keep.add(x.untyped_storage().data_ptr())  # the layer input: the dense terms' mlp_input
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in keep and t.device.type == "cpu":
            saved[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    lay = Layout(micro_batch=2)
    assert m.seq_length == 8 and m.hidden_size == 16
    assert sum(saved.values()) == sum(moe_mlp_terms(m, 2, lay, act_bytes=act, fast=False).values())
    # an MoE layer's bytes: the dense layer's, its fc1/activation outputs replaced by the fast path's terms
    dense = layer_bytes(m, 2, lay, act_bytes=act)
    assert layer_bytes(m, 2, lay, act_bytes=act, moe=True) == pytest.approx(
        dense - 2 * act * 16 * ffn_hidden(m) + sum(moe_mlp_terms(m, 2, lay, act_bytes=act).values()))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_compiled_grouped_moe_layer_saves_the_planned_bytes_for_backward():
    """The GPU's fast path on CPU: the layer compiled, the experts' grouped GEMM forced on (bf16):
    its saved tensors are moe_mlp_terms(fast=True): under the DDP (the stacked expert weights a view
    of its buffer: no bytes of their own), and alone, as under ZeRO-3's per-bucket storage (the
    stacked weights a copy each call; what torch.compile's partitioner keeps; it differs from eager:
    the combine's fp32 copy is fused away). Compiled as Inductor splits forward from backward (its
    decompositions, its min-cut partition), without generating the kernels (seconds instead of a
    minute; the same saved tensors)."""
    import functools
    from functorch.compile import nop
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from test_moe import _cfg, _layer
    from meshlm import fast
    from meshlm.config import Config
    from meshlm.parallel.data import DistributedDataParallel
    from meshlm.parallel.mesh import ParallelState
    split_as_inductor = aot_autograd(fw_compiler=nop, bw_compiler=nop, decompositions=select_decomp_table(),
                                     partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                                    compiler="inductor"))
    m = _cfg(swiglu=True, add_bias_linear=False, hidden_size=32, num_attention_heads=4, seq_length=32,
             moe_aux_loss_coeff=0.01)
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 8, 2, 48
    for ddp, lay in ((True, Layout(micro_batch=2)), (False, Layout(dp=2, zero=3, micro_batch=2))):
        # as the fast path compiles (fast.compile_module): the eager step (the losses' attachment)
        # disabled first, so the layer breaks there whichever test ran before in this process
        torch._dynamo.reset()
        fast._before_compile()
        layer = _layer(m, torch.bfloat16)
        if ddp:
            DistributedDataParallel([layer], ParallelState.single(), Config())
        layer.experts.grouped = True
        keep = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        x = torch.randn(m.seq_length, 2, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        keep.add(x.untyped_storage().data_ptr())
        saved, shapes = {}, []

        def pack(t):
            if t.untyped_storage().data_ptr() not in keep:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                shapes.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.compile(layer, backend=split_as_inductor)(x)
        terms = moe_mlp_terms(m, 2, lay, act_bytes=2)
        assert terms["stacked_weights"] == (0 if ddp else 2 * 8 * 3 * 32 * 48)
        assert sum(saved.values()) == sum(terms.values()), \
            f"the compiled MoE layer's saved bytes changed (DDP {ddp}): update moe_cp.moe_mlp_terms: {shapes}"


def test_only_the_moe_layers_pay_the_expert_flops():
    common = ["--model", "mixtral-small", "--vocab-size", "32000", "--micro-batch-size", "1",
              "--global-batch-size", "64", "--bf16", "--moe-ffn-hidden-size", "14336"]
    times = {freq: evaluate(cfg_of(*common, "--moe-layer-freq", freq), Layout(dp=8, micro_batch=1), H100, 32000,
                            8).time.compute for freq in ("1", "2", "4")}
    dense = cfg_of(*common)
    dense.model.num_experts = None
    dense_t = evaluate(dense, Layout(dp=8, micro_batch=1), H100, 32000, 8).time.compute
    # k = 2 experts of 14336 against a dense MLP of 3584: every MoE layer costs more, half the layers half as much
    assert dense_t < times["4"] < times["2"] < times["1"]
    assert times["2"] - dense_t == pytest.approx((times["1"] - dense_t) / 2, rel=1e-9)



def test_expert_gemms_run_at_the_grouped_gemm_efficiency_and_the_stack_is_a_copy():
    """Halving GPU.grouped_gemm_efficiency adds exactly the routed experts' GEMM time once more
    (their waves' tile FLOPs at the grouped efficiency); the stacked weights cost nothing as a view of
    the DDP's buffer, and where copied (ZeRO-3) one read and one write a micro-batch, not the
    element-wise passes of an activation."""
    from meshlm.planner.cost import grouped_gemm_terms, step_time
    from meshlm.planner.moe_cp import stacked_copy, stacked_weight_bytes
    cfg = cfg_of("--model", "mixtral-small", "--vocab-size", "32000", "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--bf16")
    m, lay = cfg.model, Layout(micro_batch=2)
    kw = dict(gpus_per_node=8, params_per_rank=1)
    a = step_time(cfg, lay, H100, 32000, **kw).compute
    b = step_time(cfg, lay, dataclasses.replace(H100, grouped_gemm_efficiency=H100.grouped_gemm_efficiency / 2),
                  32000, **kw).compute
    rows = 2 * 2 * m.seq_length / 8  # k·T/E a local expert
    full, _ = grouped_gemm_terms(H100, 8, rows, m.hidden_size, moe_ffn(m), 2)
    assert b - a == pytest.approx(m.num_layers * full / H100.grouped_gemm_efficiency, rel=1e-9)
    assert stacked_weight_bytes(m, lay) == 0  # a view of the DDP's buffer
    import meshlm.planner.moe_cp as moe_cp
    without = step_time(cfg, lay, H100, 32000, **kw).compute
    try:
        moe_cp.stacked_copy = lambda layout: True  # as under ZeRO-3: a copy each call
        stacked = stacked_weight_bytes(m, lay)
        with_copy = step_time(cfg, lay, H100, 32000, **kw).compute
    finally:
        moe_cp.stacked_copy = stacked_copy
    assert stacked == 2 * 8 * 3 * m.hidden_size * moe_ffn(m)
    assert with_copy - without == pytest.approx(m.num_layers * 2 * stacked / H100.hbm_bytes_per_s, rel=1e-9)


# ----------------------------------------------------------------------------- communication

def test_ep_all_to_all_is_four_exchanges_of_the_routes_leaving_the_rank():
    m = cfg_of("--model", "mixtral-small", "--seq-length", "2048").model
    b, act, h, k = 2, 2, m.hidden_size, m.moe_router_topk
    routes = k * b * 2048  # T·k at TP 1, CP 1
    one = lambda ep, bw: (ep - 1) / ep * routes * h * act / bw + COLLECTIVE_LATENCY_S  # noqa: E731
    fwd, bwd = ep_seconds(m, b, Layout(dp=8, ep=8), H100, 8, act_bytes=act)
    assert (fwd, bwd) == pytest.approx((2 * one(8, H100.intra_node_bytes_per_s) + COLLECTIVE_LATENCY_S,
                                        2 * one(8, H100.intra_node_bytes_per_s)), rel=1e-12)
    assert ep_seconds(m, b, Layout(dp=8), H100, 8) == (0.0, 0.0)
    # EP 16 over two nodes: 8 of the 15 other ranks sit on the other node, behind the NIC
    fwd16, _ = ep_seconds(m, b, Layout(dp=16, ep=16), H100, 8, act_bytes=act)
    nic = 8 / 16 * routes * h * act / H100.inter_node_bytes_per_s + COLLECTIVE_LATENCY_S
    assert fwd16 == pytest.approx(2 * nic + COLLECTIVE_LATENCY_S, rel=1e-12) and fwd16 > 3 * fwd


def test_a_shared_expert_hides_the_dispatch_exchange_forward_and_backward_up_to_its_time():
    """parallel/experts.py runs the shared expert's forward and backward while the dispatch's
    exchange and its gradient exchange are in flight: one of the two exchanges each way is hidden,
    up to the shared expert's time."""
    m = cfg_of("--model", "mixtral-small", "--seq-length", "2048").model
    lay = Layout(dp=8, ep=8)
    fwd, bwd = ep_seconds(m, 2, lay, H100, 8)
    one = bwd / 2
    assert ep_seconds(m, 2, lay, H100, 8, shared_forward_s=10.0) == pytest.approx((fwd - one, bwd - one), rel=1e-12)
    small = one / 4
    assert ep_seconds(m, 2, lay, H100, 8, shared_forward_s=small) == pytest.approx((fwd - small, bwd - 2 * small),
                                                                                   rel=1e-12)
    # through the step's model: a shared expert leaves less EP time exposed than its absence would
    plain = cfg_of("--model", "mixtral-small", "--seq-length", "2048", "--micro-batch-size", "2",
                   "--global-batch-size", "16", "--expert-model-parallel-size", "8")
    shared = cfg_of("--model", "mixtral-small", "--seq-length", "2048", "--micro-batch-size", "2",
                    "--global-batch-size", "16", "--expert-model-parallel-size", "8",
                    "--moe-shared-expert-intermediate-size", "2048")
    from meshlm.planner.cost import step_time
    ep = [step_time(c, Layout.of(c, 8), H100, 32000, gpus_per_node=8, params_per_rank=1).ep_comm
          for c in (plain, shared)]
    assert 0 < ep[1] < ep[0]


def test_cp_ring_hides_each_hop_behind_a_block_and_exposes_the_fp32_gradient_hops():
    cfg = cfg_of("--model", "llama-1b", "--seq-length", "16384", "--context-parallel-size", "4")
    lay = Layout(cp=4, dp=2, micro_batch=1)
    kv = kv_bytes(cfg.model, 1, lay, 2)
    assert kv == 2 * (16384 / 4) * 8 * 64 * 2  # K and V: s/CP tokens × 8 groups × head dim 64, bf16
    hop = kv / H100.intra_node_bytes_per_s + COLLECTIVE_LATENCY_S
    grad = 2 * kv / H100.intra_node_bytes_per_s + COLLECTIVE_LATENCY_S  # fp32 dK/dV
    assert cp_seconds(cfg, 1, lay, H100, 8, attention_forward_s=1.0) == pytest.approx((0.0, 4 * grad))
    tiny = 4 * hop / 10  # blocks a tenth of a hop: 90% of each hop exposed
    fwd, bwd = cp_seconds(cfg, 1, lay, H100, 8, attention_forward_s=tiny)
    assert fwd == pytest.approx(3 * 0.9 * hop) and bwd == pytest.approx(3 * 0.8 * hop + 4 * grad)
    cfg.model.cp_comm_type = "all_gather"
    fwd, bwd = cp_seconds(cfg, 1, lay, H100, 8, attention_forward_s=1.0)
    gather = 3 * kv / H100.intra_node_bytes_per_s + COLLECTIVE_LATENCY_S
    assert (fwd, bwd) == pytest.approx((gather, gather + 3 * 2 * kv / H100.intra_node_bytes_per_s
                                        + COLLECTIVE_LATENCY_S))


# ----------------------------------------------------------------------------- search and analyze

def test_search_splits_experts_over_ep_for_an_moe_model():
    cfg = cfg_of("--model", "mixtral-small", "--vocab-size", "32000", "--micro-batch-size", "1",
                 "--global-batch-size", "64", "--bf16")
    fits, excluded = search(cfg, 8, H100, 32000, gpus_per_node=8)
    eps = {f.layout.ep for f in fits}
    assert eps >= {1, 2, 4, 8}
    ep8 = next(f for f in fits if f.layout.ep == 8 and f.layout.dp == 8)
    ep1 = next(f for f in fits if f.layout.ep == 1 and dataclasses.replace(f.layout, ep=8) == ep8.layout)
    assert ep8.memory.weights < ep1.memory.weights and ep8.time.ep_comm > 0 == ep1.time.ep_comm
    assert "--expert-model-parallel-size 8" in " ".join(ep8.layout.flags())


def test_search_tries_cp_for_a_long_sequence_only():
    cfg = cfg_of("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "65536",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16")
    fits, _ = search(cfg, 8, PRESETS["H200-141GB"], 32000, gpus_per_node=8)
    assert any(f.layout.cp > 1 for f in fits)
    short = cfg_of("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "2048",
                   "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16")
    assert all(f.layout.cp == 1 for f in search(short, 8, H100, 32000, gpus_per_node=8)[0])


def test_search_tries_cp_for_a_long_sequence_moe_model_but_not_an_fp8_one(capsys):
    """plan said "CP > 1: not searched for an MoE model (meshlm does not run MoE with CP yet)", but
    meshlm trains MoE under CP (the parity matrix's cp2 × moe cases); only FP8 MoE with CP is refused."""
    argv = ["--model", "mixtral-tiny", "--vocab-size", "512", "--seq-length", "8192", "--micro-batch-size", "1",
            "--global-batch-size", "8"]
    fits, _ = search(cfg_of(*argv), 2, PRESETS["H200-141GB"], 512, gpus_per_node=2)
    moe_cp = [f.layout for f in fits if f.layout.cp > 1]
    assert moe_cp and any(lay.ep > 1 for lay in moe_cp)
    fp8 = cfg_of(*argv, "--bf16", "--fp8-format", "hybrid")
    assert all(f.layout.cp == 1 for f in search(fp8, 2, PRESETS["H200-141GB"], 512, gpus_per_node=2)[0])
    from meshlm import cli
    cli.main(["plan", *argv, "--num-gpus", "2", "--gpus-per-node", "2", "--top", "1"])
    out = capsys.readouterr().out
    assert "does not run MoE with CP" not in out and "not searched for an MoE model" not in out


def test_analyze_names_exposed_ep_time_with_the_ep_fixes():
    records = [{"iteration": i, "iter_ms": 100.0, "comm_share": {"ep": 0.4, "dp": 0.05}} for i in range(1, 6)]
    config = {"parallel": {"expert_model_parallel_size": 8}, "model": {}, "training": {}}
    report = analyze(records, config)
    assert report["dominant"] == "ep"
    [ep] = [f for f in report["findings"] if f["kind"] == "ep"]
    assert ep["severity"] == "warn" and "EP all-to-all" in ep["message"]
    assert {"--expert-model-parallel-size": "4"} in [fix["flags"] for fix in ep["fixes"]]


def _timed_dispatch_and_ring(rank, world):
    from meshlm.parallel import comm, context
    from meshlm.parallel.experts import dispatch_combine
    group = torch.distributed.new_group([0, 1])
    tokens = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    routing = torch.zeros(6, 2, dtype=torch.bool)
    routing[:, rank] = routing[::2, 1 - rank] = True
    gates = routing.double() / 2
    comm.start_timing()
    dispatch_combine(tokens, gates, routing, lambda x, *_: 2 * x, group, routing, 1)[0].sum().backward()
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    context.attention(q, k, v, group, "p2p").sum().backward()
    return comm.stop_timing()


def test_expert_dispatch_and_the_cp_ring_are_timed_as_ep_and_cp():
    for timed in run_distributed(_timed_dispatch_and_ring, 2):
        assert set(timed) == {"ep", "cp"} and all(0 < s < 10 for s in timed.values())


def test_grouped_gemm_waves_count_tiles_over_the_sms_and_calibration_recovers_its_constants():
    """The wave model by hand at one shape (8 experts × 1,024 rows, h 1,024, f_e 512, SwiGLU, 132
    SMs: ⌈8·8·4/132⌉ = 2 waves of K = 1,024 for forward fc1, …), and ``fit_grouped`` gives back the
    efficiency and per-wave cost that produced two times."""
    from meshlm.planner.calibrate import fit_grouped
    from meshlm.planner.cost import grouped_gemm_seconds, grouped_gemm_terms
    gpu = dataclasses.replace(H100, sm_count=132, grouped_gemm_efficiency=1.0, grouped_wave_s=0.0)
    full, waves = grouped_gemm_terms(gpu, 8, 1024, 1024, 512, 2)
    # (M, N, K): (1024, 1024, 1024) (1024, 1024, 512) (1024, 512, 1024) (1024, 1024, 1024) (1024, 1024, 1024) (512, 1024, 1024)
    tiles = [8 * 8 * 4, 8 * 8 * 4, 8 * 8 * 2, 8 * 8 * 4, 8 * 8 * 4, 8 * 4 * 4]
    ks = [1024, 512, 1024, 1024, 1024, 1024]
    n = [-(-t // 132) for t in tiles]
    assert waves == sum(n)
    assert full == pytest.approx(sum(w * 2 * 128 * 256 * k for w, k in zip(n, ks)) / (H100.peak_flops / 132), rel=1e-12)
    assert grouped_gemm_terms(gpu, 8, 100, 1024, 512, 2)[1] > 0  # a small group takes the 64 × 128 tile
    true = dataclasses.replace(gpu, grouped_gemm_efficiency=0.7, grouped_wave_s=3e-6)
    shapes = [(8, 4096, 1024, 3584, 2), (8, 1024, 1024, 3584, 2)]
    eff, tau = fit_grouped(gpu, [(grouped_gemm_seconds(true, *s), s) for s in shapes])
    assert eff == pytest.approx(0.7, rel=1e-9) and tau == pytest.approx(3e-6, rel=1e-6)
