"""``meshlm pretrain --dry-run``: check a launch and print its layout and per-rank memory, no workers.

Parameters are counted from the model shape (planner/params.py: no model is built), the
vocabulary found as data/tokenizer.py's ``vocab_of`` says.
Memory per rank is the planner's estimate (planner/memory.py: model state by precision and ZeRO-1,
activations per layer and in flight, logits), the same figures `meshlm plan` prints; under
--optimizer-cpu-offload also the host memory of a rank and of the node's ranks.
"""

from __future__ import annotations

import copy
from typing import Optional

from .config import Config, batch_schedule, default_nproc, dp_size, global_batch, num_microbatches, run_iterations
from .data.tokenizer import vocab_of
from .fp8_rules import fp8_layers
from .planner.layout import Layout
from .planner.memory import GiB, estimate
from .planner.params import stage_params


def run_lines(cfg: Config, world: int) -> list:
    """The run's length, and its --rampup-batch-size ramp if any: one line each."""
    t, iters = cfg.training, run_iterations(cfg, world)
    schedule = batch_schedule(cfg, world)
    if t.train_samples is None:
        lines = [f"run: {iters} iterations"]
    elif schedule.steps:
        lines = [f"run: --train-samples {t.train_samples} = {iters} iterations (the last may pass it: "
                 f"{schedule.consumed_after(iters):,} samples, as Megatron's step schedule counts)"]
    else:
        lines = [f"run: --train-samples {t.train_samples} = {iters} iterations (a partial last batch is dropped)"]
    if schedule.steps:
        lines.append(f"batch schedule (--step-batch-size-schedule, at --seq-length {cfg.model.seq_length}): "
                     + ", ".join(_schedule_entries(schedule, iters)))
    if schedule.ramp:
        start, increment, samples = schedule.ramp
        sizes = schedule.sizes()
        steps, consumed = schedule.ramp_end()
        lines.append(f"batch ramp (--rampup-batch-size): global {start} → {sizes[-1]} by {increment} "
                     f"({len(sizes) - 1} increments, one per {samples / (len(sizes) - 1):.1f} samples, "
                     f"{start // schedule.micro_dp} → {sizes[-1] // schedule.micro_dp} micro-batches); "
                     f"the full batch from iteration {steps + 1} (after {consumed} samples)")
    return lines


