"""``meshlm pretrain --dry-run``: check a launch and print its layout and per-rank memory, no workers.

Parameters are counted from the model shape (no model is built): embedding (+ learned positions),
per layer two norms, QKV and output projections, the MLP, a final norm and an untied output layer.
Memory per rank is the planner's estimate (planner/memory.py: model state by precision and ZeRO-1,
activations per layer and in flight, logits), the same figures `meshlm plan` prints.
"""

from __future__ import annotations

import os
from typing import Optional

from .config import (Config, batch_schedule, dp_size, ffn_hidden, global_batch, head_dim, max_positions,
                     moe_ffn, moe_layer_pattern, num_microbatches, padded_vocab_size, query_groups,
                     run_iterations)

_GPT2_VOCAB = 50257


def vocab_of(cfg: Config) -> tuple:
    """(vocabulary size, how it was found): the tokenizer's (its files read where they exist),
    --vocab-size, or an assumption (GPT-2's 50257 for GPT2BPETokenizer without its files).
    Raises DataError (one line) for a tokenizer file that does not read."""
    d = cfg.data
    from .data.tokenizer import EXTRA_TYPES, build_tokenizer
    if d.tokenizer_type in (*EXTRA_TYPES, "HuggingFaceTokenizer") and d.tokenizer_model:  # one-line errors
        return build_tokenizer(d, cfg.model.vocab_size).vocab_size, d.tokenizer_model
    if d.tokenizer_type == "GPT2BPETokenizer" and all(p and os.path.isfile(p) for p in (d.vocab_file, d.merge_file)):
        return build_tokenizer(d).vocab_size, d.vocab_file
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "--vocab-size"
    if d.tokenizer_type == "GPT2BPETokenizer":
        return _GPT2_VOCAB, "GPT-2"
    return 32000, "assumed: the tokenizer is not known yet"


def stage_params(cfg: Config, vocab: int, *, expert: Optional[bool] = None) -> list:
    """Parameters held by one TP rank of each pipeline stage (TP-split weights / TP, the rest whole).

    expert: None, every parameter; True, only this EP rank's routed experts (E/EP expert MLPs per
    MoE layer: the params reduced over, and under ZeRO-1 sharded over, the expert-data-parallel
    group); False, all but those."""
    from .parallel.pipeline import stage_layers
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, ffn, bias = m.hidden_size, ffn_hidden(m), m.add_bias_linear
    qkv = (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m)
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    split = h * qkv + qkv * bias + m.num_attention_heads * head_dim(m) * h \
        + h * ffn * (2 if m.swiglu else 1) + ffn * (2 if m.swiglu else 1) * bias + ffn * h
    layer = split / tp + 2 * norm + 2 * h * bias

    def mlp(width: int, split_over: int) -> float:  # fc1 (+ bias), fc2 over split_over ranks, fc2's bias whole
        return (h * width * (2 if m.swiglu else 1) + width * (2 if m.swiglu else 1) * bias + width * h) \
            / split_over + h * bias
    # an MoE layer's MLP (model/moe.py): the router [E, h], this EP rank's E/EP experts (TP = 1 each)
    # and the shared expert (TP-split), instead of the dense MLP
    experts = m.num_experts // max(1, p.expert_model_parallel_size) * mlp(moe_ffn(m), 1) if m.num_experts else 0
    moe_layer = layer - mlp(ffn, tp) + m.num_experts * h + experts + (
        mlp(m.moe_shared_expert_intermediate_size, tp) if m.moe_shared_expert_intermediate_size else 0
    ) if m.num_experts else layer
    moe = moe_layer_pattern(m)
    stages = stage_layers(cfg)  # stage s = chunk · PP + rank
    layers = [[n for s in range(r, len(stages), pp) for n in stages[s]] for r in range(pp)]
    routed = [sum(experts for n in mine if moe[n]) for mine in layers]
    if expert:
        return [int(x) for x in routed]
    params = [sum(moe_layer if moe[n] else layer for n in mine) for mine in layers]
    embedding = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp) * h / tp
    params[0] += embedding + (max_positions(m) * h if m.position_embedding_type == "learned_absolute" else 0)
    params[-1] += norm + (embedding if m.untie_embeddings_and_output_weights or pp > 1 else 0)
    return [int(x - (r if expert is False else 0)) for x, r in zip(params, routed)]


