"""The planner's host-time term (planner/host.py): the overlap of host and GPU phases, by hand, and
its place in cost.step_time."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest

from meshlm.config import ONE_RANK_BUCKET, add_config_args, config_from_args
from meshlm.planner import host
from meshlm.planner.cost import step_time
from meshlm.planner.gpus import PRESETS
from meshlm.planner.layout import Layout

H200 = PRESETS["H200-141GB"]


def cfg_of(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_overlapped_by_hand():
    """GPU-bound throughout: the GPU's sum; host-bound throughout: the host's sum; mixed: the host's
    time up to the phase the GPU last waited on, then the GPU's from there."""
    assert host.overlapped([(1.0, 5.0), (1.0, 5.0)]) == 10.0
    assert host.overlapped([(5.0, 1.0), (5.0, 1.0)]) == 10.0
    # phase 1 host-bound (4 vs 1), phase 2 GPU-bound (1 vs 6): the GPU starts phase 2 at 4, ends at 10
    assert host.overlapped([(4.0, 1.0), (1.0, 6.0)]) == 10.0
    # the reverse: GPU 6 then the host's 4 of phase 2 were launched by 5, its GPU 1 ends at 7
    assert host.overlapped([(1.0, 6.0), (4.0, 1.0)]) == 7.0


def _simulated(phases):
    """The GPU's end, phase by phase: phase k's kernels start once the GPU has run phase k − 1 and the
    host has begun launching k, and end no sooner than the host has launched all of k."""
    host_at, gpu_at = 0.0, 0.0
    for h, g in phases:
        gpu_at = max(gpu_at, host_at) + g
        host_at += h
        gpu_at = max(gpu_at, host_at)
    return gpu_at


def test_overlapped_is_the_phase_by_phase_simulation():
    """The closed form max(max_k (Σ_{i<k} H + Σ_{i≥k} G), Σ H) equals stepping through the phases."""
    rng = random.Random(7)
    for _ in range(200):
        phases = [(rng.uniform(0, 3), rng.uniform(0, 3)) for _ in range(rng.randint(1, 8))]
        assert host.overlapped(phases) == pytest.approx(_simulated(phases), rel=1e-12)


def test_repeated_micro_batches_give_the_overlap_of_every_copy():
    """host.repeated folds the copies between the first and the last into one phase: the overlap of
    n copies (with the step's other phases around them), in O(1) copies; a plan at
    --global-batch-size 10**15 listed 2·10**15 phases (MemoryError)."""
    rng = random.Random(11)
    for _ in range(200):
        block = [(rng.uniform(0, 3), rng.uniform(0, 3)) for _ in range(2)]
        n = rng.randint(1, 9)
        head, tail = [(rng.uniform(0, 3), rng.uniform(0, 3))], [(rng.uniform(0, 3), rng.uniform(0, 3))]
        assert host.overlapped(head + host.repeated(block, n) + tail) == \
            pytest.approx(_simulated(head + block * n + tail), rel=1e-12)
    assert len(host.repeated(block, 10**15)) == 5
    cfg = cfg_of("--model", "gpt2-125m", "--vocab-size", "50257", "--global-batch-size", str(10**15))
    from meshlm.planner.search import evaluate
    assert evaluate(cfg, Layout(dp=8, micro_batch=8), H200, 50257, 8).time.total > 0


def test_step_phases_deferred_and_synchronous_by_hand():
    """The deferred loop: the previous update (U 4) runs under the bookkeeping (3); host-bound, the
    step is the host's 3 + 2 + 2 + 2 = 9 (the norm, GPU 1, ran while the update was launched). The
    synchronous loop: the update is launched first (2), the norm is read after the host's 9: 10."""
    mbs = [(2.0, 1.0), (2.0, 1.0)]
    d = host.step_phases(True, 3.0, 2.0, 4.0, mbs, 1.0)
    assert d == [(3.0, 4.0), (2.0, 1.0), (2.0, 1.0), (2.0, 1.0)]
    assert host.overlapped(d) == 9.0
    s = host.step_phases(False, 3.0, 2.0, 4.0, mbs, 1.0)
    assert s == [(2.0, 4.0), (3.0, 0.0), (2.0, 1.0), (2.0, 1.0), (0.0, 1.0)]
    assert host.overlapped(s) == 10.0
    # GPU-bound: the deferred step is the GPU's U + Σ G + T whatever the host's order
    assert host.overlapped(host.step_phases(True, 1.0, 0.5, 6.0, [(1.0, 3.0)], 2.0)) == 11.0


