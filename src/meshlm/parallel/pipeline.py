"""Pipeline parallelism: stage partition, and the forward/backward of one step over the model chunks.

``forward_backward`` is the entry point every run uses, PP = 1 included: it builds this rank's
instruction list (``schedules.build_schedule``: none, GPipe, 1F1B or interleaved 1F1B) and
executes it — forwards and backwards of micro-batches on the local model chunks, and the P2P
steps between them (``p2p.StageComm``).

Partition (Megatron's rules): the layers are split evenly over the PP ranks, except that
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` fix the first /
last rank's count and the rest is split evenly over the middle ranks. With v virtual stages
(``--virtual-pipeline-model-parallel-size`` or ``--num-layers-per-virtual-pipeline-stage``) each
rank's layers are split into v chunks, and local chunk c of rank r is model stage s = c·PP + r;
model stages hold consecutive layers in stage order. Stage 0 holds the embedding, the last stage
the final norm, output layer and loss (model/chunks.py builds the chunks of this rank).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..config import Config, num_microbatches as config_num_microbatches
from ..dtypes import at_least_fp32
from ..errors import ConfigError
from ..profile_ranges import annotate
from . import watchdog
from .context import sequence_loss_tokens
from .mesh import ParallelState
from .p2p import StageComm, backward_from, release
from .schedules import Action, P2P, build_schedule, resolve_schedule, schedule_problem


# ----------------------------------------------------------------------------- partition

def virtual_size(cfg: Config) -> int:
    """Model chunks per pipeline rank v: --virtual-pipeline-model-parallel-size, or
    (num_layers / PP) / --num-layers-per-virtual-pipeline-stage, else 1."""
    p = cfg.parallel
    if p.virtual_pipeline_model_parallel_size:
        return p.virtual_pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage:
        per_rank = cfg.model.num_layers // p.pipeline_model_parallel_size
        return max(1, per_rank // p.num_layers_per_virtual_pipeline_stage)
    return 1


def _rank_layer_counts(cfg: Config) -> tuple[list, list]:
    """(layers per PP rank, problems); no counts where there are problems (a list of PP entries
    for a refused PP of 10**12 filled the host's memory)."""
    p, num_layers = cfg.parallel, cfg.model.num_layers
    pp = p.pipeline_model_parallel_size
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    problems = []
    if first is None and last is None:
        if num_layers < pp:  # every stage needs a layer: uneven first/last stages cannot help
            problems.append(f"--num-layers {num_layers} is fewer than --pipeline-model-parallel-size {pp} "
                            f"stages (each needs a layer); give --num-layers {pp} or more, or --pipeline-model-parallel-size "
                            f"{num_layers} at most")
        elif num_layers % pp:
            problems.append(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                            f"{pp}; use a multiple of {pp} or set --decoder-first/last-pipeline-num-layers")
        return ([] if problems else [num_layers // pp] * pp), problems
    if pp == 1:
        problems.append("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers], problems
    fixed = {0: first, pp - 1: last}
    fixed = {r: n for r, n in fixed.items() if n is not None}  # each ≥ 0: checked by meshlm.validate
    rest, middle = num_layers - sum(fixed.values()), pp - len(fixed)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        problems.append(f"--num-layers {num_layers} minus --decoder-first/last-pipeline-num-layers "
                        f"({first}, {last}) leaves {rest} layers for {middle} middle stage(s); "
                        f"they must split evenly")
        return [], problems
    each = rest // middle if middle else 0
    return [fixed.get(r, each) for r in range(pp)], problems


def validate_pipeline(cfg: Config, world: int) -> list:
    """Every pipeline problem of this config as one-line messages (empty if none).

    Checks Megatron's rules: v from at most one flag and only with PP > 1; layers per rank
    (even split, or the uneven first/last split) divisible by v; the schedule fits the layout;
    interleaving needs num_microbatches % PP == 0 (Megatron's rule with
    microbatch_group_size_per_vp_stage = PP; under --step-batch-size-schedule
    batch_rules.interleaved_problems checks it for every entry's batch).
    """
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    problems = []
    if p.virtual_pipeline_model_parallel_size and p.num_layers_per_virtual_pipeline_stage:
        problems.append("--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage "
                        "are exclusive; set one")
    for flag, value in [("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size),
                        ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage)]:
        if value is not None and pp == 1:  # value ≥ 1: checked by meshlm.validate
            problems.append(f"{flag} needs --pipeline-model-parallel-size > 1")
    if problems:
        return problems
    n = p.num_layers_per_virtual_pipeline_stage
    if n and (cfg.model.num_layers % pp or (cfg.model.num_layers // pp) % n):
        problems.append(f"--num-layers-per-virtual-pipeline-stage {n} must divide the layers per pipeline "
                        f"rank (--num-layers {cfg.model.num_layers} / PP {pp})")
        return problems
    v = virtual_size(cfg)
    counts, count_problems = _rank_layer_counts(cfg)
    problems += count_problems
    if not count_problems and any(c % v for c in counts):
        problems.append(f"layers per pipeline rank {counts} are not divisible by "
                        f"--virtual-pipeline-model-parallel-size {v}")
    name = resolve_schedule(p.pipeline_schedule, pp, v)
    # a step schedule's every batch, its last included, is batch_rules' to check (naming that flag)
    stepped = cfg.training.step_batch_size_schedule is not None
    problem = schedule_problem(name, pp, v, None if stepped else config_num_microbatches(cfg, world))
    if problem:
        problems.append(problem)
    return problems


def stage_layers(cfg: Config) -> list:
    """Global layer indices of every model stage, in stage order s = c·PP + r: list of range.

    Raises ConfigError if the layers cannot be partitioned (see ``validate_pipeline``).
    """
    counts, problems = _rank_layer_counts(cfg)
    pp, v = cfg.parallel.pipeline_model_parallel_size, virtual_size(cfg)
    if not problems and any(c % v for c in counts):
        problems.append(f"layers per pipeline rank {counts} are not divisible by v = {v}")
    if problems:
        raise ConfigError(problems)
    ranges, start = [], 0
    for s in range(pp * v):
        size = counts[s % pp] // v
        ranges.append(range(start, start + size))
        start += size
    return ranges


def activation_shape(cfg: Config, ps: ParallelState) -> tuple:
    """Shape of a tensor sent between stages: [s, b, h], s split over CP and (under SP) TP."""
    s = cfg.model.seq_length // ps.cp
    if cfg.parallel.sequence_parallel:
        s //= ps.tp
    return (s, cfg.training.micro_batch_size, cfg.model.hidden_size)


# ----------------------------------------------------------------------------- execution

def forward_backward(chunks: list, data_iter: Iterator[dict], *, ps: ParallelState, cfg: Config,
                     num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0,
                     no_sync: Callable = contextlib.nullcontext,
                     timeline: Optional[list] = None) -> list:
    """Run one step's forwards and backwards over ``num_microbatches`` micro-batches.

    data_iter yields {"tokens", "labels": [b, s] int64, "loss_mask": [b, s] fp32} and, for packed
    documents, "position_ids" / "document_ids" [b, s] int64 (data/packing.py); every rank of a
    pipeline draws the same ``num_microbatches`` of them. Each micro-batch's loss is
    sum(loss·mask)·CP/sum(mask)/num_microbatches (sum(mask) over the CP group), times ``loss_scale`` for backward, so gradients
    equal those of one pass over the whole batch. With --calculate-per-token-loss it is
    sum(loss·mask)·DP·CP/N instead, N the loss tokens of the global batch (all micro-batches,
    all DP×CP ranks: one all-reduce before the first forward), so that after DP averaging the
    gradient is that of sum(loss·mask)/N over the global batch (Megatron's per-token loss).
    Gradients accumulate into ``.grad`` / ``main_grad`` of the chunks; ``no_sync()`` wraps every
    backward but this rank's last.

    Returns on the last stage one {"lm_loss": detached fp32 scalar (micro-batch mean, unscaled; the
    micro-batch sum under --calculate-per-token-loss; under CP that mean × CP, see above, whose mean
    over DP×CP is the batch's), "num_tokens": 0-dim tensor} per micro-batch in order, [] elsewhere.
    timeline, if a list, receives
    {"mb", "chunk", "kind": "F"|"B", "start", "end" (s, time.perf_counter), "in_flight": micro-batch
    chunks held between their F and B after this action}; on CUDA each entry synchronizes.
    Raises ConfigError if the schedule cannot run this layout.
    """
    name = resolve_schedule(cfg.parallel.pipeline_schedule, ps.pp, len(chunks))
    steps = build_schedule(name, ps.pp, ps.pp_rank, num_microbatches, len(chunks), forward_only)
    dtype = next(chunks[0].parameters()).dtype
    comm = StageComm(ps, activation_shape(cfg, ps), dtype)
    run = _Executor(chunks, data_iter, ps, comm, num_microbatches, forward_only, loss_scale, timeline)
    if cfg.training.calculate_per_token_loss:
        run.per_token = _global_loss_tokens(run, ps) if not forward_only else True
    for chunk in chunks:  # MoE aux losses get the LM loss's gradient scale (model/moe.py)
        if hasattr(chunk, "moe_state"):
            chunk.moe_state.scale = loss_scale * ps.dp * ps.cp / run.per_token \
                if isinstance(run.per_token, torch.Tensor) else loss_scale * ps.cp / num_microbatches
    last_b = max((i for i, s in enumerate(steps) if isinstance(s, Action) and s.kind == "B"), default=-1)
    for i, step in enumerate(steps):
        if isinstance(step, P2P):
            run.p2p(step)
        elif step.kind == "F":
            run.forward(step)
        else:
            with no_sync() if i != last_b else contextlib.nullcontext():
                run.backward(step)
    return [run.losses[mb] for mb in range(num_microbatches)] if ps.is_last_stage else []


class _Executor:
    """State of one forward_backward call: micro-batches drawn, tensors received and to send,
    and (input, output) of every micro-batch chunk awaiting its backward."""

    def __init__(self, chunks, data_iter, ps, comm, num_microbatches, forward_only, loss_scale, timeline):
        self.chunks, self.data_iter, self.ps, self.comm = chunks, data_iter, ps, comm
        self.m, self.forward_only, self.loss_scale, self.timeline = (
            num_microbatches, forward_only, loss_scale, timeline)
        self.last_stage = ps.pp * len(chunks) - 1
        self.batches, self.received, self.outgoing, self.held, self.losses = [], {}, {}, {}, {}
        self.per_token = None  # None: mean of micro-batch means; True or N (a tensor): per-token loss

    def _batch(self, mb: int) -> dict:
        while len(self.batches) <= mb:
            batch = next(self.data_iter)
            self.batches.append({k: t.to(self.ps.device, non_blocking=True) for k, t in batch.items()})
        return self.batches[mb]

    @contextlib.contextmanager
    def _record(self, a: Action):
        if self.timeline is None:
            yield
            return
        cuda = self.ps.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.ps.device)
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.ps.device)
        self.timeline.append({"mb": a.mb, "chunk": a.chunk, "kind": a.kind, "start": start,
                              "end": time.perf_counter(), "in_flight": len(self.held)})

    def p2p(self, step: P2P) -> None:
        sends = {op: self.outgoing.pop(op) for op in step.ops if op.kind.startswith("SEND")}
        self.received.update(self.comm.run(step, sends))
        for op, tensor in sends.items():
            if op.kind == "SEND_F" and not self.forward_only:
                release(tensor)

    def forward(self, a: Action) -> None:
        stage = a.chunk * self.ps.pp + self.ps.pp_rank
        first, last = stage == 0, stage == self.last_stage
        batch = self._batch(a.mb)
        x = None if first else self.received.pop(Action("RECV_F", a.mb, a.chunk))
        if x is not None and not self.forward_only:
            x.requires_grad_()
        with self._record(a), annotate(a.kind, a.mb, a.chunk), \
                torch.no_grad() if self.forward_only else contextlib.nullcontext():
            out = self.chunks[a.chunk](batch["tokens"] if first else None,
                                       labels=batch["labels"] if last else None, hidden_states=x,
                                       position_ids=batch.get("position_ids"),
                                       document_ids=batch.get("document_ids"))
            if last:
                mask = batch["loss_mask"].float()
                lm = torch.where(mask > 0, at_least_fp32(out) * mask, 0.0).sum()
                if self.per_token is None:  # the sequence's mean × CP: DP×CP averaging gives the mean
                    lm = lm * self.ps.cp / sequence_loss_tokens(mask, self.ps)
                # tensors, not numbers: a host sync here would drain the GPU queue every micro-batch
                self.losses[a.mb] = {"lm_loss": lm.detach(), "num_tokens": mask.sum().detach()}
                if self.per_token is None:
                    out = lm * (self.loss_scale / self.m)
                elif not self.forward_only:
                    out = lm * (self.loss_scale * self.ps.dp * self.ps.cp / self.per_token)
            if not self.forward_only:
                self.held[(a.mb, a.chunk)] = (x, out)
        if not last:
            self.outgoing[Action("SEND_F", a.mb, a.chunk)] = out

    def backward(self, a: Action) -> None:
        stage = a.chunk * self.ps.pp + self.ps.pp_rank
        x, out = self.held.pop((a.mb, a.chunk))
        with self._record(a), annotate(a.kind, a.mb, a.chunk):
            if stage == self.last_stage:
                out.backward()
            else:
                backward_from(out, self.received.pop(Action("RECV_B", a.mb, a.chunk)))
        if stage > 0:
            self.outgoing[Action("SEND_B", a.mb, a.chunk)] = x.grad if x.grad is not None else torch.zeros_like(x)


def _global_loss_tokens(run: "_Executor", ps: ParallelState) -> torch.Tensor:
    """N: loss tokens (sum of loss masks) of the global batch, ≥ 1, a float64 0-dim tensor on
    the device. Draws this rank's micro-batches now and all-reduces over DP×CP (no host sync)."""
    run._batch(run.m - 1)
    n = torch.stack([b["loss_mask"].to(torch.float64).sum() for b in run.batches])
    n = n.sum().reshape(1)
    if ps.dp_cp_group is not None:
        watchdog.call("all_reduce of the loss tokens", ps.dp_cp_group, dist.all_reduce, n, group=ps.dp_cp_group)
    return n.clamp(min=1)[0]


# ----------------------------------------------------------------------------- reporting

def reduce_losses(losses: list, ps: ParallelState, per_token: bool = False) -> torch.Tensor:
    """Lm loss of one step, the same on every rank (collective over the PP and DP×CP groups), as a
    float64 [1] tensor on the device: reading it is left to the caller (no host sync here).

    The objective whose gradient was taken: the mean of the micro-batch means returned by
    ``forward_backward``, averaged over the DP×CP ranks; with ``per_token``
    (--calculate-per-token-loss) the sum of the micro-batch loss sums over the sum of their loss
    tokens, both summed over the DP×CP ranks. Computed on the last stage, broadcast over the
    pipeline. Every rank must call it.
    """
    t = torch.zeros(2, dtype=torch.float64, device=ps.device)
    if losses:  # no Python number assigned into t: that is a blocking copy, draining the GPU here
        loss = torch.stack([d["lm_loss"].to(torch.float64) for d in losses])
        if per_token:
            t = torch.stack([loss.sum(), torch.stack([d["num_tokens"].to(torch.float64) for d in losses]).sum()])
        else:
            t = torch.stack([loss.mean(), torch.ones((), dtype=torch.float64, device=loss.device)])
    if ps.pp_group is not None:
        watchdog.call("broadcast of the loss", ps.pp_group, dist.broadcast, t, src=ps.pp_ranks[-1],
                      group=ps.pp_group)
    if ps.dp_cp_group is not None:
        watchdog.call("all_reduce of the loss", ps.dp_cp_group, dist.all_reduce, t, group=ps.dp_cp_group)
    return (t[0] / t[1].clamp(min=1)).reshape(1)


def bubble_fraction(timeline: list, window: Optional[tuple] = None) -> float:
    """Measured pipeline bubble of one stage: idle time / wall time of the step.

    Busy time is the union of the F/B intervals of ``timeline`` (entries from forward_backward);
    wall time runs over ``window`` = (t0, t1) in perf_counter seconds, default from the stage's
    first start to its last end. On the first stage (whose first F starts the step and whose
    last B ends it) the default window equals the step, and with equal-cost stages the result
    approaches ``schedules.analytic_bubble_fraction`` = (p − 1)/(v·m + p − 1) (Narayanan et al.
    2021 §2.2). Pass the step's window to measure later stages the same way.
    """
    spans = sorted((e["start"], e["end"]) for e in timeline)
    t0, t1 = window if window else (spans[0][0], max(e for _, e in spans))
    busy, cursor = 0.0, t0
    for s, e in spans:
        s, e = max(s, cursor), min(e, t1)
        if e > s:
            busy += e - s
            cursor = e
    return 1.0 - busy / (t1 - t0)
