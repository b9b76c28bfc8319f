"""Pipeline schedules over NCCL on GPUs: batched p2p, freed outputs, parity with one GPU."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed import _free_port
from meshlm.parallel.mesh import ParallelState
from test_pipeline_parity import STEPS, _config, _train

pytestmark = pytest.mark.gpu


def _worker(rank, world, port, layout, m, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        ps = ParallelState.build(pp=world)
        result = _train(_config(pp=world, layers=2 * world, **layout), ps, m, tied=True)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout,m", [({}, 8), ({"schedule": "gpipe"}, 4), ({"v": 2}, 8)],
                         ids=["1f1b", "gpipe", "interleaved"])
def test_nccl_pipeline_over_all_gpus_matches_one_gpu(tmp_path, layout, m):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs 2 GPUs")
    mp.spawn(_worker, args=(world, _free_port(), layout, m, str(tmp_path)), nprocs=world)
    ref = _train(_config(layers=2 * world), ParallelState.single(torch.device("cuda", 0)), m, tied=True)
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        for name, w in got["weights"].items():
            assert (w - ref["weights"][name]).abs().max() <= 1e-5 * ref["weights"][name].abs().max(), name
