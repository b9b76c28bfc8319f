"""The experts' SwiGLU backward kernel (model/swiglu.py, one Triton pass) against autograd on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.model.swiglu import swiglu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, f", [(4099, 48), (1000, 3584)])  # a ragged tile; the mixtral-small width
def test_one_pass_backward_matches_autograd_eager_and_compiled(dtype, rows, f):
    """dy within one rounding to dtype of autograd's fp32 gradient at the same (dtype-exact)
    inputs (the kernel computes in fp32), the value unchanged, eagerly and compiled with Inductor."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    y32 = (torch.randn(rows, 2 * f, device=dev, generator=gen) * 3).to(dtype).float()
    dz32 = torch.randn(rows, f, device=dev, generator=gen).to(dtype).float()
    y32.requires_grad_()
    gate, up = y32.chunk(2, dim=-1)
    want = F.silu(gate) * up
    (want_dy,) = torch.autograd.grad(want, y32, dz32)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for fn in (swiglu, torch.compile(swiglu, fullgraph=True)):
        y = y32.detach().to(dtype).requires_grad_()
        z = fn(y)
        (dy,) = torch.autograd.grad(z, y, dz32.to(dtype))
        assert dy.dtype == dtype and dy.shape == y.shape
        torch.testing.assert_close(dy.float(), want_dy, **tol)
        torch.testing.assert_close(z.float(), want, **tol)
