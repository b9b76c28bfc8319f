"""The router's half-input logits GEMM (model/router_gemm.py) against the fp32 GEMM it replaces:
logits and the input's gradient to fp32 rounding, the weight's gradient within one bf16 rounding,
eager and compiled (fullgraph)."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.model.router_gemm import router_logits

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_half_router_logits_match_the_fp32_gemm(compiled):
    torch.manual_seed(0)
    x0 = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(4096, 8, device="cuda")
    fn = torch.compile(router_logits, fullgraph=True) if compiled else router_logits
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.linear(xr.float(), wr.float())
    ref.backward(g)
    assert y.dtype == torch.float32
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.allclose(x.grad.float(), xr.grad.float(), rtol=2 ** -8, atol=0)
    assert (w.grad.float() - wr.grad.float()).abs().max() <= 2 ** -7 * wr.grad.float().abs().max()
