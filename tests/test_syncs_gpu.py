"""A launched training step makes no host sync (trainer.launch_step); nor does the device work
between the backward and the grad norm (a blocking copy there would drain the GPU before the
optimizer step is launched): the loss reduction, the MoE aux losses' scale set and the routing
statistics, under torch.cuda.set_sync_debug_mode("error")."""

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


def _launch_syncs(rank, world):
    """The host syncs of one launched training step (after two warm-up steps), the mixtral-like
    tiny model of test_layouts_gpu at --log-interval 1 (the loss, routing statistics and timing
    of a log step included); and whether its optimizer step was deferred."""
    import warnings

    from meshlm.training import trainer
    from test_layouts_gpu import MODEL, MOE, _config
    run = trainer.build(_config(MODEL + MOE, 1))
    state = trainer.TrainState()
    for _ in range(2):
        trainer.train_step(run, state)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step = trainer.launch_step(run, state)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    loss = trainer.finish_step(run, step)
    return ([f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:90]}" for w in caught
             if "called a synchronizing" in str(w.message)], loss, step.deferred)


def test_a_launched_training_step_makes_no_host_sync():
    """The loop's launch_step queues forward, backward, loss, clip and update without the host
    waiting for the GPU (the optimizer step deferred: optim/optimizer.py), so the host runs ahead
    into the next step; finish_step reads the loss and grad norm afterwards."""
    from distributed import run_distributed
    syncs, loss, deferred = run_distributed(_launch_syncs, 1)[0]
    assert deferred and loss is not None and loss == loss
    assert syncs == [], "\n".join(syncs)
