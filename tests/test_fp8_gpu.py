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
