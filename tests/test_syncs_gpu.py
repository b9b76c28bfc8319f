"""The step's device work between the backward and the grad norm makes no host sync (a blocking
copy there drains the GPU before the optimizer step is launched): the loss reduction, the MoE
aux losses' scale set and the routing statistics, under torch.cuda.set_sync_debug_mode("error")."""

import pytest
import torch

from meshlm.config import Config
from meshlm.model.moe import MoELayer, MoEState, start_routing_stats
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.pipeline import reduce_losses
from meshlm.parallel.tensor import ShardedInit

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_reduction_and_routing_statistics_make_no_host_sync(per_token):
    dev = torch.device("cuda", 0)
    ps = ParallelState.single(dev)
    m = Config().model
    m.num_layers, m.num_experts, m.moe_aux_loss_coeff = 2, 4, 1e-2
    losses = [{"lm_loss": torch.tensor(v, device=dev), "num_tokens": torch.tensor(4, device=dev)} for v in (2.0, 4.0)]
    state = MoEState(dev)
    init = lambda name: ShardedInit((1, 1, name), 0.2)  # noqa: E731
    layer = MoELayer(m, ps, 1, init, init, state, sequence_parallel=False, params_dtype=torch.float32)
    layer.routing_counts.copy_(torch.tensor([1.0, 2.0, 3.0, 2.0, 8.0, 1.0]))  # one call's statistics
    layer.routing_losses.copy_(torch.tensor([0.5, 0.0]))
    chunk = torch.nn.ModuleList([layer])
    scale = torch.tensor(0.25, dtype=torch.float64, device=dev) if per_token else 0.25
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.scale = scale  # the pipeline's per-step set: a copy or fill on the device
        loss = reduce_losses(losses, ps, per_token)
        finish = start_routing_stats([chunk], ps, m)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert loss.item() == (6.0 / 8 if per_token else 3.0)
    assert finish() == {1: {"tokens": [1.0, 2.0, 3.0, 2.0], "routes": 8.0, "aux": 0.5, "z": None}}
