"""Per-rank memory of a layout: weights, gradients, optimizer states, activations, loss buffers.

Model state (bytes per parameter of the rank's stage, from ``planner/params.py``):

- ``"meshlm"`` accounting, what meshlm allocates (optim/optimizer.py, parallel/data.py): bf16/fp16
  params 2, fp32 ``main_grad`` 4 (2 where ``config.half_grads`` keeps the buckets bf16: one backward a
  step on the CUDA fast path, nothing summing them), fp32 master 4 + Adam moments
  4 + 4 = 12 (each bf16 moment 2 less: --use-precision-aware-optimizer), or under --use-distributed-optimizer (ZeRO-1, Rajbhandari et al. 2020 §5.1) 12/(DP × CP)
  — the distributed optimizer shards over the DP × CP group — and, for the routed experts (E/EP of
  them a MoE layer), 12/(DP × CP / EP), the expert-data-parallel group they are reduced and sharded
  over (``moe_cp``); fp32 training: 4 + 4 + 8 (no separate master). Under ZeRO-1 each buffer
  (params, grads) is padded to a multiple of 64 × its group (``moe_cp.padded``, exact for one bucket
  a buffer). ZeRO-2 (--data-parallel-sharding-strategy optim_grads) divides the gradients too,
  ZeRO-3 (optim_grads_params) the weights too, plus its gathered working set (``gathered_bytes``:
  two blocks whole with one pipeline stage, all of the stage's weights under PP or with
  --torch-fsdp2-no-reshard-after-forward); a --load of a Hugging Face folder or a weights-only
  checkpoint makes every bucket whole to read it (``gather_all``): the rank's weights whole beside
  the shards, once at start (meshlm checkpoints are saved and read as the shards). Under
  --optimizer-cpu-offload the device holds 1 − --optimizer-offload-fraction of the optimizer state
  and the host (``host_bytes``) the rest at 12 bytes an element (fp32 master and two moments, the
  master separate even for fp32 params) plus the offload's staging buffers (optim/offload.py:
  min(2^26, host elements) × (4 + the params' element bytes), 384 MiB for a large bf16 model).
  Hybrid sharding (--num-distributed-optimizer-instances N) shards over DP × CP / N, the optimizer
  over all DP × CP under --outer-dp-sharding-strategy optim.
  Gradient memory exists only from the first backward to the next
  zero_grad, so with one micro-batch and PP = 1 it is not held at the activation peak (start of
  backward) — counted in ``peak_bytes`` only when gradients are held while activations are.
- ``"classic"`` mixed-precision accounting (Rajbhandari et al. 2020 §3.1; the issue's seed figures):
  fp16 params 2 + fp16 grads 2 + fp32 master and two moments 12 = 16 bytes per parameter. It
  differs from meshlm's by the 2 bytes of fp32 (not fp16) gradients per parameter.

Activations per transformer layer follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4 (s sequence, b micro-batch, h hidden, a heads, t TP;
2-byte activations, 1-byte dropout masks): without parallelism sbh(34 + 5as/h) bytes, of which 10sbh
sit in the replicated regions (two norm inputs, the QKV and MLP inputs, two dropout masks), 24sbh in
the TP regions (Q, K, V, the attention output, the MLP's 4h fc1 output and activation output) and
5as²b in core attention (softmax output, its dropout mask and output). TP divides the last two:
sbh(10 + 24/t + 5as/(ht)); sequence parallelism also the first: sbh/t · (34 + 5as/h); selective
recompute drops core attention: 34sbh/t; full recompute keeps each checkpointed layer's input, 2sbh
(/t under SP), and rebuilds one layer at a time in backward. ``layer_terms`` generalises the terms to
meshlm's shapes (query groups, SwiGLU's two fc1 halves, no dropout masks at dropout 0, fp32
activations on CPU) and reduces to the paper's figures for a GPT layer.

Flash attention. meshlm's attention is SDPA (flash/cuDNN on GPUs), which never stores the s×s
scores: the 5as²b term is absent. In its place SDPA keeps for backward its own output (2sb·a·d bytes
— the output projection keeps another copy, its input after the [b, a, s, d] → [s, b, a·d] transpose)
and the log-sum-exp (4·a·s·b bytes, fp32). Selective recompute drops those two (bench/RESULTS.md,
2026-12-01: predicted 1.02 GiB for llama-1b, measured −1.01 GiB). ``flash=False`` gives the paper's
math-attention term instead (Megatron's unfused softmax).

FP8 layers (--fp8-format, meshlm/fp8_rules.py) keep their linears' inputs in FP8 for backward, one
byte an element (``layer_terms``' fp8), instead of bf16, where the linear runs eagerly (TP > 1, the delayed
recipe); traced into the compiled layer (tensorwise at TP = 1, ``fp8_recomputed``) they keep none: backward
casts them again from the bf16 tensors the layer keeps anyway; the delayed recipe's amax histories (3 · L
values a linear, 48 KiB a layer at L = 1024 in fp32) are not counted. No FP8 weight
copy, except under --fp8-param-gather (``fp8_copy_bytes``): one byte per weight of the FP8 layers'
linears, whole under ZeRO-1/2 (beside the bf16 params), a 1/(DP × CP) shard under ZeRO-3, whose
gathered working set then holds those weights in FP8 (one byte, not two).

MoE layers keep ``moe_cp.moe_mlp_terms`` (the dispatched routes, the experts' outputs, routing
indices, the grouped GEMM's stacked copy of the expert weights under ZeRO-3) instead of the dense MLP's fc1 and
activation outputs: the compiled grouped-GEMM layer's saved tensors (the GPU's fast path).

Micro-batches in flight: under 1F1B the first stage holds min(m, p) micro-batches of its layers, the
last stage one; interleaved with v stages the first holds L·(1 + (p−1)/(p·v)) layers' worth (Megatron's
``interleaved_schedule_memory_penalty``, theoretical_memory_usage.py), the last ((v−1)·p + 1) chunks.

Loss buffers (last stage): the bf16 logits [s·b, V/t], 2 bytes per element (their gradient is
written into the same buffer, parallel/cross_entropy.py), plus the final norm's and the output
layer's inputs (2 × 2sbh).

End of backward: measured on the H200 (bench/RESULTS.md, planner check 2026-12-01), the peak of a run
whose activations are small (micro-batch 1, or full recompute) is the resting state (weights, grads,
optimizer) plus one more copy of the weights — 2.12 GiB above it for llama-1b, 5.98 GiB for llama-3b,
their bf16 weight sizes: autograd's ``p.grad`` of every param, alive beside the buckets until the fold
copies them in at the end of the backward (parallel/data.py ``_fold``). Params whose gradients the
buckets take as they are (``adopted_params``: the routed experts' stacks under ``config.half_grads``)
have no such copy (session 18: the 32-expert run, predicted with the whole copy, +7.9%).
Calibrated: with these terms llama-1b (micro-batch 8, seq 2048, bench/results.jsonl, peak 36.73 GiB
after lazy grads) is predicted at 36.8 GiB and llama-3b (seq 4096, micro 2, selective, 4 micro-batches,
76.56 GiB) at 77.1 GiB, so the allocator overhead in ``max_memory_allocated`` is taken as 0. What the
device needs beyond that (``device_bytes``): the CUDA context and cuBLAS/NCCL workspaces, taken as
``CONTEXT_BYTES`` (typical of torch 2.x on Hopper), and the caching allocator's fragmentation,
``FRAGMENTATION`` of the peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..config import Config, ModelConfig, bf16_reduce, ffn_hidden, half_grads, head_dim, moe_layer_pattern, num_microbatches, query_groups
from ..fp8_rules import fp8_layers
from .layout import Layout
from .moe_cp import moe_mlp_terms, padded
from .params import stage_params

GiB = 2 ** 30
CONTEXT_BYTES = 0.75 * GiB  # CUDA context, cuBLAS and NCCL workspaces: outside max_memory_allocated
FRAGMENTATION = 0.05  # caching-allocator reserve beyond the allocated peak
STATE_BYTES = {  # bytes per parameter: (weights, grads, optimizer before ZeRO-1)
    ("meshlm", True): (2, 4, 12), ("meshlm", False): (4, 4, 8),
    ("classic", True): (2, 2, 12), ("classic", False): (4, 4, 8),
}


def narrowed_moment_bytes(cfg: Config) -> int:
    """Bytes an element the Adam moments save under --use-precision-aware-optimizer: 2 for each of
    --exp-avg-dtype and --exp-avg-sq-dtype that is bf16 (optim/optimizer.py ``MOMENT_DTYPES``)."""
    o = cfg.optimizer
    return 2 * sum(d == "bf16" for d in (o.exp_avg_dtype, o.exp_avg_sq_dtype))


def state_bytes(params: float, *, half: bool = True, dp: int = 1, distributed_optimizer: bool = False,
                accounting: str = "meshlm", stage: Optional[int] = None) -> dict:
    """{"weights", "grads", "optimizer"} bytes for ``params`` parameters (see the module docstring).
    accounting: "meshlm" (fp32 main_grad) or "classic" (fp16 grads). stage: the ZeRO stage (default 1
    under distributed_optimizer, else 0): ZeRO-1 divides the optimizer by dp, ZeRO-2 the gradients too,
    ZeRO-3 the weights too (Rajbhandari et al. 2020 §5; the gathered working set is not included)."""
    w, g, o = STATE_BYTES[(accounting, half)]
    stage = (1 if distributed_optimizer else 0) if stage is None else stage
    return {"weights": w * params / (dp if stage >= 3 else 1), "grads": g * params / (dp if stage >= 2 else 1),
            "optimizer": o * params / (dp if stage >= 1 else 1)}


def gathered_bytes(cfg: Config, layout: Layout, params: float, vocab: int, *, half: bool = True) -> float:
    """ZeRO-3's working set of whole weights (optim/param_gather.py): two blocks at a time with one
    pipeline stage (the largest layer and the word embedding bound each), the stage's whole weights
    under PP or --torch-fsdp2-no-reshard-after-forward (kept gathered through the step). 0 below stage 3."""
    if layout.stage < 3:
        return 0.0
    w = STATE_BYTES[("meshlm", half)][0]
    if layout.pp > 1 or cfg.parallel.torch_fsdp2_no_reshard_after_forward:
        return w * params
    m = cfg.model
    embedding = vocab * m.hidden_size / layout.tp
    layer = (params - 2 * embedding) / max(m.num_layers, 1)
    return w * 2 * max(layer, embedding)


def adopted_params(c: Config, layout: Layout, experts: float) -> float:
    """Parameters on a rank whose gradients the buckets adopt uncopied (parallel/data.py ``adopt``): the
    rank's ``experts`` routed-expert parameters under ``config.half_grads`` when no layer is FP8 (an FP8
    buffer's stacks are copied), else 0. Their fold moves no bytes and allocates no ``p.grad`` copy."""
    if not half_grads(c, layout.world) or any(fp8_layers(c.training, c.model.num_layers)):
        return 0.0
    return experts


