"""The host's (CPU's) time of a training step, and the step when the GPU waits for it.

A step's kernels are launched by one Python thread (forwards, the optimizer) and autograd's device
thread (backwards), one at a time. When they launch a phase's kernels more slowly than the GPU runs
them, the GPU idles: the step is *host-bound*. It happens with many small kernels — MoE layers at
few tokens (bench/RESULTS.md 2026-12-04: the E 16 top-1 step at 2 × 4,096 tokens, GPU kernels 77.5
ms, host 100–175 ms), small micro-batches, FP8's extra casts.

Host seconds, measured on the H200's host (a 16-core VM; bench/host_probe.py at 256 tokens a
micro-batch, where the GPU is never the bottleneck, 8–24 steps of each of 12 configurations; fit and
figures: bench/RESULTS.md, 2026-12-04 session 13) × 0.92 (the probe ran two processes at once; the
factor fits the six recorded host-bound runs, each alone), scaled by ``GPU.host_scale`` (1 on the
presets; ``plan --calibrate`` measures it, ``launch_seconds``):

- each micro-batch on a rank: ``MICROBATCH_S`` (embedding, loss, the data) plus each layer's forward
  and backward: ``LAYER_S`` + ``LAYER_PARAM_S`` per parameter tensor of the layer (autograd's
  AccumulateGrad and dynamo's guards grow with them: 6 in a Llama layer, 12 with biases and
  LayerNorm); an MoE layer adds ``MOE_LAYER_S`` + ``MOE_EXPERT_S`` per local expert (the routing's
  kernels, the per-expert parameters and their grads); an FP8 layer ``FP8_LINEAR_S`` per linear (its
  amaxes, casts and ``_scaled_mm``). Of each, ``FORWARD_SHARE`` is the forward's. A fully recomputed
  layer runs its forward again in the backward: its own forward host time (an MoE or FP8 layer's
  with its MoE and FP8 terms) plus the checkpoint's wrapper, ``RECOMPUTE_WRAPPER_S`` = the probe's
  Llama-layer recompute ``RECOMPUTE_LAYER_S`` less that layer's forward (until session 14 every
  layer cost ``RECOMPUTE_LAYER_S``: an MoE layer's recompute was under-predicted, bench/RESULTS.md);
  a recomputed MoE layer's checkpointed forward costs ``RECOMPUTE_MOE_FORWARD_S`` more and its
  backward ``RECOMPUTE_MOE_BACKWARD_S`` more (session 15's probe);
- each step: the optimizer, one compiled call for all the flat-AdamW runs (``FLAT_CALL_S``) and
  ``RUN_S`` a run within it (optim/adamw.py ``flat_steps``; a run is the range of a bucket holding one
  update group, each bucket laid out by group (parallel/data.py): 2 a dense bucket (decayed, not), one
  more with μP's hidden LR, one more where --decoupled-lr sets the embeddings apart; ``flat_runs``)
  and ``OPT_PARAM_S`` per parameter tensor (the grad views), plus ``STEP_S`` (zero_grad, the loss
  read, the log line) and per MoE layer ``MOE_STATS_S`` + ``MOE_STATS_EXPERT_S`` · E (the routing
  statistics logged each step at --log-interval 1).

The step (``step_phases``, ``overlapped``), as training/trainer.py runs it. The deferred loop
(``deferred``: bf16/fp32, no --skip-nan-steps, no offloaded optimizer shards) launches a step with no
host sync and finishes it (reads its loss and grad norm) at the next step's start, before that step's
zero_grad; the norm is copied to the host before the update is queued, so its read waits for the norm
only. At t = 0 the host has just read the previous step's norm and the GPU still holds that step's
update (U, the optimizer's update GPU seconds). The host then does the step's bookkeeping (B: the
previous step's log, zero_grad, the data), launches each micro-batch's forward and backward
(F_j, B_j host; their GPU seconds with the backward's main_grad fold), then the grad norm and the
update (O, host); the step ends when the GPU has run this step's norm (T: the pipeline bubble, p2p, the
exposed DP reduction and the norm) and the host has launched the update, whose GPU time U carries into
the next step. Phases i = (host H_i, GPU G_i) in launch order:

    [(B, U), (F_1, f_1), (B_1, b_1), …, (F_m, f_m), (B_m, b_m), (O, T)]

The GPU runs a phase's kernels as they are launched, after the phase before it, so the step is

    max( max_k (Σ_{i<k} H_i + Σ_{i≥k} G_i), Σ_i H_i )

(k = 0: GPU-bound throughout, U + Σ f + Σ b + T; the last term: host-bound throughout, the host's
B + Σ (F + B) + O; between: the host's time up to the phase the GPU last waited on, then the GPU's from
there). The host runs ahead of the GPU across the step boundary by at most U: the update is the only
work queued when it reads the norm. The synchronous loop (fp16's loss scaler, --skip-nan-steps,
offloaded shards) reads the norm before it launches the update, so the GPU is empty at t = 0:
[(O, U), (B, 0), (F_1, f_1), …, (B_m, b_m), (0, T)] (the norm's own launch is counted in O).
"""

