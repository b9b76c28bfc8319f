"""The conjugate collectives: each forward and backward equals the single-process computation.

Two gloo ranks. Rank r's input is a known function of r, and the upstream gradient of rank r is
(r + 1) · G; the expected values are computed here from the full tensors, without communication.
"""

import pytest
import torch

from distributed import run_distributed
from meshlm.parallel import comm
from meshlm.parallel.mesh import ParallelState

WORLD = 2


def _full(seed):
    return torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(fn, x, rank):
    """y = fn(x); backward with upstream (rank + 1) · G. Returns (y, x.grad)."""
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward((rank + 1) * _full(99)[tuple(slice(0, n) for n in y.shape)])
    return y.detach(), x.grad


def _worker(rank, world):
    g = ParallelState.build(tp=world).tp_group
    x = _full(0)
    up = _full(99)
    total_up = sum(q + 1 for q in range(world))  # Σ_q (q + 1)
    out = {}

    y, gx = _run(lambda t: comm.copy_to_tp(t, g), x, rank)
    out["copy_to_tp"] = torch.equal(y, x) and torch.allclose(gx, total_up * up)

    y, gx = _run(lambda t: comm.reduce_from_tp(t, g), x * (rank + 1), rank)
    out["reduce_from_tp"] = torch.allclose(y, total_up * x) and torch.allclose(gx, (rank + 1) * up)

    y, gx = _run(lambda t: comm.scatter_to_tp(t, g), x, rank)
    expected_grad = torch.cat([(q + 1) * up[..., :3] for q in range(world)], dim=-1)
    out["scatter_to_tp"] = torch.equal(y, x.chunk(world, -1)[rank]) and torch.allclose(gx, expected_grad)

    y, gx = _run(lambda t: comm.gather_from_tp(t, g), x.chunk(world, -1)[rank], rank)
    out["gather_from_tp"] = torch.equal(y, x) and torch.allclose(gx, ((rank + 1) * up).chunk(world, -1)[rank])

    y, gx = _run(lambda t: comm.gather_reduce_tp(t, g), x.chunk(world, -1)[rank], rank)
    out["gather_reduce_tp"] = torch.equal(y, x) and torch.allclose(gx, (total_up * up).chunk(world, -1)[rank])

    y, gx = _run(lambda t: comm.scatter_to_sp(t, g), x, rank)
    expected_grad = torch.cat([(q + 1) * up[:2] for q in range(world)])
    out["scatter_to_sp"] = torch.equal(y, x.chunk(world)[rank]) and torch.allclose(gx, expected_grad)

    y, gx = _run(lambda t: comm.gather_from_sp(t, g), x.chunk(world)[rank], rank)
    out["gather_from_sp"] = torch.equal(y, x) and torch.allclose(gx, (total_up * up).chunk(world)[rank])

    y, gx = _run(lambda t: comm.reduce_scatter_to_sp(t, g), x * (rank + 1), rank)
    expected_grad = torch.cat([(q + 1) * up[:2] for q in range(world)])
    out["reduce_scatter_to_sp"] = (torch.allclose(y, (total_up * x).chunk(world)[rank])
                                   and torch.allclose(gx, expected_grad))

    comm.reset_stats()
    comm.all_reduce(torch.ones(10), g)                     # 40 bytes in
    comm.all_gather(torch.ones(5, dtype=torch.float64), g, 0)  # 40 bytes in
    comm.reduce_scatter(torch.ones(8, 2), g, 0)            # 64 bytes in
    comm.reduce_scatter(torch.ones(8, 2), g, 0)
    out["stats"] = comm.snapshot_stats()
    return out


def test_every_collective_matches_its_single_process_rule():
    for rank, out in enumerate(run_distributed(_worker, WORLD)):
        stats = out.pop("stats")
        assert out == {name: True for name in out}, f"rank {rank}: {out}"
        assert stats == {
            "all_reduce": {"calls": 1, "bytes": 40, "ring_bytes": 40 * 2 * (WORLD - 1) / WORLD},
            "all_gather": {"calls": 1, "bytes": 40, "ring_bytes": 40 * (WORLD - 1)},
            "reduce_scatter": {"calls": 2, "bytes": 128, "ring_bytes": 128 * (WORLD - 1) / WORLD},
        }


@pytest.mark.parametrize("fn", [comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp,
                                comm.scatter_to_sp, comm.gather_from_sp, comm.reduce_scatter_to_sp,
                                comm.gather_reduce_tp])
def test_group_of_one_is_identity_and_records_nothing(fn):
    comm.reset_stats()
    x = torch.randn(4, 2, 6)
    assert fn(x, None) is x
    assert comm.snapshot_stats() == {}
