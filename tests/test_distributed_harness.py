"""The multi-process harness (tests/distributed.py): a hang fails at the timeout with every worker's stacks."""

import time

import pytest
import torch.distributed as dist

from distributed import run_distributed


def _stays_away():
    time.sleep(3600)


def _rank0_never_comes(rank, world):
    if rank == 0:
        _stays_away()
    dist.barrier()  # where rank 1 waits for it
    return rank


def _nothing(rank, world):
    return rank


@pytest.mark.slow
def test_a_hung_worker_fails_at_the_timeout_naming_where_each_rank_waits():
    """Rank 1 waits in a barrier rank 0 never reaches: the call fails after its 3 s, not the ten
    minutes a hang held CI for, with rank 0's stack in its sleep and rank 1's in the barrier."""
    assert run_distributed(_nothing, 1) == [0]  # the forkserver started (its imports take seconds once)
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_distributed(_rank0_never_comes, 2, timeout_s=3)
    assert time.monotonic() - start < 20
    rank0, rank1 = str(failed.value).split("rank 1: still running after 3 s, killed")
    assert "rank 0: still running after 3 s, killed" in rank0
    assert "in _stays_away" in rank0 and "in barrier" not in rank0
    assert "in barrier" in rank1 and "in _rank0_never_comes" in rank1 and "in _stays_away" not in rank1