def layer_terms(m: ModelConfig, b: int, *, tp: int = 1, sp: bool = False, flash: bool = True,
                act_bytes: int = 2, fp8: bool = False, fp8_recomputed: bool = False) -> dict:
    """Bytes one transformer layer keeps for backward (no recompute), by term; s = m.seq_length.

    Replicated-region terms are divided by tp only under sequence parallelism; TP-region terms by tp.
    Returns {"norm_inputs", "qkv_input", "mlp_input", "dropout_masks", "qkv", "attention_output",
    "fc1_output", "activation_output", "core_attention"}; core_attention is the s² term (flash=False)
    or SDPA's own output and log-sum-exp (flash=True).
    fp8: the layer's linears run FP8 GEMMs (parallel/fp8.py): their four inputs are kept in FP8, one
    byte an element (the QKV and MLP inputs all-gathered, [s, b, h], under SP); the weights are
    re-cast in backward (no FP8 copy kept; --fp8-param-gather's copies: ``fp8_copy_bytes``), and the
    delayed recipe's small amax histories are not counted.
    fp8_recomputed: the FP8 linears are traced into the compiled layer (``fp8_recomputed``), whose
    partitioner keeps none of the four FP8 inputs: backward casts them again from tensors it keeps anyway
    (the norm inputs, the fc1 output, the bf16 copy of the attention output), so the layer keeps the
    bf16 layer's terms less the QKV and MLP inputs and the activation output.
    """
    s, h, a, d = m.seq_length, m.hidden_size, m.num_attention_heads, head_dim(m)
    sbh, q, kv, f = s * b * h, a * d, query_groups(m) * d, ffn_hidden(m)
    rep = tp if sp else 1
    masks = (m.hidden_dropout > 0) * 2 * sbh
    if flash:
        core = act_bytes * s * b * q + 4 * a * s * b
    else:
        core = (act_bytes + (act_bytes + 1 if m.attention_dropout > 0 else 0)) * a * s * s * b
    terms = {
        "norm_inputs": 2 * act_bytes * sbh / rep, "qkv_input": act_bytes * sbh / rep,
        "mlp_input": act_bytes * sbh / rep, "dropout_masks": masks / rep,
        "qkv": act_bytes * s * b * (q + 2 * kv) / tp, "attention_output": act_bytes * s * b * q / tp,
        "fc1_output": act_bytes * s * b * f * (2 if m.swiglu else 1) / tp,
        "activation_output": act_bytes * s * b * f / tp, "core_attention": core / tp,
    }
    if fp8 and fp8_recomputed:
        terms.update(qkv_input=0.0, mlp_input=0.0, activation_output=0.0)
    elif fp8:
        terms.update(qkv_input=sbh, mlp_input=sbh, attention_output=s * b * q / tp, activation_output=s * b * f / tp)
    return terms


