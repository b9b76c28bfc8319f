"""The real FP8 GEMM (torch._scaled_mm on Hopper's tensor cores) against the emulation of
parallel/fp8.py, forward and backward, eager and compiled (the fast path), in bf16."""

import pytest
import torch

from meshlm.parallel.fp8 import Fp8Recipe, fp8_linear

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU (compute capability ≥ 8.9)")
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("compiled", [False, True])
def test_scaled_mm_matches_the_emulation(fmt, compiled):
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(4, 256, 512, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(768, 512, device="cuda", generator=g) / 20).bfloat16()
    dy = torch.randn(4, 256, 768, device="cuda", generator=g).bfloat16()
    out = {}
    for emulate in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn = torch.compile(fp8_linear) if compiled and not emulate else fp8_linear
        y = fn(x, w, Fp8Recipe(fmt, emulate=emulate), None, False)
        y.backward(dy)
        out[emulate] = (y.float(), x.grad.float(), w.grad.float())
    for real, emulated in zip(out[False], out[True]):
        # both accumulate in fp32 and round once to bf16: they differ by the bf16 rounding of the output
        assert float((real - emulated).norm() / emulated.norm()) < 4e-3
    exact = x0.float() @ w0.float().t()
    assert float((out[False][0] - exact).norm() / exact.norm()) > 1e-3  # the GEMM did run in FP8


@pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU (compute capability ≥ 8.9)")
@pytest.mark.parametrize("blocks", [None, [93, 77, 0, 130]])
@pytest.mark.parametrize("compiled", [False, True])
def test_expert_grouped_fp8_gemms_match_the_emulation(blocks, compiled):
    """The experts' grouped FP8 GEMMs (parallel/fp8_experts.py: torch._scaled_grouped_mm, rowwise, the
    weight gradient per block; EP = 1's block per expert and EP = 2's blocks with an empty one, rows
    uneven and not a multiple of 16), eager and compiled, against their emulation, forward and
    backward, in bf16; and the GEMM did round to FP8."""
    from meshlm.parallel.fp8_experts import fp8_expert_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(300, 256, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(2, 512, 256, device="cuda", generator=g) / 20).bfloat16()
    dy = torch.randn(300, 512, device="cuda", generator=g).bfloat16()
    counts = torch.tensor([170, 130], device="cuda")
    out = {}
    for emulate in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        # EP = 1 compiles whole (no graph break: the fast path fuses the quantization with the layer)
        fn = fp8_expert_linear
        if compiled and not emulate:
            fn = torch.compile(fp8_expert_linear, fullgraph=blocks is None)
        y = fn(x, w, counts, blocks, Fp8Recipe("hybrid", emulate=emulate), None)
        y.backward(dy)
        out[emulate] = (y.float(), x.grad.float(), w.grad.float())
    for real, emulated in zip(out[False], out[True]):
        assert float((real - emulated).norm() / emulated.norm()) < 4e-3
    exact = torch.cat([x0[:170].float() @ w0[0].float().t(), x0[170:].float() @ w0[1].float().t()])
    assert float((out[False][0] - exact).norm() / exact.norm()) > 1e-3