def run_lines(cfg: Config, world: int) -> list:
    """The run's length, and its --rampup-batch-size ramp if any: one line each."""
    t, iters = cfg.training, run_iterations(cfg, world)
    if t.train_samples is None:
        lines = [f"run: {iters} iterations"]
    else:
        lines = [f"run: --train-samples {t.train_samples} = {iters} iterations (a partial last batch is dropped)"]
    schedule = batch_schedule(cfg, world)
    if schedule.ramp:
        start, increment, samples = schedule.ramp
        sizes = schedule.sizes()
        steps, consumed = schedule.ramp_end()
        lines.append(f"batch ramp (--rampup-batch-size): global {start} → {sizes[-1]} by {increment} "
                     f"({len(sizes) - 1} increments, one per {samples / (len(sizes) - 1):.1f} samples, "
                     f"{start // schedule.micro_dp} → {sizes[-1] // schedule.micro_dp} micro-batches); "
                     f"the full batch from iteration {steps + 1} (after {consumed} samples)")
    return lines


def report(cfg: Config, world: int) -> list:
    """The lines --dry-run prints: layout, batch, run length (and batch ramp), parameters and
    per-rank memory."""
    p, t = cfg.parallel, cfg.training
    dp = dp_size(cfg, world)
    vocab, source = vocab_of(cfg)
    params = stage_params(cfg, vocab)
    return [
        f"layout: world {world} = TP {p.tensor_model_parallel_size} × CP {p.context_parallel_size} × "
        f"PP {p.pipeline_model_parallel_size} × DP {dp}",
        f"batch: global {global_batch(cfg, world)} = micro {t.micro_batch_size} × {num_microbatches(cfg, world)} "
        f"micro-batches × DP {dp}; sequence {cfg.model.seq_length}",
        *run_lines(cfg, world),
        f"parameters per rank by pipeline stage: {', '.join(f'{n / 1e6:.1f}M' for n in params)} "
        f"(vocabulary {vocab}, {source})",
        *memory_lines(cfg, world, vocab),
    ]


def memory_lines(cfg: Config, world: int, vocab: int) -> list:
    """The planner's per-rank memory of this launch (planner/memory.py ``estimate``, the one
    formula ``meshlm plan`` and the out-of-memory message use): model state and activations of
    the rank that needs the most, its peak and its device total."""
    import copy
    from .planner.layout import Layout
    from .planner.memory import GiB, estimate
    c = copy.deepcopy(cfg)
    c.training.global_batch_size = global_batch(cfg, world)
    half = bool(c.training.bf16 or c.training.fp16)
    lay = Layout.of(c, world)
    mem = estimate(c, lay, vocab, half=half)
    state = mem.weights + mem.grads + mem.optimizer
    return [f"memory per rank (planner, pipeline stage {mem.stage}, {'bf16/fp16' if half else 'fp32'}, "
            f"{mem.params / 1e6:.1f}M parameters): weights {mem.weights / GiB:.2f} GiB + grads {mem.grads / GiB:.2f} "
            f"GiB + optimizer {mem.optimizer / GiB:.2f} GiB = {state / GiB:.2f} GiB ({state / mem.params:g} "
            f"bytes/parameter); activations {mem.activations / GiB:.2f} GiB ({mem.activations_per_layer / GiB:.3f} "
            f"a layer, {lay.recompute_name} recompute, × {mem.in_flight:g} in flight) + logits/loss "
            f"{mem.loss / GiB:.2f} GiB",
            f"memory peak per rank (planner): {mem.peak_bytes / GiB:.2f} GiB allocated, about "
            f"{mem.device_bytes / GiB:.2f} GiB of device memory with the CUDA context and allocator reserve "
            f"(`meshlm plan` with the same flags compares it with a GPU and ranks the layouts that fit)"]