def fp8_recomputed(c: Config, layout: Layout) -> bool:
    """Whether the FP8 linears' inputs are cast again in backward rather than kept (``layer_terms``): the
    current-scaling (tensorwise) recipe at TP = 1 traces whole into the compiled layer (no amax all-reduce),
    and the partitioner keeps no FP8 copy (bench/saved_bytes.py on the compiled GPT-2.7B layer,
    bench/RESULTS.md session 20). Elsewhere (TP > 1, the delayed recipe) the copies are counted as kept."""
    return layout.tp == 1 and c.training.fp8_recipe == "tensorwise"


def layer_bytes(m: ModelConfig, b: int, layout: Layout, *, checkpointed: bool = False, flash: bool = True,
                act_bytes: int = 2, moe: bool = False, fp8: bool = False, fp8_recomputed: bool = False) -> float:
    """Bytes one layer keeps: all terms; without core attention under selective recompute; only the
    layer input (act_bytes·sbh, /tp under SP) when the layer is checkpointed (full recompute).
    moe: an MoE layer, whose MLP keeps ``moe_cp.moe_mlp_terms`` instead of the dense fc1 and
    activation outputs. Under context parallelism each rank holds s/cp of every sequence: every
    term / cp (the s² term of non-flash attention as its rank's s/cp queries against all s keys)."""
    if checkpointed:
        return act_bytes * m.seq_length * b * m.hidden_size / (layout.tp if layout.sequence_parallel else 1) \
            / layout.cp
    terms = layer_terms(m, b, tp=layout.tp, sp=layout.sequence_parallel, flash=flash, act_bytes=act_bytes, fp8=fp8,
                        fp8_recomputed=fp8_recomputed)
    if moe:
        del terms["fc1_output"], terms["activation_output"]
        terms.update(moe_mlp_terms(m, b, layout, act_bytes=act_bytes))
    if layout.recompute.selective:
        terms.pop("core_attention")
    weights = terms.pop("stacked_weights", 0.0)  # a copy of the weights: no share of the tokens
    return sum(terms.values()) / layout.cp + weights


