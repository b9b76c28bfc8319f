"""The flat AdamW update compiled on the GPU (optim/adamw.py flat_adamw_) against torch's fused kernel."""

import pytest
import torch

from meshlm import fast
from meshlm.optim.adamw import Group, Run, adamw_, flat_adamw_, flat_steps

pytestmark = pytest.mark.gpu


def test_compiled_flat_update_matches_the_fused_kernel_and_compiles_once():
    """Runs of three sizes, decayed and not, with clipping's grad scale, five steps with a changing
    LR: masters and moments within fp32 rounding of torch._fused_adamw_, the bf16 params the new
    masters, the grads untouched, and one graph for every size and step."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sizes, decays = (3_000_001, 4096, 1_048_576), (True, False, True)
    state = [{k: torch.randn(n, device=dev, generator=gen) * 1e-2 for k in ("master", "grad", "exp_avg")}
             for n in sizes]
    for s in state:
        s["exp_avg_sq"] = torch.rand(s["master"].shape, device=dev, generator=gen) * 1e-5
    ref = [{k: t.clone() for k, t in s.items()} for s in state]
    outs = [torch.empty(n, device=dev, dtype=torch.bfloat16) for n in sizes]
    kernel = fast.compile_fn(flat_steps, dynamic=True)
    torch._dynamo.utils.counters.clear()
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 6):
        lr = 3e-4 * step
        grads = [s["grad"].clone() for s in ref]
        flat_adamw_([Run(s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], o, d)
                     for s, o, d in zip(state, outs, decays)], step=step, lr=lr, grad_scale=1.5, kernel=kernel, **kw)
        adamw_([Group([s["master"]], [g], [s["exp_avg"]], [s["exp_avg_sq"]], d) for s, g, d in zip(ref, grads, decays)],
               step=step, lr=lr, fused=True, grad_scale=1.5, **kw)
    for s, r, o in zip(state, ref, outs):
        # fp32 rounding of the update (up to 0.5 here; masters near 0 after it cancel): a few ulps of it
        for k, atol in (("master", 2e-7), ("exp_avg", 1e-8), ("exp_avg_sq", 1e-10)):
            torch.testing.assert_close(s[k], r[k], rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
        assert torch.equal(o, s["master"].to(torch.bfloat16))
        assert torch.equal(s["grad"], r["grad"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_flat_update_with_bf16_moments_is_the_eager_one():
    """--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: from the same state, a step of the compiled
    flat kernel reads the bf16 moments widened and stores them rounded, as the eager flat_steps and
    the fused multi-tensor path on widened copies (adamw._narrow_moments) do: masters within fp32
    rounding, moments within one bf16 rounding (a product rounded another way can round a moment the
    other way, which later steps then carry: so each step starts from the compiled kernel's state)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    n = 2_000_003
    got = {"master": torch.randn(n, device=dev, generator=gen) * 1e-2,
           "exp_avg": (torch.randn(n, device=dev, generator=gen) * 1e-3).bfloat16(),
           "exp_avg_sq": (torch.rand(n, device=dev, generator=gen) * 1e-6).bfloat16()}
    grad = torch.randn(n, device=dev, generator=gen) * 1e-2
    kernel = fast.compile_fn(flat_steps, dynamic=True)
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, lr=3e-4, grad_scale=1.5)
    for step in range(1, 4):
        eager, multi = ({k: t.clone() for k, t in got.items()} for _ in range(2))
        for s, kern in ((got, kernel), (eager, flat_steps)):
            flat_adamw_([Run(s["master"], grad, s["exp_avg"], s["exp_avg_sq"], None, True)], step=step, kernel=kern, **kw)
        adamw_([Group([multi["master"]], [grad], [multi["exp_avg"]], [multi["exp_avg_sq"]], True)], step=step,
               fused=True, **kw)
        for other in (eager, multi):
            assert other["exp_avg"].dtype == got["exp_avg"].dtype == torch.bfloat16
            torch.testing.assert_close(got["master"], other["master"], rtol=1e-5, atol=2e-7)
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[k].float(), other[k].float(), rtol=2 ** -7, atol=1e-9)