def test_deferred_follows_the_trainer():
    """bf16 defers; fp16's loss scaler, --skip-nan-steps and offloaded optimizer shards do not."""
    base = ("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "256", "--max-position-embeddings", "256")
    assert host.deferred(cfg_of(*base, "--bf16"))
    assert not host.deferred(cfg_of(*base, "--fp16"))
    assert not host.deferred(cfg_of(*base, "--bf16", "--skip-nan-steps"))
    assert not host.deferred(cfg_of(*base, "--bf16", "--optimizer-cpu-offload"))


def test_recomputed_layer_runs_its_own_forward_again():
    """Full recompute adds the layer's own forward host time and the checkpoint's wrapper in the
    backward: a Llama layer the probe's RECOMPUTE_LAYER_S (its forward unchanged), an MoE layer its MoE
    terms too and the probe's extra MoE costs, RECOMPUTE_MOE_FORWARD_S in the forward and
    RECOMPUTE_MOE_BACKWARD_S in the backward."""
    llama = cfg_of("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "256",
                   "--max-position-embeddings", "256")
    f0, b0 = host.microbatch_seconds(llama, [False] * 3, [False] * 3, 0, 0)
    f1, b1 = host.microbatch_seconds(llama, [False] * 3, [False] * 3, 0, 2)
    assert f1 == f0 and b1 - b0 == pytest.approx(2 * host.RECOMPUTE_LAYER_S, rel=1e-12)
    moe = cfg_of(*MOE_ARGS)
    f0, b0 = host.microbatch_seconds(moe, [True], [False], 16, 0)
    f1, b1 = host.microbatch_seconds(moe, [True], [False], 16, 1)
    layer = host.LAYER_S + host.LAYER_PARAM_S * host.layer_tensors(moe, True, 0) + host.MOE_LAYER_S \
        + host.MOE_EXPERT_S * 16
    assert f1 - f0 == pytest.approx(host.RECOMPUTE_MOE_FORWARD_S, rel=1e-12)
    assert b1 - b0 == pytest.approx(host.FORWARD_SHARE * layer + host.RECOMPUTE_WRAPPER_S
                                    + host.RECOMPUTE_MOE_BACKWARD_S, rel=1e-12)
    assert b1 - b0 > host.RECOMPUTE_LAYER_S + 1e-3


MOE_ARGS = ("--model", "mixtral-small", "--vocab-size", "32000", "--seq-length", "256", "--max-position-embeddings",
            "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--bf16", "--num-experts", "16",
            "--moe-router-topk", "1")


def test_host_term_in_step_time():
    """A few-token MoE step is host-bound (total = the host's seconds, more than the GPU's); a large
    dense step is GPU-bound (no idle); the host's seconds follow host.py's constants; host_scale
    scales them, and so does ``host.rescaled`` of the step's phases."""
    moe = cfg_of(*MOE_ARGS)
    lay = Layout(micro_batch=1)
    t = step_time(moe, lay, H200, 32000, gpus_per_node=1, params_per_rank=10 ** 9)
    assert t.host_idle > 0 and t.total == pytest.approx(t.host, rel=1e-9)
    m = moe.model
    per_layer = host.LAYER_S + host.LAYER_PARAM_S * host.layer_tensors(moe, True, 0) + host.MOE_LAYER_S \
        + host.MOE_EXPERT_S * 16
    per_mb = host.MICROBATCH_S + m.num_layers * per_layer
    flags = [True] * m.num_layers
    embeddings = 1 + m.untie_embeddings_and_output_weights  # RoPE: no position table
    runs = host.flat_runs(moe, flags, 10 ** 9, 0, ONE_RANK_BUCKET, embeddings)  # one GPU: one bucket
    assert runs == 2  # its decayed and its non-decayed params, each laid out together (parallel/data.py)
    tensors = m.num_layers * host.layer_tensors(moe, True, 16) + embeddings + 1
    assert t.host - 2 * per_mb == pytest.approx(sum(host.step_seconds(moe, flags, runs, tensors)), rel=1e-9)
    slow = step_time(moe, lay, dataclasses.replace(H200, host_scale=2.0), 32000, gpus_per_node=1,
                     params_per_rank=10 ** 9)
    assert slow.host == pytest.approx(2 * t.host, rel=1e-9)
    assert host.rescaled(t.phases, 1.0) == pytest.approx(t.total, rel=1e-12)
    assert host.rescaled(t.phases, 2.0) == pytest.approx(slow.total, rel=1e-12)
    assert host.rescaled(t.phases, 1e-6) < t.total  # a fast host: the GPU's time, not the host's
    # the synchronous loop reads the norm after the host's last launch: host-bound, it ends the norm's
    # GPU seconds (4 bytes a parameter: two micro-batches, so no bf16 buckets) after the host
    sync = step_time(cfg_of(*MOE_ARGS, "--skip-nan-steps"), lay, H200, 32000, gpus_per_node=1,
                     params_per_rank=10 ** 9)
    assert sync.host == pytest.approx(t.host, rel=1e-12)
    assert sync.total - sync.host == pytest.approx(4 * 10 ** 9 / H200.hbm_bytes_per_s, rel=1e-9)
    dense = cfg_of("--model", "llama-1b", "--vocab-size", "32000", "--seq-length", "4096",
                   "--max-position-embeddings", "4096", "--micro-batch-size", "4", "--global-batch-size", "4",
                   "--bf16")
    d = step_time(dense, Layout(micro_batch=4), H200, 32000, gpus_per_node=1, params_per_rank=10 ** 9)
    assert d.host_idle == pytest.approx(0.0, abs=1e-12) and d.host < d.total


def test_launch_seconds_is_a_positive_time_per_launch():
    """The calibration's unit: seconds of one small op's launch, on the CPU here."""
    small = host.launch_seconds("cpu", 50, 2)
    assert 0 < small < 1e-2


def test_one_backward_steps_fold_no_expert_gradient_and_run_the_optimizer_per_stack():
    """Under config.half_grads (one micro-batch, bf16, one GPU) the routed experts' buckets take the
    grouped GEMMs' weight gradients uncopied (parallel/grad_buffer.py ``adopt``): the optimizer's GPU
    seconds lose the experts' fold, 4 bytes a parameter, and each stack of experts is a flat run of
    its own (2 an MoE layer). With two micro-batches (fp32 buckets) the experts fold as before."""
    one = cfg_of(*MOE_ARGS, "--global-batch-size", "1", "--bf16")
    lay, n, e = Layout(micro_batch=1), 10 ** 9, 6 * 10 ** 8
    with_experts = step_time(one, lay, H200, 32000, gpus_per_node=1, params_per_rank=n, expert_params_per_rank=e)
    none = step_time(one, lay, H200, 32000, gpus_per_node=1, params_per_rank=n)
    assert none.optimizer - with_experts.optimizer == pytest.approx(4 * e / H200.hbm_bytes_per_s, rel=1e-9)
    flags = [True] * one.model.num_layers
    assert host.flat_runs(one, flags, n - e, e, ONE_RANK_BUCKET, 2, stack_buckets=True) \
        == host.flat_runs(one, flags, n - e, e, ONE_RANK_BUCKET, 2) - 1 + 2 * len(flags)
    two = cfg_of(*MOE_ARGS, "--bf16")
    assert step_time(two, lay, H200, 32000, gpus_per_node=1, params_per_rank=n, expert_params_per_rank=e).optimizer \
        == pytest.approx(step_time(two, lay, H200, 32000, gpus_per_node=1, params_per_rank=n).optimizer, rel=1e-12)



def _optimizer(cfg):
    """(model, DDP, optimizer) of cfg on one CPU process."""
    from meshlm.model.transformer import GPTModel
    from meshlm.optim.distributed import build_optimizer
    from meshlm.parallel.data import DistributedDataParallel
    from meshlm.parallel.mesh import ParallelState
    ps = ParallelState.single()
    model = GPTModel(cfg.model, ps, cfg.model.vocab_size, seed=1)
    ddp = DistributedDataParallel([model], ps, cfg)
    return model, ddp, build_optimizer(cfg, ps, [model], ddp)


@pytest.mark.parametrize("extra", [(), ("--use-mup", "--mup-base-hidden-size", "32"), ("--decoupled-lr", "1e-3"),
                                   ("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                                    "--position-embedding-type", "rope")])
def test_the_optimizers_flat_runs_are_the_planners_two_a_bucket_and_one_a_further_update_group(extra):
    """Each bucket is laid out by update group (parallel/data.py), so a GPT layer's weights and biases no
    longer alternate: a one-GPU GPT of 4 layers made 34 runs, each a kernel torch.compile generated
    (the first optimizer step of GPT-2.7B compiled for 2–3 minutes). The optimizer's runs are the
    planner's count; in several buckets, 2 a bucket (each holds weights and norms)."""
    cfg = cfg_of("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1", *extra)
    m = cfg.model
    model, _, opt = _optimizer(cfg)
    n = sum(p.numel() for p in model.parameters())
    embeddings = 1 + (m.position_embedding_type == "learned_absolute") + m.untie_embeddings_and_output_weights
    assert len(opt._flat_runs()) == host.flat_runs(cfg, [False] * 4, n, 0, ONE_RANK_BUCKET, embeddings)
    if not extra:
        cfg.parallel.ddp_bucket_size = n // 3
        _, ddp, opt = _optimizer(cfg)
        buckets = sum(len(b.buckets) for b in ddp.buffers)
        assert buckets >= 3 and len(opt._flat_runs()) == 2 * buckets