@dataclass
class Memory:
    """Bytes on the rank that needs the most: its stage, model state and activations by category.

    params: its parameters, of which expert_params are its routed experts' (sharded over DP × CP / EP);
    activations = in-flight micro-batches × the stage's stored layer activations (+ its largest layer,
    activations_per_layer, rebuilt under full recompute); loss = the last stage's logits, their gradient and the output layer's
    inputs; peak_bytes = what torch.cuda.max_memory_allocated reports (grads only when held at the
    activation peak); device_bytes = peak + CUDA context + allocator fragmentation.
    host_bytes: host memory of --optimizer-cpu-offload (the fraction's masters and moments + staging;
    0 without it); host_optimizer_full: the masters and moments of the whole optimizer on the host
    (fraction 1), for ``largest_offload_fraction``. checkpoint_gather: under ZeRO-3 with a --load of
    a Hugging Face folder or weights-only checkpoint, the rank's weights it gathers whole beside the
    shards to read them (peak_bytes counts it).
    """

    stage: int
    params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    activations_per_layer: float
    in_flight: float
    loss: float
    grads_at_peak: bool
    peak_bytes: float
    device_bytes: float
    host_bytes: float = 0.0
    host_optimizer_full: float = 0.0
    checkpoint_gather: float = 0.0  # ZeRO-3 reading a HF/weights-only --load: the weights gathered whole (bytes)

    def to_json(self) -> dict:
        return asdict(self)


