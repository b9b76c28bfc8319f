"""The CP attention alone (parallel/context.py) against one full causal SDPA call, float64, over
gloo: forward and dQ/dK/dV of every rank's rows, both comm types, GQA, packed documents."""

import pytest
import torch

from distributed import run_distributed

B, HEADS, D, TOL = 2, 4, 8, 1e-10


def _inputs(s: int, groups: int, packed: bool):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, HEADS, s, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, groups, s, D, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, HEADS, s, D, generator=g, dtype=torch.float64)
    docs = None
    if packed:  # documents of random lengths; sample 1 ends one at the first token
        eod = torch.rand(B, s, generator=g) < 0.3
        eod[1, 0] = True
        docs = torch.cumsum(eod.long(), 1) - eod.long()
    return q, k, v, dout, docs


def _reference(s, groups, packed):
    from meshlm.model.attention import attention_mask

    q, k, v, dout, docs = _inputs(s, groups, packed)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None if docs is None else attention_mask(docs)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                           enable_gqa=groups != HEADS)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, s, settings):
    import torch.distributed as dist
    from meshlm.parallel.context import attention, local_positions

    results = []
    for groups, packed, comm_type in settings:
        q, k, v, dout, docs = _inputs(s, groups, packed)
        rows = local_positions(world, rank, s)
        q, k, v = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, dist.group.WORLD, comm_type, docs)
        out.backward(dout[:, :, rows])
        results.append((rows, out.detach(), q.grad, k.grad, v.grad))
    return results


SETTINGS = [(4, False, "p2p"), (2, False, "all_gather"), (1, False, "p2p"), (2, True, "p2p"),
            (4, True, "all_gather")]  # (query groups of 4 heads, packed documents, --cp-comm-type)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_causal_sdpa_forward_and_backward(cp):
    """One set of processes per CP size runs every setting (process starts dominate the time)."""
    s = 8 * cp
    per_rank = run_distributed(_worker, cp, s, SETTINGS)
    for i, setting in enumerate(SETTINGS):
        want = _reference(s, *setting[:2])
        for results in per_rank:
            rows, *got = results[i]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                b = b[:, :, rows]
                err = float((a - b).norm() / b.norm())
                assert err < TOL, f"{setting} {name}: relative error {err:.2e}"


def test_zigzag_positions_cover_the_sequence_once_and_balance_causal_work():
    from meshlm.parallel.context import local_positions

    for cp in (1, 2, 3, 4):
        rows = [local_positions(cp, r, 4 * cp) for r in range(cp)]
        assert sorted(torch.cat(rows).tolist()) == list(range(4 * cp))
        work = {int((r + 1).sum()) for r in rows}  # causal keys seen by each rank's queries
        assert len(work) == 1, (cp, work)