from __future__ import annotations

import math

from ..config import Config

MICROBATCH_S = 1.5e-3
LAYER_S = 1.2e-3
LAYER_PARAM_S = 0.07e-3
# the MoE layer as one compiled graph: bench/host_probe.py alone on the H200, 2026-12-04 session 15 (E 8 top-2,
# 8 layers, 256 tokens: forward + backward 35.05 ms on a host 1.18× the reference's, by the dense d16 probe of
# the same call (44.52 ms against these constants' 37.74) → 29.71 ms here; was 2.75 ms, measured while the
# layer broke at its losses' attachment)
MOE_LAYER_S = 1.63e-3
MOE_EXPERT_S = 0.043e-3
FP8_LINEAR_S = 0.28e-3
RECOMPUTE_LAYER_S = 1.4e-3
FORWARD_SHARE = 0.45
RECOMPUTE_WRAPPER_S = RECOMPUTE_LAYER_S - FORWARD_SHARE * (LAYER_S + 6 * LAYER_PARAM_S)
# a fully recomputed MoE layer beyond that rule (the same probe, E 8 top-2 with and without full recompute, at
# the reference): forward +1.05 ms a layer (the checkpointed forward, run without grad, is a second compiled
# graph), backward +0.42 ms over its forward again and the wrapper; a dense layer's forward is not slower
RECOMPUTE_MOE_FORWARD_S = 1.05e-3
RECOMPUTE_MOE_BACKWARD_S = 0.42e-3
# until session 15 each run was a compiled call of its own, and 0.22 ms a run was measured (host_probe): that
# is now the one call's cost; a run inside it (a view, a list entry, one kernel launched by the compiled
# wrapper) is an estimate, not yet measured (bench/host_probe.py refits both)
FLAT_CALL_S = 0.22e-3
RUN_S = 0.02e-3
OPT_PARAM_S = 0.0055e-3
STEP_S = 2.3e-3
MOE_STATS_S = 0.14e-3
MOE_STATS_EXPERT_S = 0.009e-3
# launch_seconds of a host on which these constants hold: the session-13 second call's H200 host measured
# 6.57 µs and ran that call's host-bound steps at 0.80× the constants' time (bench/RESULTS.md, in-sample).
# A rough unit only: one lent host read 7.6–11.3 µs within minutes (session 15), and a scale from it moved two
# of three host-influenced runs further from the measured step than host_scale 1 did
REFERENCE_LAUNCH_S = 8.2e-6


def layer_tensors(cfg: Config, moe: bool, local_experts: float) -> int:
    """Parameter tensors of one layer: 2 norms (LayerNorm: weight and bias each), QKV, projection and
    the MLP's two linears (each + bias with --add-bias-linear); an MoE layer's MLP: the router, and
    with ``local_experts`` > 0 their fc1 and fc2 each (counted for the optimizer; a layer's host time
    takes the experts' share as ``MOE_EXPERT_S``, so ``microbatch_seconds`` passes 0)."""
    m = cfg.model
    norms = 4 if m.normalization == "LayerNorm" else 2
    bias = 2 if m.add_bias_linear else 1
    if moe:
        return norms + 2 * bias + 1 + 2 * int(local_experts)
    return norms + 4 * bias


def microbatch_seconds(cfg: Config, moe: list, fp8: list, local_experts: float, recomputed: int) -> tuple:
    """(forward, backward) host seconds of one micro-batch on a rank holding layers whose MoE and FP8
    flags are ``moe`` and ``fp8``, the first ``recomputed`` of them fully recomputed (module doc: a
    recomputed layer's forward again and ``RECOMPUTE_WRAPPER_S``, in the backward; a recomputed MoE
    layer also ``RECOMPUTE_MOE_FORWARD_S`` in the forward and ``RECOMPUTE_MOE_BACKWARD_S`` in the backward)."""
    total, again, first = MICROBATCH_S, 0.0, 0.0
    for n, (is_moe, is_fp8) in enumerate(zip(moe, fp8)):
        layer = LAYER_S + LAYER_PARAM_S * layer_tensors(cfg, is_moe, 0)
        if is_moe:
            layer += MOE_LAYER_S + MOE_EXPERT_S * local_experts
        if is_fp8:
            layer += FP8_LINEAR_S * 4
        total += layer
        if n < recomputed:
            again += FORWARD_SHARE * layer + RECOMPUTE_WRAPPER_S + (RECOMPUTE_MOE_BACKWARD_S if is_moe else 0.0)
            first += RECOMPUTE_MOE_FORWARD_S if is_moe else 0.0
    return FORWARD_SHARE * total + first, (1 - FORWARD_SHARE) * total + again