def _in_flight(stage_rank: int, pp: int, vp: int, m: int) -> tuple:
    """(chunk micro-batches in flight, layers per chunk as a fraction of the rank's layers): Megatron's
    1F1B warm-up (p − r − 1) + 1, interleaved (p − r − 1)·2 + (v − 1)·p + 1, capped at m·v."""
    if pp == 1:
        return 1, 1.0
    if vp == 1:
        return min(m, pp - stage_rank), 1.0
    return min(m * vp, (pp - stage_rank - 1) * 2 + (vp - 1) * pp + 1), 1.0 / vp


def fp8_linear_params(m: ModelConfig, tp: int) -> float:
    """Weights of one layer's four linears on a rank (QKV, projection, fc1, fc2; split over TP)."""
    q, d = (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m), m.num_attention_heads * head_dim(m)
    return m.hidden_size * (q + d + ((2 if m.swiglu else 1) + 1) * ffn_hidden(m)) / tp


def fp8_copy_bytes(c: Config, layout: Layout, n_fp8: int, *, half: bool = True) -> float:
    """--fp8-param-gather's FP8 weight copies on a rank holding ``n_fp8`` FP8 layers (module doc),
    less the bytes ZeRO-3's working set no longer gathers for them (the params' element size less
    one, for each FP8 layer whole at once: two, or all under PP). 0 without the flag."""
    if not c.training.fp8_param_gather or not n_fp8 or layout.stage < 1:
        return 0.0
    w = fp8_linear_params(c.model, layout.tp)
    if layout.stage < 3:
        return n_fp8 * w
    whole = n_fp8 if layout.pp > 1 or c.parallel.torch_fsdp2_no_reshard_after_forward else min(n_fp8, 2)
    return n_fp8 * w / (layout.dp * layout.cp) - whole * w * (STATE_BYTES[("meshlm", half)][0] - 1)


