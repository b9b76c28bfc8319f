"""On the CUDA fast path with one backward a step (config.half_grads), each stack of experts' bf16
gradient bucket is the grouped GEMM's weight gradient itself, not a copy of it (parallel/grad_buffer.py
``adopt``), through the compiled MoE layer and the trainer's step."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _adopted(rank, world):
    """Per stack of the first MoE layer: (its gradient's address as autograd set it, its bucket's
    grad's address after the step's fold), over two training steps; and whether half_grads held."""
    from meshlm.training import trainer
    from test_layouts_gpu import MODEL, MOE, _config
    run = trainer.build(_config(MODEL + MOE + ["--global-batch-size", "2"], 1))
    ddp = run.ddp
    experts = next(m for c in run.chunks for m in c.modules() if hasattr(m, "stacks"))
    seen = {}
    for role, stack in experts.stacks().items():
        stack[0].register_post_accumulate_grad_hook(lambda p, role=role: seen.__setitem__(role, p.grad.data_ptr()))
    state, pairs = trainer.TrainState(), []
    for _ in range(2):
        trainer.train_step(run, state)
        pairs.append({role: (seen[role], ddp.bucket_of(stack[0])[1].grad.data_ptr())
                      for role, stack in experts.stacks().items()})
    return pairs, ddp.half_grads


def test_expert_stacks_take_the_grouped_gemms_weight_gradient_uncopied():
    from distributed import run_distributed
    pairs, half = run_distributed(_adopted, 1)[0]
    assert half
    for step in pairs:
        assert step and all(a == b for a, b in step.values()), step
