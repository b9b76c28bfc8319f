"""The parity harness over NCCL on GPUs: pipeline schedules (batched p2p, freed outputs) and ZeRO-1
with both overlaps, in float64 on the GPUs against one process, at the same 1e-10 as on CPU."""

import pytest
import torch

from distributed import run_distributed
from parity import Case, parity_errors, train_layout

pytestmark = pytest.mark.gpu


def _worker(rank, world, case):
    return train_layout(case)


def _single(rank, world, case):
    return train_layout(Case(tied=case.tied, layers=case.layers))


LAYOUTS = {
    "1f1b": dict(pp=2, schedule="1f1b"),
    "gpipe": dict(pp=2, schedule="gpipe"),
    "interleaved": dict(pp=2, vpp=2),
    "zero1-overlap": dict(dp=2, dist_opt=True, overlap_grad=True, overlap_param=True, tied=False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nccl_layouts_match_one_gpu_in_float64(name):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    case = Case(**LAYOUTS[name])
    (ref,) = run_distributed(_single, 1, case, backend="nccl")
    results = run_distributed(_worker, case.world, case, backend="nccl")
    assert not parity_errors(case, results, ref)