def estimate(cfg: Config, layout: Layout, vocab: int, *, accounting: str = "meshlm", flash: bool = True,
             half: bool = True, stage: Optional[int] = None) -> Memory:
    """Memory of ``layout`` for cfg's model and global batch: the largest of the first and the last
    pipeline stage (module docstring), or of pipeline rank ``stage`` alone (0 or PP − 1: e.g. the
    last, whose rank logs ``mem_max_allocated_gb``). ``cfg`` must carry --global-batch-size.
    ConfigError if the layers cannot be split over the stages (meshlm's own partition rules)."""
    from ..config import padded_vocab_size
    from ..optim.offload import HOST_STATE_BYTES, staging_bytes
    from ..parallel.pipeline import stage_layers
    c = layout.apply(cfg)
    m = c.model
    act = 2 if half else 4
    params, experts = stage_params(c, vocab), stage_params(c, vocab, expert=True)
    ranges = stage_layers(c)
    nmb = num_microbatches(c, layout.world)
    b, s, h = layout.micro_batch, m.seq_length, m.hidden_size
    rep = layout.tp if layout.sequence_parallel else 1
    moe, fp8 = moe_layer_pattern(m), fp8_layers(c.training, m.num_layers)
    kinds = list(zip(moe, fp8))  # per layer: (MoE, FP8)
    recast = fp8_recomputed(c, layout)
    per_layer = {k: layer_bytes(m, b, layout, flash=flash, act_bytes=act, moe=k[0], fp8=k[1], fp8_recomputed=recast)
                 for k in set(kinds)}
    zero, group = layout.stage >= 1, layout.dp * layout.cp
    # hybrid sharding: shards span one of N replicas; the optimizer's also split across them under outer optim
    replicas = c.parallel.num_distributed_optimizer_instances if zero else 1
    across = replicas if c.parallel.outer_dp_sharding_strategy == "optim" else 1
    best = None
    for rank in sorted({0, layout.pp - 1}) if stage is None else [stage]:
        chunks_of_rank = ranges[rank::layout.pp]
        stored = 0.0
        for chunk in chunks_of_rank:
            for start, end, ckpt in layout.recompute.segments(len(chunk)):
                # a checkpointed group keeps its first layer's input only
                stored += layer_bytes(m, b, layout, checkpointed=True, act_bytes=act) if ckpt else \
                    sum(per_layer[kinds[n]] for n in chunk[start:end])
        full_layer = max((per_layer[kinds[n]] for chunk in chunks_of_rank for n in chunk), default=0.0)
        chunks, share = _in_flight(rank, layout.pp, layout.vp, nmb)
        acts = stored * share * chunks + (full_layer if layout.recompute.granularity == "full" else 0.0)
        loss = 0.0
        if rank == layout.pp - 1:
            vocab_tp = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, layout.tp)
            loss = (act * s * b * vocab_tp / layout.tp + 2 * act * s * b * h / rep) / layout.cp  # s/cp tokens a rank
        # dense params sharded over DP × CP, routed experts over the expert-DP ranks (DP × CP / EP)
        dense = state_bytes(padded(params[rank] - experts[rank], group, zero), half=half, dp=group // replicas,
                            stage=layout.stage, accounting=accounting)
        dense["optimizer"] /= across
        routed = state_bytes(padded(experts[rank], layout.edp, zero) if experts[rank] else 0, half=half,
                             dp=layout.edp, stage=layout.stage, accounting=accounting)
        st = {k: dense[k] + routed[k] for k in dense}
        if half and accounting == "meshlm" and (half_grads(c, layout.world) or bf16_reduce(c)):
            st["grads"] /= 2  # bf16 buckets (parallel/data.py): one backward a step, or --grad-reduce-in-bf16
        o = STATE_BYTES[(accounting, half)][2]
        st["optimizer"] *= (o - narrowed_moment_bytes(c)) / o
        st["weights"] += gathered_bytes(c, layout, params[rank], vocab, half=half)
        st["weights"] += fp8_copy_bytes(c, layout, sum(fp8[n] for chunk in chunks_of_rank for n in chunk),
                                         half=half)
        host = full = 0.0
        if c.optimizer.optimizer_cpu_offload:  # that share of the optimizer state lives on the host
            f = c.optimizer.optimizer_offload_fraction
            full = st["optimizer"] / STATE_BYTES[(accounting, half)][2] * HOST_STATE_BYTES
            host = f * full + (staging_bytes(f * full / HOST_STATE_BYTES, 2 if half else 4) if f else 0.0)
            st["optimizer"] *= 1.0 - f
        held = nmb > 1 or layout.pp > 1
        peak = st["weights"] + st["optimizer"] + acts + loss + (st["grads"] if held else 0.0)
        copied = 1 - adopted_params(c, layout, experts[rank]) / max(params[rank], 1)
        peak = max(peak, (1 + copied) * st["weights"] + st["optimizer"] + st["grads"])  # the fold's p.grad transient
        gather = params[rank] * act if layout.stage == 3 and _loads_whole(c.checkpoint.load) else 0.0
        peak = max(peak, st["weights"] + gather + st["optimizer"] + st["grads"])  # that load: every bucket whole
        mem = Memory(stage=rank, params=params[rank], expert_params=experts[rank], weights=st["weights"],
                     grads=st["grads"], optimizer=st["optimizer"], activations=acts, activations_per_layer=full_layer,
                     in_flight=chunks * share, loss=loss, grads_at_peak=held, peak_bytes=peak,
                     device_bytes=peak * (1 + FRAGMENTATION) + CONTEXT_BYTES, host_bytes=host,
                     host_optimizer_full=full, checkpoint_gather=gather)
        if best is None or mem.peak_bytes > best.peak_bytes:
            best = mem
    return best


def _loads_whole(load) -> bool:
    """Whether --load is a Hugging Face folder or `meshlm convert`'s weights-only checkpoint, which
    a ZeRO-3 run reads into its weights made whole (a meshlm checkpoint is read into the shards)."""
    from ..checkpoint.convert import is_weights_only
    return bool(load) and is_weights_only(load)


def largest_offload_fraction(mem: Memory, budget: float, *, half: bool = True) -> float:
    """The largest --optimizer-offload-fraction, floored to 0.01, whose host bytes (``mem.host_bytes``'
    formula: the fraction of ``mem.host_optimizer_full`` plus the staging) fit in ``budget`` bytes;
    0.0 when none does (or the estimate has no offload)."""
    from ..optim.offload import HOST_STATE_BYTES, staging_bytes
    full = mem.host_optimizer_full
    if full <= 0:
        return 0.0
    room = budget - staging_bytes(full / HOST_STATE_BYTES, 2 if half else 4)
    return max(0.0, min(1.0, math.floor(100 * room / full) / 100))
