"""Step-time model of a layout: compute, TP/CP/EP/PP/DP communication, pipeline bubble, optimizer.

Per micro-batch, on the slowest pipeline rank (its model chunks summed; the last one also computes
the logits):

- GEMMs: the model FLOPs of its layers and logits (``flops.flops_per_iteration``,
  Narayanan et al. 2021 §5.1, taken as f(L = 1) − f(L = 0) per dense layer; an MoE layer's MLP as
  ``flops.mlp_flops_per_token``, its routed experts as the grouped GEMM's tiles and waves at their
  own per-expert shape (``grouped_gemm_seconds``, rows from ``moe_cp.expert_rows``)),
  less attention core, divided by TP × CP (CP: each rank has s/CP tokens and, zigzag-balanced, 1/CP
  of the causal attention work), at ``peak × gemm_efficiency(M, K, N)`` — a saturating curve per GEMM dimension,
  x / (x + GEMM_HALF_DIM), with M the micro-batch's tokens, h, the per-rank attention width a·d/t and
  MLP width f/t. Attention core (12·s²·a·d·b FLOPs a layer, fwd + bwd, the 4·s·a·d-per-token term of
  the same formula) runs at ``peak × attention_efficiency(s/CP, head dim)``, a curve that rises
  with the sequence (a per-row cost beside the quadratic work) and the head dim. Recompute adds forward work: full, one
  forward of every layer (1/3 of its FLOPs and its element-wise passes); selective, core attention's.
- element-wise kernels (norms, RoPE, activations, residuals, the loss): memory-bound, about
  ``ELEMENTWISE_PASSES`` reads and writes of every byte a layer stores for backward
  (``memory.layer_terms``), and of the logits, at the GPU's HBM bandwidth; an MoE layer's stored
  bytes (``moe_cp.moe_mlp_terms``: the dispatched rows, the experts' outputs, the routing tensors)
  carry its permute, unpermute and router passes the same way, and the grouped GEMM's stacked copy
  of the expert weights (``moe_cp.stacked_weight_bytes``: ZeRO-3 only) one read and one write a micro-batch.
- TP (Megatron's f/g, Shoeybi et al. 2019 §3): without SP, 2 all-reduces of the [s, b, h] activation
  in forward and 2 in backward, each 2(t−1)/t · bytes / NVLink bandwidth; with SP, 4 all-gathers or
  reduce-scatters in forward and 6 in backward (meshlm all-gathers the s/t QKV and FC1 inputs again),
  each (t−1)/t · bytes / bandwidth; full recompute repeats the forward ones. meshlm's TP collectives
  are blocking, so all of it is on the critical path, plus ``COLLECTIVE_LATENCY_S`` each. An MoE
  layer without a shared expert has no MLP collectives (its experts run at TP 1 on the rank's s/t rows).
- EP all-to-all and CP's K/V exchange (ring, partly hidden behind the blocks' attention, or
  all-gather): ``moe_cp.ep_seconds`` and ``moe_cp.cp_seconds``, each layer; full recompute repeats
  their forward part.
- FP8 layers (--fp8-format): their linears' GEMM time / ``fp8_speedup`` at the layer's GEMM
  dimensions (FP8 GEMMs on their own size curve: ``GPU.fp8_gemm_speedup`` for large GEMMs, less for
  small ones through ``GPU.fp8_half_dim``; both measured by `plan --calibrate`), plus the weights' casts (``FP8_CAST_BYTES`` a weight, each micro-batch) and
  the activations' (``FP8_ACTIVATION_CAST_BYTES`` an element of every linear's input and output
  gradient: parallel/fp8.py's amax read 2, cast read 2 + write 1, and the transposed FP8 copy the
  weight-gradient GEMM takes, read 1 + write 1), at the HBM bandwidth. The weights' 44 bytes are
  fit to a per-kernel profile (bench/RESULTS.md 2026-12-04 session 13: gpt3-2.7b widths, 8 layers,
  4,096 tokens): the FP8 layers' element-wise kernels (Inductor's fused amax / cast / transpose /
  norm / GeLU kernels) took 12.35 ms where bf16's element-wise model and the activations' 7 bytes
  give 4.4 ms; the rest, 0.99 ms a layer of 78.6 M weights, is 38 bytes a weight beyond the 6 of a
  read, cast and transposed re-cast (the weight is amaxed and cast again in backward, and the
  compiled graph keeps bf16 copies); which kernels are the weights' and which the activations'
  is not separated by one token count.
- the step's host (CPU) time (planner/host.py): kernel launches, compiled frames' guards, autograd's
  per-parameter work and the optimizer's runs; the step is the GPU's time or, where the host
  launches a phase (a micro-batch's forward or backward, the norm and update) more slowly than the GPU
  runs it, the GPU waits (``host.step_phases``, ``host.overlapped``: the step = max over phases k of
  the host's time before k plus the GPU's from k). Under the deferred loop the GPU starts the step
  with the previous step's update (``OPTIMIZER_BYTES_PER_PARAM`` less the norm's
  ``NORM_BYTES_PER_PARAM``) queued while the host does its bookkeeping; each backward's GPU time
  carries its main_grad fold; the step ends with the grad norm.
- the main_grad fold after each backward (bf16 grad added into the fp32 buffer, 10 bytes a parameter;
  where ``config.half_grads`` keeps the buckets bf16, a bf16 copy of 4, and the optimizer reads 2 + 2
  bytes less: ``HALF_GRADS_SAVED_BYTES``; there the routed experts' buckets take the grouped GEMMs'
  weight gradients uncopied, so their fold moves nothing).

Per step: (m + (p − 1)/v) micro-batch times (the bubble is the (p − 1)/v part: Narayanan et al. 2021
§2.2, ``schedules.analytic_bubble_fraction`` of the wall time), PP p2p sends of the [s, b, h/t]
activation (2·(v·m + p − 1) on the critical path, over NVLink or, when a stage boundary crosses a node,
the inter-node link), the DP reduction of fp32 gradients over n = DP × CP ranks (the routed experts'
over the DP × CP / EP expert-DP ranks) (ring all-reduce 2(n−1)/n · 4 bytes/param, or
under ZeRO-1 reduce-scatter (n−1)/n · 4 + all-gather of bf16 params (n−1)/n · 2, over NVLink when the
DP × TP group fits a node, else the NIC; one ``COLLECTIVE_LATENCY_S`` per bucket of
``--ddp-bucket-size`` elements, default max(40M, 1M × DP) as parallel/data.py), of which
``--overlap-grad-reduce`` hides what fits in the last micro-batch's backward (never the last bucket; the ZeRO-1 all-gather is counted exposed), and the
optimizer: ``OPTIMIZER_BYTES_PER_PARAM`` of HBM traffic per parameter (the fast path's flat AdamW,
optim/adamw.py, reads grad, master and two moments and writes the three and the bf16 param: 30; the grad
norm 4; until 2026-12-04 the multi-tensor kernel's 28 and a separate master → bf16 copy of 6: 38), / DP × CP under ZeRO-1
(experts / DP × CP / EP).

Calibration (H200, bench/RESULTS.md 2026-12-01 profile of llama-1b, micro 8, seq 2048): GEMMs 148.3 ms,
attention 21.7 ms, element-wise 23.1 ms, optimizer and copies ~15 ms of a 211 ms step. The model puts
them at 148, 22, 22 and 12 ms. The constants below are those of every GPU and run.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

from dataclasses import replace

from ..config import (ONE_RANK_BUCKET, Config, bf16_reduce, ffn_hidden, global_batch, half_grads, head_dim, moe_ffn, moe_layer_pattern, num_microbatches,
                      padded_vocab_size, query_groups)
from ..flops import flops_per_iteration, mlp_flops_per_token
from ..fp8_rules import fp8_layers
from ..parallel.schedules import analytic_bubble_fraction
from .gpus import COLLECTIVE_LATENCY_S, GPU
from .layout import NONE, Layout
from .memory import adopted_params, layer_bytes, narrowed_moment_bytes
from . import host
from .moe_cp import cp_link, cp_seconds, ep_seconds, expert_rows, stacked_weight_bytes

GEMM_HALF_DIM = 64  # a GEMM dimension of x reaches x / (x + 64) of the large-GEMM efficiency
ATTENTION_HALF_SEQ = 1360  # attention's per-row cost, in tokens of its quadratic work (fit: attention_efficiency)
ATTENTION_HALF_HEAD_DIM = 48  # a head dim of d reaches d / (d + this) of the large-head efficiency
ATTENTION_HEAD_TILE = 64  # attention kernels' head-dim tile: a head dim of 80 or 96 runs as 128 (attention_efficiency)
ATTENTION_REFERENCE = (2048, 128)  # (seq, head dim) at which GPU.attention_efficiency is given
ELEMENTWISE_PASSES = 4  # HBM bytes moved by element-wise kernels per byte stored for backward
OPTIMIZER_BYTES_PER_PARAM = 34
NORM_BYTES_PER_PARAM = 4  # of the 34: the grad norm's fp32 grad read (2 under half_grads), the rest the update
FOLD_BYTES_PER_PARAM = 10
HALF_GRADS_SAVED_BYTES = (6, 2, 2)  # config.half_grads: (fold: a bf16 copy of 4, not 10; update: grad read 2; norm 2)
BF16_REDUCE_SAVED_BYTES = (4, 2, 2)  # --grad-reduce-in-bf16: (fold: a bf16 add of 6, not 10; update 2; norm 2)
FP8_CAST_BYTES = 44  # an FP8 weight a micro-batch, its casts' HBM bytes: fit to a per-kernel profile (cost.py doc)
FP8_ACTIVATION_CAST_BYTES = 7  # an FP8 linear's input and output-gradient element: amax, cast, transposed copy
STEP_OVERHEAD_S = 0.0


def gemm_efficiency(gpu: GPU, *dims: float) -> float:
    """Fraction of peak for GEMMs with these dimensions: gpu.gemm_efficiency × Π x / (x + 64)."""
    eff = gpu.gemm_efficiency
    for x in dims:
        eff *= x / (x + GEMM_HALF_DIM)
    return eff


def fp8_speedup(gpu: GPU, *dims: float) -> float:
    """bf16 GEMM time over FP8's for GEMMs with these dimensions: each dtype on its own saturating
    curve, FP8's reaching ``gpu.fp8_gemm_speedup`` × bf16's rate on large GEMMs and its half rate at
    ``gpu.fp8_half_dim`` (bf16's at GEMM_HALF_DIM): gpu.fp8_gemm_speedup × Π (x + 64) / (x + fp8_half_dim).
    An FP8 GEMM does half the bytes a FLOP, so it needs larger tiles' worth of work to reach its
    rate. Fit (bench/RESULTS.md, 2026-12-04 planner section) to the four recorded FP8 steps (llama-1b,
    llama-3b, the 8B widths twice) less their modelled non-GEMM time: 1.63× at h 2,048, 1.73× at
    h 3,072, ~1.8–1.9× at h 4,096; half-dim 256 and 2.0× at large shapes (the data sheet's ratio)."""
    ratio = gpu.fp8_gemm_speedup
    for x in dims:
        ratio *= (x + GEMM_HALF_DIM) / (x + gpu.fp8_half_dim)
    return ratio


GROUPED_TILE = (128, 256)  # torch._grouped_mm's SM90 CTA tile (M, N) (ATen GroupMM.cu, cooperative schedule)
GROUPED_SMALL_TILE = (64, 128)  # its tile when a group's M or N is at most 128 (ping-pong schedule)


def grouped_gemm_terms(gpu: GPU, experts: float, rows: float, h: int, f_e: int, gates: int) -> tuple:
    """(seconds at the full tensor-core rate, waves) of one MoE layer's routed-expert GEMMs on one
    rank, forward + backward: ``experts`` local experts of ``rows`` rows each (balanced routing), the
    six grouped GEMMs (M, N, K) per expert: forward fc1 (rows, g·f_e, h) and fc2 (rows, h, f_e);
    backward the inputs' gradients (rows, f_e, h) and (rows, h, g·f_e) and the weights' (h, g·f_e,
    rows) and (f_e, h, rows), g = 2 (SwiGLU) or 1.

    Wave quantisation (a persistent kernel over ``gpu.sm_count`` SMs, one CTA an SM): a GEMM has
    experts · ⌈M/t_m⌉ · ⌈N/t_n⌉ output tiles of ``GROUPED_TILE`` (``GROUPED_SMALL_TILE`` when M or
    N ≤ 128), run ⌈tiles / SMs⌉ waves, each wave one tile's 2·t_m·t_n·K FLOPs at an SM's share
    of the peak. So a small expert GEMM pays for its partly empty last wave and its partly filled
    edge tiles (Nvidia, "Matrix Multiplication Background User's Guide": tile and wave
    quantization)."""
    per_sm = gpu.peak_flops / gpu.sm_count
    seconds, waves = 0.0, 0
    for M, N, K in ((rows, gates * f_e, h), (rows, h, f_e), (rows, f_e, h), (rows, h, gates * f_e),
                    (h, gates * f_e, rows), (f_e, h, rows)):
        tm, tn = GROUPED_TILE if min(M, N) > 128 else GROUPED_SMALL_TILE
        n = math.ceil(experts * math.ceil(M / tm) * math.ceil(N / tn) / gpu.sm_count)
        seconds += n * 2.0 * tm * tn * K / per_sm
        waves += n
    return seconds, waves


def grouped_gemm_seconds(gpu: GPU, experts: float, rows: float, h: int, f_e: int, gates: int) -> float:
    """Seconds of one MoE layer's routed-expert GEMMs on one rank, forward + backward
    (``torch._grouped_mm``; shapes and waves: ``grouped_gemm_terms``): the waves' tile FLOPs at
    ``gpu.grouped_gemm_efficiency`` of the rate, plus ``gpu.grouped_wave_s`` a wave (a tile's fixed
    cost: its epilogue, the switch of TMA descriptors between experts)."""
    full, waves = grouped_gemm_terms(gpu, experts, rows, h, f_e, gates)
    return full / gpu.grouped_gemm_efficiency + waves * gpu.grouped_wave_s


def attention_efficiency(gpu: GPU, seq: float, dim: float) -> float:
    """Fraction of peak of the attention core (the 12·s²·a·d·b FLOPs a layer, fwd + bwd, counted as
    if not causal) at sequence ``seq`` and head dim ``dim``: ``gpu.attention_efficiency`` (its
    value at ``ATTENTION_REFERENCE``) × r(seq) × r(head_dim), each r the saturating x / (x + x_half)
    over its value at the reference.

    The sequence curve is time ∝ s² + s·ATTENTION_HALF_SEQ per row of heads: the quadratic tile work
    plus a per-row cost (softmax statistics, the backward's preprocessing, the partly masked tiles on
    the causal diagonal). Fit (bench/RESULTS.md, 2026-12-03 planner section) to the H200 attention of
    bench/results.jsonl, head dim 128, bf16, causal, fwd + bwd: 0.61 at s 2,048 (llama-1b profile,
    2026-12-01), 0.946 at 16k and 0.964 at 32k (cp-attention rows, SDPA on cuDNN, 2026-12-02); the
    curve is within 1.1% of all three. The head-dim curve is fit to llama-1b at 16k (head dim 64,
    plan_accuracy 2026-12-03): 0.79 of head dim 128's efficiency (fewer FLOPs a loaded K/V tile).
    A head dim that is no multiple of ``ATTENTION_HEAD_TILE`` runs as the next multiple (the fused
    kernels' head-dim tiles; the padding's FLOPs are wasted): the curve at the padded dim × dim /
    padded. Fit (bench/RESULTS.md, 2026-12-04 session 15) to the three GPT-2.7B runs (head dim 80,
    under-predicted by 4–11%, the more the larger attention's share: 1.36× attention time needed,
    1.38× given)."""
    s0, d0 = ATTENTION_HALF_SEQ, ATTENTION_HALF_HEAD_DIM
    ref_s, ref_d = ATTENTION_REFERENCE
    padded = math.ceil(dim / ATTENTION_HEAD_TILE) * ATTENTION_HEAD_TILE
    return gpu.attention_efficiency * (seq / (seq + s0)) / (ref_s / (ref_s + s0)) \
        * (padded / (padded + d0)) / (ref_d / (ref_d + d0)) * dim / padded


@dataclass
class StepTime:
    """Seconds of one optimizer step on the slowest rank, by component, and what follows from them.

    compute: GEMMs, attention and element-wise work of every micro-batch (recompute included);
    recompute: the part of compute that recomputation adds; tp_comm: TP/SP collectives; ep_comm: MoE
    expert-parallel all-to-alls; cp_comm: the exposed part of CP's K/V exchange; bubble: pipeline
    fill and drain; pp_p2p: activation sends between stages; dp_comm: the whole DP reduction (dense
    gradients over DP × CP, experts' over DP × CP / EP); dp_exposed: the part of it not hidden behind
    backward; optimizer: the update and the main_grad folds; host: the host's (CPU's) seconds of the
    step (``host``); host_idle: the GPU's wait for them, in total; phases: the step's [host s, GPU s]
    pairs in launch order (``host.step_phases``; the host's at ``gpu.host_scale``), from which
    ``host.rescaled`` gives the step on a host of another speed; total; tokens_per_s of the job; mfu
    (model FLOPs, no recompute, over world × peak); bottleneck: the largest cost besides useful
    compute, named with its cause.
    """

    compute: float
    recompute: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    bubble: float
    pp_p2p: float
    dp_comm: float
    dp_exposed: float
    optimizer: float
    host: float
    host_idle: float
    phases: list
    total: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    bottleneck: str

    def to_json(self) -> dict:
        return asdict(self)


def _flops(cfg: Config, layers: int, batch: int, vocab: int) -> float:
    m = copy.copy(cfg.model)
    m.num_layers, m.num_experts = layers, None  # dense layers; MoE MLPs are added by _work
    return flops_per_iteration(m, batch, vocab)


def _ring(n: int, nbytes: float, bandwidth: float, reduce: bool = True) -> float:
    """All-reduce (reduce=True: 2(n−1)/n) or all-gather / reduce-scatter ((n−1)/n) of nbytes."""
    if n <= 1:
        return 0.0
    return (2 if reduce else 1) * (n - 1) / n * nbytes / bandwidth + COLLECTIVE_LATENCY_S


def _work(c: Config, layout: Layout, gpu: GPU, padded: int, moe: list, logits: bool, act: int,
          gpus_per_node: int, fp8: list | None = None) -> dict:
    """Seconds of one micro-batch's forward + backward on one rank holding layers whose MoE flags
    are ``moe`` (and the logits when ``logits``), by component: gemm, attn, elem, recompute, tp, ep,
    cp, and the forward parts of the last three (tp_forward, ep_forward, cp_forward). MoE layers'
    routed experts take ``grouped_gemm_seconds`` at their own shape (moe_cp.expert_rows × h × f_e).
    fp8: per layer, whether its linears run FP8 GEMMs: their time / ``fp8_speedup`` at the layer's
    GEMM dimensions, plus
    ``FP8_CAST_BYTES`` of HBM traffic per weight each micro-batch (cast in forward, again in backward)."""
    m = c.model
    t, b, s, h, a = layout.tp, layout.micro_batch, m.seq_length, m.hidden_size, m.num_attention_heads
    split = t * layout.cp
    layers, n_moe = len(moe), sum(moe)
    n_fp8 = sum(fp8 or ())
    layer = _flops(c, 1, b, padded) - _flops(c, 0, b, padded)
    attention = 12.0 * s * s * a * head_dim(m) * b
    head = _flops(c, 0, b, padded) if logits else 0.0
    dims = (b * s / layout.cp, h, a * head_dim(m) / t, ffn_hidden(m) / t)  # a layer's GEMMs: M, K, N
    eff = gemm_efficiency(gpu, *dims)
    expert_s, stack_s = 0.0, 0.0
    if n_moe:
        tokens = 3.0 * b * s  # fwd + bwd, per token
        routed = 2 * h * m.moe_router_topk * moe_ffn(m) * (3 if m.swiglu else 2)
        other = mlp_flops_per_token(m, True) - routed - mlp_flops_per_token(m, False)  # router, shared − dense
        layer_moe_extra = tokens * other
        expert_s = n_moe * grouped_gemm_seconds(gpu, m.num_experts / layout.ep, expert_rows(m, b, layout), h,
                                                moe_ffn(m), 2 if m.swiglu else 1)
        stack_s = n_moe * 2 * stacked_weight_bytes(m, layout, act_bytes=act) / gpu.hbm_bytes_per_s
    else:
        layer_moe_extra = 0.0
    linear_layers = layers - n_fp8 + (n_fp8 / fp8_speedup(gpu, *dims) if n_fp8 else 0.0)
    gemm_s = ((layer - attention) * linear_layers + layer_moe_extra * n_moe + head) / split / (gpu.peak_flops * eff) \
        + expert_s
    attn_layer_s = attention / split / (gpu.peak_flops * attention_efficiency(gpu, s / layout.cp, head_dim(m)))
    attn_s = attn_layer_s * layers
    stored = {kind: layer_bytes(m, b, replace(layout, recompute=NONE), act_bytes=act, moe=kind) for kind in set(moe)}
    stacked = stacked_weight_bytes(m, layout, act_bytes=act)  # stored by an MoE layer, but a copy, not a pass
    elem_s = ELEMENTWISE_PASSES * (sum(stored[k] - k * stacked for k in moe) + (act * s * b * padded / t if logits
                                                                                 else 0.0)) \
        / gpu.hbm_bytes_per_s + stack_s
    if n_fp8:
        weights = (layer - attention) / (6 * b * s)  # the linears' parameters: 6 FLOPs a parameter and token
        elem_s += n_fp8 * FP8_CAST_BYTES * weights / t / gpu.hbm_bytes_per_s
        q = (a + 2 * query_groups(m)) * head_dim(m)  # the QKV projection's width
        widths = h + q / t + a * head_dim(m) / t + h + h + (2 if m.swiglu else 1) * ffn_hidden(m) / t \
            + ffn_hidden(m) / t + h  # each linear's input + output width on this rank
        elem_s += n_fp8 * FP8_ACTIVATION_CAST_BYTES * b * s / layout.cp * widths / gpu.hbm_bytes_per_s
    r = layout.recompute
    full = r.granularity == "full"
    if full:
        recompute_s = (gemm_s + attn_s + elem_s) / 3
    elif r.selective:
        recompute_s = attn_s / 3
    else:
        recompute_s = 0.0
    link_tp = gpu.intra_node_bytes_per_s if t <= gpus_per_node else gpu.inter_node_bytes_per_s
    x = act * s * b * h / layout.cp
    again = 1 if full else 0  # full recompute repeats the forward's collectives
    # per half layer (attention, MLP): SP 2 collectives forward and 3 backward, else 1 and 1; an MoE
    # MLP without a shared expert has none (its experts run at TP 1 on the rank's own s/t tokens)
    if t > 1 and layout.sequence_parallel:
        fwd, bwd, one = 2, 3, _ring(t, x, link_tp, reduce=False)
    elif t > 1:
        fwd, bwd, one = 1, 1, _ring(t, x, link_tp)
    else:
        fwd, bwd, one = 0, 0, 0.0
    halves = layers + layers - (0 if m.moe_shared_expert_intermediate_size else n_moe)
    # the shared expert (TP-split, at the dense layers' GEMM efficiency) runs while EP's exchanges do
    shared_f = 2 * h * (m.moe_shared_expert_intermediate_size or 0) * (3 if m.swiglu else 2) * b * s / split \
        / (gpu.peak_flops * eff)
    ep_f, ep_b = ep_seconds(m, b, layout, gpu, gpus_per_node, act_bytes=act, shared_forward_s=shared_f)
    cp_f, cp_b = cp_seconds(c, b, layout, gpu, gpus_per_node, attn_layer_s / 3, act_bytes=act)
    host_f, host_b = host.microbatch_seconds(c, moe, fp8 or [False] * layers, (m.num_experts or 0) / layout.ep,
                                             layers if full else 0)
    return {"host_f": gpu.host_scale * host_f, "host_b": gpu.host_scale * host_b,"gemm": gemm_s, "attn": attn_s, "elem": elem_s, "recompute": recompute_s,
            "tp": halves * (fwd * (1 + again) + bwd) * one, "tp_forward": halves * fwd * one,
            "ep": n_moe * (ep_f * (1 + again) + ep_b), "ep_forward": n_moe * ep_f,
            "cp": layers * (cp_f * (1 + again) + cp_b), "cp_forward": layers * cp_f, "link_tp": link_tp}


def _host_step(c: Config, layout: Layout, rank: int, dense: float, experts: float,
               bucket: float) -> float:
    """(optimizer, bookkeeping) host seconds of a step on pipeline rank ``rank`` (``host.step_seconds``),
    its parameters ``dense`` + ``experts`` in buckets of ``bucket`` elements."""
    from ..parallel.pipeline import stage_layers
    m, pp = c.model, layout.pp
    pattern, ranges = moe_layer_pattern(m), stage_layers(c)
    moe = [pattern[n] for s in range(rank, len(ranges), pp) for n in ranges[s]]
    local = (m.num_experts or 0) / layout.ep
    embeddings = (rank == 0) * (1 + (m.position_embedding_type == "learned_absolute")) \
        + (rank == pp - 1) * (m.untie_embeddings_and_output_weights or pp > 1)
    runs = host.flat_runs(c, moe, dense, experts, bucket, embeddings, stack_buckets=half_grads(c, layout.world))
    tensors = sum(host.layer_tensors(c, x, local) for x in moe) + embeddings + (rank == pp - 1)
    return host.step_seconds(c, moe, runs, tensors)


def _pp_link(layout: Layout, gpu: GPU, gpus_per_node: int) -> float:
    """Bandwidth between neighbouring pipeline stages: NVLink when the whole pipeline (stride
    TP × CP × DP apart) fits in a node, else the inter-node link."""
    stride = layout.tp * layout.cp * layout.dp  # GPUs between neighbouring pipeline stages
    return gpu.intra_node_bytes_per_s if stride * layout.pp <= gpus_per_node else gpu.inter_node_bytes_per_s


def p2p_seconds(cfg: Config, layout: Layout, gpu: GPU, gpus_per_node: int, half: bool = True) -> float:
    """Seconds of one PP send of a micro-batch's [s, b, h] activation (or its gradient), /t under
    SP, /cp: bytes / link bandwidth + ``COLLECTIVE_LATENCY_S``."""
    m = cfg.model
    x = (2 if half else 4) * m.seq_length * layout.micro_batch * m.hidden_size / layout.cp
    return x / (layout.tp if layout.sequence_parallel else 1) / _pp_link(layout, gpu, gpus_per_node) \
        + COLLECTIVE_LATENCY_S


def _stage_work(c: Config, layout: Layout, gpu: GPU, vocab: int, gpus_per_node: int, act: int) -> list:
    """_work of every model stage (stage = chunk · PP + rank), its layers from meshlm's own partition
    (``pipeline.stage_layers``), the logits on the last stage."""
    from ..parallel.pipeline import stage_layers
    padded = padded_vocab_size(vocab, c.model.make_vocab_size_divisible_by, layout.tp)
    ranges, moe, fp8 = stage_layers(c), moe_layer_pattern(c.model), fp8_layers(c.training, c.model.num_layers)
    return [_work(c, layout, gpu, padded, [moe[n] for n in layers], stage == len(ranges) - 1, act, gpus_per_node,
                  [fp8[n] for n in layers]) for stage, layers in enumerate(ranges)]


def stage_times(cfg: Config, layout: Layout, gpu: GPU, vocab: int, *, gpus_per_node: int,
                half: bool = True) -> list:
    """[(forward s, backward s)] of one micro-batch on each model stage (``_stage_work``). Forward is
    a third of the GEMM, attention and element-wise work (backward computes two gradients a GEMM:
    2× the forward FLOPs) plus the forward's TP, EP and CP communication; backward the rest, with
    any recompute."""
    out = []
    for w in _stage_work(layout.apply(cfg), layout, gpu, vocab, gpus_per_node, 2 if half else 4):
        work = w["gemm"] + w["attn"] + w["elem"]
        forward = sum(w[k + "_forward"] for k in ("tp", "ep", "cp"))
        out.append((work / 3 + forward, 2 * work / 3 + w["recompute"] + w["tp"] + w["ep"] + w["cp"] - forward))
    return out


def step_time(cfg: Config, layout: Layout, gpu: GPU, vocab: int, *, gpus_per_node: int, params_per_rank: int,
              expert_params_per_rank: int = 0, half: bool = True) -> StepTime:
    """The step time of ``layout`` (see the module docstring); cfg carries --global-batch-size.
    params_per_rank: parameters of the largest stage (memory.estimate's ``params``), of which
    expert_params_per_rank are routed experts (``expert_params``), reduced over DP × CP / EP."""
    c = layout.apply(cfg)
    m = c.model
    t, pp, vp, dp = layout.tp, layout.pp, layout.vp, layout.dp
    s = m.seq_length
    act = 2 if half else 4
    nmb = num_microbatches(c, layout.world)
    padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, t)
    stages = _stage_work(c, layout, gpu, vocab, gpus_per_node, act)
    keys = ("gemm", "attn", "elem", "recompute", "tp", "ep", "cp")
    ranks = [{k: sum(w[k] for w in stages[r::pp]) for k in keys + ("host_f", "host_b", "tp_forward", "ep_forward",
                                                                       "cp_forward")} for r in range(pp)]
    slowest = max(range(pp), key=lambda r: sum(ranks[r][k] for k in keys))  # the slowest pipeline rank
    w = ranks[slowest]
    gemm_s, attn_s, elem_s, recompute_s, tp_s, ep_s, cp_s = (w[k] for k in keys)
    link_tp = stages[-1]["link_tp"]
    halved = half and half_grads(c, layout.world)
    saved_fold, saved_update, saved_norm = HALF_GRADS_SAVED_BYTES if halved else (0, 0, 0)
    if half and bf16_reduce(c) and not halved:  # bf16 buckets summed over micro-batches: the fold adds in bf16
        saved_fold, saved_update, saved_norm = BF16_REDUCE_SAVED_BYTES
    # under half_grads a stack of experts' bucket is its grouped GEMM's weight gradient, uncopied
    folded = params_per_rank - adopted_params(c, layout, expert_params_per_rank)
    fold_s = (FOLD_BYTES_PER_PARAM - saved_fold) * folded / gpu.hbm_bytes_per_s
    per_mb = gemm_s + attn_s + elem_s + recompute_s + tp_s + ep_s + cp_s
    compute = nmb * (gemm_s + attn_s + elem_s + recompute_s)
    bubble = (pp - 1) / vp * per_mb
    link_pp = _pp_link(layout, gpu, gpus_per_node)
    p2p = 2 * (vp * nmb + pp - 1) * p2p_seconds(c, layout, gpu, gpus_per_node, half) if pp > 1 else 0.0
    link_dp = gpu.intra_node_bytes_per_s if dp * t * layout.cp <= gpus_per_node else gpu.inter_node_bytes_per_s
    n, edp = dp * layout.cp, layout.edp
    dense, experts = params_per_rank - expert_params_per_rank, expert_params_per_rank
    # parallel/data.py's default
    bucket = c.parallel.ddp_bucket_size or (max(40_000_000, 1_000_000 * dp) if n > 1 else ONE_RANK_BUCKET)
    latency = (math.ceil(params_per_rank / bucket) - 1) * COLLECTIVE_LATENCY_S if n > 1 else 0.0
    g = 2 if half and bf16_reduce(c) else 4  # a gradient's bytes on the wire
    if layout.stage >= 1:
        # ZeRO-1/2: one param all-gather after the step; ZeRO-3: one per block use, twice per
        # micro-batch with one stage (forward, backward), once a step under PP (kept gathered).
        # ZeRO-2/3 reduce-scatter every micro-batch's gradients (parallel/data.py).
        gathers = (2 * nmb if pp == 1 else 1) if layout.stage == 3 else 1
        reduces = nmb if layout.stage >= 2 else 1
        gather_s = gathers * (_ring(n, 2 * dense, link_dp, reduce=False) + _ring(edp, 2 * experts, link_dp,
                                                                                   reduce=False) + latency)
        dp_s = reduces * (_ring(n, g * dense, link_dp, reduce=False) + _ring(edp, g * experts, link_dp, reduce=False)
                          + latency) + gather_s
    else:
        dp_s, gather_s = _ring(n, g * dense, link_dp) + _ring(edp, g * experts, link_dp) + latency, 0.0
    if layout.overlap_grad_reduce and n > 1:
        reduce_s = dp_s - gather_s
        hidden = min(reduce_s * (1 - min(1.0, bucket / max(params_per_rank, 1))), 2 / 3 * per_mb)
        dp_exposed = reduce_s - hidden + gather_s
    else:
        dp_exposed = dp_s
    sharded = dense / n + experts / edp if layout.stage >= 1 else params_per_rank
    norm_s = (NORM_BYTES_PER_PARAM - saved_norm) * sharded / gpu.hbm_bytes_per_s
    # a bf16 moment (--use-precision-aware-optimizer) is read and written in 2 bytes, not 4
    saved_update += 2 * narrowed_moment_bytes(c)
    update_s = (OPTIMIZER_BYTES_PER_PARAM - NORM_BYTES_PER_PARAM - saved_update) * sharded / gpu.hbm_bytes_per_s
    opt_s = update_s + norm_s + nmb * fold_s
    gpu_s = nmb * per_mb + bubble + p2p + dp_exposed + opt_s + STEP_OVERHEAD_S
    host_opt, host_book = (gpu.host_scale * x for x in _host_step(c, layout, slowest, dense, experts, bucket))
    forward = (gemm_s + attn_s + elem_s) / 3 + sum(w[k + "_forward"] for k in ("tp", "ep", "cp"))
    microbatches = host.repeated([(w["host_f"], forward), (w["host_b"], per_mb - forward + fold_s)], nmb)
    phases = host.step_phases(host.deferred(c), host_book, host_opt, update_s, microbatches,
                              bubble + p2p + dp_exposed + norm_s + STEP_OVERHEAD_S)
    total = host.overlapped(phases)
    host_s = host_opt + host_book + nmb * (w["host_f"] + w["host_b"])
    gb = global_batch(c, layout.world)
    model_flops = flops_per_iteration(m, gb, padded)
    nvlink = {True: "NVLink", False: "inter-node link"}
    costs = {
        f"pipeline bubble (p−1)/(v·m) with m = {nmb} micro-batches": bubble,
        f"TP{' + SP' if layout.sequence_parallel else ''} collectives ({t} ranks, "
        f"{nvlink[link_tp == gpu.intra_node_bytes_per_s]})": nmb * tp_s,
        f"EP all-to-all ({layout.ep} ranks, "
        f"{nvlink[layout.ep * t <= gpus_per_node]})": nmb * ep_s,
        f"CP {c.model.cp_comm_type} K/V exchange, exposed ({layout.cp} ranks, "
        f"{nvlink[cp_link(layout, gpu, gpus_per_node) == gpu.intra_node_bytes_per_s]})": nmb * cp_s,
        f"DP gradient reduction over the {'intra-node NVLink' if link_dp == gpu.intra_node_bytes_per_s else 'inter-node link'} "
        f"({n} ranks), exposed": dp_exposed,
        f"PP p2p over the {nvlink[link_pp == gpu.intra_node_bytes_per_s]}": p2p,
        "optimizer step and main_grad folds (HBM-bound)": opt_s,
        f"{layout.recompute_name} recompute": nmb * recompute_s,
        f"host-bound: the GPU waits {1e3 * (total - gpu_s):.1f} ms for kernel launches (host {1e3 * host_s:.0f} ms "
        f"a step)": total - gpu_s,
    }
    name, worst = max(costs.items(), key=lambda kv: kv[1])
    return StepTime(compute=compute, recompute=nmb * recompute_s, tp_comm=nmb * tp_s, ep_comm=nmb * ep_s,
                    cp_comm=nmb * cp_s, bubble=bubble, pp_p2p=p2p, dp_comm=dp_s, dp_exposed=dp_exposed,
                    optimizer=opt_s, host=host_s, host_idle=max(0.0, total - gpu_s),
                    phases=[list(x) for x in phases], total=total, tokens_per_s=gb * s / total,
                    mfu=model_flops / (layout.world * total * gpu.peak_flops),
                    bubble_fraction=analytic_bubble_fraction(pp, nmb, vp) if pp > 1 else 0.0,
                    bottleneck=f"{name}: {100 * worst / total:.0f}% of the step")
