"""Expert parallelism and MoE under context parallelism equal one process (float64, gloo;
DESIGN.md "Correctness rule").

Every case trains the same MoE model (layers 0 and 2 MoE with 4 experts, top-2, sigmoid scores
with the aux-loss-free expert bias, load-balancing and z-loss, a shared expert) through the
production path, and compares losses, grad norms, the logged routing figures and every updated
weight — router, experts, shared expert, the rest — with the single-process run
(tests/parity.py), at 1e-10 relative. Under CP the load-balancing loss counts the routes of the
whole sequence (summed over TP × CP), so a CP rank's share differs from a loss of its own tokens.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from parity import Case, assert_parity

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

MOE = (("moe_layer_freq", "2"), ("moe_router_score_function", "sigmoid"),
       ("moe_router_enable_expert_bias", True), ("moe_router_bias_update_rate", 1e-2),
       ("moe_aux_loss_coeff", 1e-2), ("moe_z_loss_coeff", 1e-3), ("moe_shared_expert_intermediate_size", 8))


def moe_case(**layout) -> Case:
    return Case(experts=4, moe=MOE, **layout)


def test_ep2_and_ep4_equal_one_process():
    assert_parity(moe_case(dp=4, ep=2), moe_case(dp=4, ep=4))


def test_ep_with_tp_sp_pp_and_the_distributed_optimizer():
    assert_parity(moe_case(dp=2, tp=2, sp=True, ep=2),
                  moe_case(dp=2, pp=2, ep=2, schedule="1f1b"),
                  moe_case(dp=4, ep=2, dist_opt=True, overlap_grad=True, overlap_param=True))


def test_moe_under_cp2_with_and_without_ep_and_per_token_loss_equals_one_process():
    assert_parity(moe_case(cp=2), moe_case(cp=2, ep=2, per_token=True))


def test_moe_under_cp2_with_tp_sp_and_ep_over_dp_cp_with_zero1():
    """EP = 2 inside CP = 2 at TP = 2 + SP (token group TP × CP); EP = 4 over DP × CP under ZeRO-1."""
    assert_parity(moe_case(cp=2, tp=2, sp=True, ep=2),
                  moe_case(cp=2, dp=2, ep=4, dist_opt=True, overlap_grad=True))


def test_compiled_moe_fast_path_equals_one_process():
    """--fast-path on (compiled on CPU, as on CUDA; the dense counterpart is test_parity_matrix's
    compiled test): two layers, the first MoE, compiled with EP = 1's fixed-slot dispatch under
    capacity dropping (sigmoid scores, expert bias, aux and z-loss, a shared expert), in one process:
    DP adds nothing inside a compiled layer (the eager MoE cases above run it at DP, TP, PP, CP, EP),
    and each rank would compile the same graphs again. The dense layer is the Llama layer of
    test_parity_matrix's compiled cases (Inductor's on-disk cache compiles it once)."""
    cap = MOE + (("moe_expert_capacity_factor", 1.0),)
    assert_parity(Case(experts=4, moe=cap, layers=2, tied=False, pos="rope", norm="RMSNorm", swiglu=True,
                       fast="on"))


def _overlapped_dispatch(rank, world):
    """The EP = 2 dispatch with a side computation: the order of its exchanges, waits and the
    side's call, forward and backward, and output and gradients with the side against without
    (float64)."""
    import torch
    import torch.distributed as dist
    from meshlm.parallel.experts import dispatch_combine
    log, plain = [], dist.all_to_all_single

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            log.append("wait")
            return self.work.wait()

    def logged(*args, async_op=False, **kwargs):
        log.append(f"a2a async={async_op}")
        out = plain(*args, async_op=async_op, **kwargs)
        return Work(out) if async_op else out

    class Logged(torch.autograd.Function):  # the side's backward, as it runs
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dx):
            log.append("side backward")
            return dx

    dist.all_to_all_single = logged
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    routing = torch.zeros(6, 2, dtype=torch.bool)
    routing[:, rank] = routing[::2, 1 - rank] = True
    gates = routing.double() / 2
    shared = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    results = []
    for overlap in (False, True):
        log.clear()

        def side():
            log.append("side")
            return Logged.apply(tokens @ shared)
        y, s = dispatch_combine(tokens, gates, routing, lambda x, *_: 3 * x.sin(), dist.group.WORLD,
                                routing, 1, side if overlap else None)
        s = side() if s is None else s
        forward = list(log)
        log.clear()
        grads = torch.autograd.grad((y + s).square().sum(), (tokens, shared))
        results.append((forward, list(log), (y + s).detach(), grads))
    dist.all_to_all_single = plain
    return results


def test_shared_expert_runs_while_the_ep_exchange_is_in_flight():
    for (plain_log, plain_back, y0, g0), (log, back, y1, g1) in run_distributed(_overlapped_dispatch, 2):
        assert plain_log == ["a2a async=False"] * 3 + ["side"], plain_log
        assert log == ["a2a async=False", "a2a async=True", "side", "wait", "a2a async=False"], log
        assert plain_back == ["side backward"] + ["a2a async=False"] * 2, plain_back
        # backward: the reverse exchange of the rows' gradients in flight over the side's backward
        assert back == ["a2a async=False", "a2a async=True", "side backward", "wait"], back
        torch.testing.assert_close(y1, y0, rtol=0, atol=0)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