def flat_runs(cfg: Config, moe: list, dense_params: float, expert_params: float, bucket: float,
              embeddings: int, stack_buckets: bool = False) -> int:
    """Flat-AdamW runs a step on a rank (module doc): per bucket of the dense buffer one per update
    group (decayed and not; μP's hidden matrices; the embedding tables held, under --decoupled-lr);
    the expert buffer's buckets, or with ``stack_buckets`` (config.half_grads: each stack of experts a
    bucket, parallel/data.py) its weight stacks, 2 an MoE layer."""
    groups = 2 + bool(cfg.model.use_mup) + bool(embeddings and cfg.optimizer.decoupled_lr is not None)
    experts = 0 if not expert_params else 2 * sum(moe) if stack_buckets else math.ceil(expert_params / bucket)
    return groups * math.ceil(dense_params / bucket) + experts


def step_seconds(cfg: Config, moe: list, runs: int, tensors: int) -> tuple:
    """(optimizer, bookkeeping) host seconds of a step (module doc)."""
    n_moe = sum(moe)
    return (FLAT_CALL_S if runs else 0.0) + RUN_S * runs + OPT_PARAM_S * tensors, \
        STEP_S + n_moe * (MOE_STATS_S + MOE_STATS_EXPERT_S * (cfg.model.num_experts or 0))


def launch_seconds(device, launches: int = 2000, repeats: int = 5) -> float:
    """Host seconds of one small eager kernel launch on ``device`` (an in-place add on 16 elements,
    ``launches`` back to back, no sync inside; the best of ``repeats``): the unit by which
    ``plan --calibrate`` compares this host with the H200's (``REFERENCE_LAUNCH_S``)."""
    import time

    import torch
    x = torch.zeros(16, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(launches):
            x.add_(1.0)
        best = min(best, time.perf_counter() - t0)
    sync()
    return best / launches


def deferred(cfg: Config) -> bool:
    """Whether the training loop defers the optimizer step (module doc; trainer.launch_step: the
    optimizer ``can_defer`` and no --skip-nan-steps): no fp16 loss scaler, no --skip-nan-steps, no
    --optimizer-cpu-offload shards."""
    o = cfg.optimizer
    return not (cfg.training.fp16 or cfg.training.skip_nan_steps
                or (o.optimizer_cpu_offload and o.optimizer_offload_fraction > 0))


def step_phases(is_deferred: bool, book: float, launch_opt: float, update: float, microbatches: list,
                tail: float) -> list:
    """[(host s, GPU s)] of one step in launch order (module doc): ``book`` B and ``launch_opt`` O host
    seconds, ``update`` U GPU seconds, ``microbatches`` [(F_j, f_j), (B_j, b_j), …], ``tail`` T GPU
    seconds up to the end of the grad norm; the deferred loop's or, ``is_deferred`` False, the
    synchronous loop's."""
    if is_deferred:
        return [(book, update)] + list(microbatches) + [(launch_opt, tail)]
    return [(launch_opt, update), (book, 0.0)] + list(microbatches) + [(0.0, tail)]


def repeated(block: list, n: int) -> list:
    """``block`` [(host s, GPU s), …] n times, as phases for ``overlapped``: the first and the last
    copy as they are, the n − 2 between as one phase of their sums. For each position in the block,
    overlapped's term is linear in the copy's index, so its maximum lies in the first or the last
    copy: the same result as n copies, in O(len(block)) (a plan at --global-batch-size 10**15 built
    2·10**15 phases and ran out of memory)."""
    if n <= 2:
        return list(block) * n
    middle = ((n - 2) * sum(h for h, _ in block), (n - 2) * sum(g for _, g in block))
    return list(block) + [middle] + list(block)


def overlapped(phases: list) -> float:
    """Seconds until the GPU has run every phase [(host s, GPU s)], launched in order, and the host
    has launched them: max(max_k (Σ_{i<k} H_i + Σ_{i≥k} G_i), Σ H_i) (module doc)."""
    gpu_left, host_before, end = sum(g for _, g in phases), 0.0, 0.0
    for h, g in phases:
        end = max(end, host_before + gpu_left)
        host_before += h
        gpu_left -= g
    return max(end, host_before)


def rescaled(phases: list, scale: float) -> float:
    """Seconds of the step whose phases [(host s, GPU s)] (``StepTime.phases``) were modelled for one
    host, on a host ``scale`` times as slow (``launch_seconds`` over the first host's): ``overlapped``
    with every host time × ``scale``; the same as the planner with ``GPU.host_scale`` × ``scale``."""
    return overlapped([(scale * h, g) for h, g in phases])