def _train_fp8(param_gather: bool, steps: int = 12, recipe: str = "tensorwise") -> tuple:
    """Losses of a small Llama (4 layers, h 256) trained in bf16 with FP8 GEMMs (hybrid) on the fast path
    through the production DDP buffers and distributed optimizer (DP 1), with or without
    --fp8-param-gather, under ``recipe`` (delayed: history 4, max, pushed after each step's gradient
    sync as the trainer does); dynamo's graph count after step 3 and at the end, the optimizer, the model."""
    from meshlm.parallel import fp8_delayed
    from meshlm.config import Config
    from meshlm.fp8_rules import fp8_layers
    from meshlm.model.chunks import apply_fp8
    from meshlm.model.transformer import GPTModel
    from meshlm.optim.distributed import build_optimizer
    from meshlm.parallel.data import DistributedDataParallel
    from meshlm.parallel.mesh import ParallelState

    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.ffn_hidden_size = 4, 256, 8, 128, 512
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    m.add_bias_linear, m.untie_embeddings_and_output_weights = False, True
    m.group_query_attention, m.num_query_groups = True, 4
    m.hidden_dropout = m.attention_dropout = 0.0
    t.bf16, t.fast_path, t.fp8_format, t.fp8_param_gather = True, "on", "hybrid", param_gather
    if recipe == "delayed":
        t.fp8_recipe, t.fp8_amax_history_len, t.fp8_amax_compute_algo = "delayed", 4, "max"
    cfg.parallel.use_distributed_optimizer = True
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 3e-4, 0
    ps = ParallelState.single(torch.device("cuda", 0))
    model = GPTModel(m, ps, 1000, seed=7, params_dtype=torch.bfloat16, fast=True)
    apply_fp8(model, Fp8Recipe.of(t, ps.device), fp8_layers(t, m.num_layers), param_gather=param_gather)
    ddp = DistributedDataParallel([model], ps, cfg)
    opt = build_optimizer(cfg, ps, [model], ddp)
    data = torch.randint(0, 1000, (2, 4, 129), generator=torch.Generator().manual_seed(0)).cuda()
    losses, graphs = [], []
    torch._dynamo.utils.counters.clear()
    for step in range(steps):
        ddp.zero_grad()
        loss = model(data[step % 2, :, :-1], data[step % 2, :, 1:]).mean()
        loss.backward()
        ddp.finish_grad_sync()
        fp8_delayed.end_step(fp8_delayed.delayed_states([model]), ())
        assert opt.step().ok
        losses.append(loss.item())
        if step in (2, steps - 1):
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return losses, graphs, opt, model


@pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU (compute capability ≥ 8.9)")
def test_fp8_param_gather_trains_on_the_real_fp8_path():
    """--fp8-param-gather on the GPU (torch._scaled_mm, compiled layers, fused AdamW): each FP8 weight's
    FP8 copy is the E4M3 cast of its fp32 master with the master's amax scale, byte for byte; it
    trains like the path that casts the bf16 param (rounded once more, so within bf16 tolerance), and
    compiles no new graph after step 3."""
    from meshlm.parallel.fp8 import E4M3, quantize, scale_of

    plain, *_ = _train_fp8(False)
    gathered, graphs, opt, _ = _train_fp8(True)
    assert gathered[-1] < 0.9 * gathered[0], "the model must learn (two batches repeated)"
    for step, (a, b) in enumerate(zip(gathered, plain)):
        assert abs(a - b) <= 2e-2 * abs(b), (step, a, b)
    assert graphs[0] > 0 and graphs[0] == graphs[1], f"recompiled after step 3: {graphs}"
    checked = 0
    for s in opt.shards:
        for f in s.fragments:
            if hasattr(f.param, "fp8_data"):
                master = s.master[f.lo:f.hi]
                want = quantize(master, scale_of(master.abs().amax(), E4M3), E4M3)
                assert torch.equal(f.param.fp8_data.reshape(-1).view(torch.uint8), want.view(torch.uint8))
                checked += 1
    assert checked == 4 * 4  # four linears in each of the four layers


@pytest.mark.skipif(not _fp8_gpu(), reason="needs an FP8 GPU (compute capability ≥ 8.9)")
def test_the_delayed_recipe_trains_on_the_real_fp8_path_like_tensorwise():
    """--fp8-recipe delayed on the GPU (compiled layers, scales from 4 steps of amax history, max):
    every linear's history fills, it learns as the tensorwise recipe does (the scales differ by at most
    the weights' drift over 4 steps: within 2e-2), and compiles no new graph once the history runs."""
    from meshlm.parallel import fp8_delayed

    current, *_ = _train_fp8(False)
    delayed, graphs, _, model = _train_fp8(False, recipe="delayed")
    states = fp8_delayed.delayed_states([model])
    assert len(states) == 4 * 4 and all(st.steps == 12 for st in states)  # every step pushed, every linear
    for st in states:  # the histories full of real amaxes, and the scales taken from their maxima
        assert bool((st.history > 0).all())
        assert torch.equal(st.scale, st.fp8_max / st.history.amax(1))
    assert delayed[-1] < 0.9 * delayed[0], "the model must learn (two batches repeated)"
    for step, (a, b) in enumerate(zip(delayed, current)):
        assert abs(a - b) <= 2e-2 * abs(b), (step, a, b)
    assert graphs[0] > 0 and graphs[0] == graphs[1], f"recompiled after step 3: {graphs}"