def _schedule_entries(schedule, iters: int) -> list:
    """"B (n micro-batches) from iteration i (sample c)" for each --step-batch-size-schedule entry,
    walked over the run's ``iters`` steps; an entry the run ends before, or steps over (the step
    before it passes the next threshold too), says so."""
    out, steps, consumed = [], 0, 0
    bounds = [threshold for threshold, _ in schedule.steps[1:]] + [float("inf")]
    for (threshold, batch), end in zip(schedule.steps, bounds):
        if consumed >= end:
            out.append(f"{batch} from sample {threshold:,} (stepped over)")
        elif steps >= iters:
            out.append(f"{batch} from sample {threshold:,} (not reached)")
        else:
            out.append(f"{batch} ({batch // schedule.micro_dp} micro-batches) from iteration {steps + 1:,} "
                       f"(sample {consumed:,})")
            taken = iters - steps if end == float("inf") else min(iters - steps, -(-(end - consumed) // batch))
            consumed, steps = consumed + taken * batch, steps + taken
    return out


def report(cfg: Config, world: int, vocab: Optional[tuple] = None) -> list:
    """The lines --dry-run prints: layout, batch, run length (and batch ramp), parameters and
    per-rank memory. vocab: (vocabulary size, how it was found), default ``vocab_of(cfg)``."""
    p, t = cfg.parallel, cfg.training
    dp = dp_size(cfg, world)
    vocab, source = vocab or vocab_of(cfg)
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
        *fp8_lines(cfg),
    ]


def fp8_lines(cfg: Config) -> list:
    """Under --fp8-format: which layers run FP8 GEMMs and what the memory estimate counts for them."""
    t = cfg.training
    if not t.fp8_format:
        return []
    on = [i for i, f in enumerate(fp8_layers(t, cfg.model.num_layers)) if f]
    return [f"FP8 (--fp8-format {t.fp8_format}, --fp8-recipe {t.fp8_recipe}): the linears of layers {on[0]}–{on[-1]} "
            f"of {cfg.model.num_layers}; the memory above keeps their inputs in FP8 for backward (1 byte an "
            f"element), " + ("an FP8 copy of their weights (1 byte each: whole under ZeRO-1/2, a shard and the "
                             "gathered blocks under ZeRO-3; --fp8-param-gather)" if t.fp8_param_gather else
                             "no FP8 weight copy (re-cast in backward)") +
            (f" and not their amax histories (delayed: 3 × {t.fp8_amax_history_len} values a linear)"
             if t.fp8_recipe == "delayed" else " and no amax history (tensorwise)")]


def memory_lines(cfg: Config, world: int, vocab: int) -> list:
    """The planner's per-rank memory of this launch (planner/memory.py ``estimate``, the one
    formula ``meshlm plan`` and the out-of-memory message use): model state and activations of
    the rank that needs the most, its peak and its device total."""
    c = copy.deepcopy(cfg)
    c.training.global_batch_size = global_batch(cfg, world)
    half = bool(c.training.bf16 or c.training.fp16)
    lay = Layout.of(c, world)
    mem = estimate(c, lay, vocab, half=half)
    state = mem.weights + mem.grads + mem.optimizer
    zero = f"ZeRO-{lay.stage}, " if lay.stage else ""
    return [f"memory per rank (planner, pipeline stage {mem.stage}, {zero}{'bf16/fp16' if half else 'fp32'}, "
            f"{mem.params / 1e6:.1f}M parameters): weights {mem.weights / GiB:.2f} GiB + grads {mem.grads / GiB:.2f} "
            f"GiB + optimizer {mem.optimizer / GiB:.2f} GiB = {state / GiB:.2f} GiB ({state / mem.params:g} "
            f"bytes/parameter); activations {mem.activations / GiB:.2f} GiB ({mem.activations_per_layer / GiB:.3f} "
            f"a layer, {lay.recompute_name} recompute, × {mem.in_flight:g} in flight) + logits/loss "
            f"{mem.loss / GiB:.2f} GiB",
            f"memory peak per rank (planner): {mem.peak_bytes / GiB:.2f} GiB allocated, about "
            f"{mem.device_bytes / GiB:.2f} GiB of device memory with the CUDA context and allocator reserve "
            f"(`meshlm plan` with the same flags compares it with a GPU and ranks the layouts that fit)"
            + (f"; it allows for the {mem.checkpoint_gather / GiB:.2f} GiB of weights ZeRO-3 gathers whole to read "
               f"--load's weights-only folder, at start" if mem.checkpoint_gather else ""),
            *too_large_lines(mem.device_bytes), *host_lines(cfg, world, mem)]


def too_large_lines(device_bytes: float) -> list:
    """A warning when a rank needs more device memory than the largest GPU preset holds (the dry run
    does not know the target GPU, but no GPU of the planner's presets can run it)."""
    from .planner.gpus import PRESETS
    largest = max(PRESETS.values(), key=lambda g: g.memory_bytes)
    if device_bytes <= largest.memory_bytes:
        return []
    return [f"warning: {device_bytes / GiB:,.0f} GiB a rank is more than any GPU preset holds ({largest.name}: "
            f"{largest.memory_bytes / GiB:.0f} GiB); `meshlm plan` with the same flags names the layouts and "
            f"batch that fit"]


def host_lines(cfg: Config, world: int, mem) -> list:
    """Under --optimizer-cpu-offload: the host memory of a rank and of this node's ranks (planner/memory.py
    ``host_bytes``) beside what this host has available (validate refuses more)."""
    o = cfg.optimizer
    if not o.optimizer_cpu_offload:
        return []
    from .host_memory import available_bytes
    local = min(world, default_nproc(cfg))
    state = o.optimizer_offload_fraction * mem.host_optimizer_full
    available = available_bytes()
    here = f"; {available / GiB:.1f} GiB available on this host" if available is not None else ""
    return [f"host memory per rank (planner, --optimizer-cpu-offload, fraction {o.optimizer_offload_fraction:g}): "
            f"masters and moments {state / GiB:.2f} GiB + staging {(mem.host_bytes - state) / GiB:.2f} GiB = "
            f"{mem.host_bytes / GiB:.2f} GiB; × {local} local rank(s) = {local * mem.host_bytes / GiB:.2f} GiB{here}"]
