"""The training loop: build everything, then step, evaluate, log, checkpoint, exit.

``pretrain(cfg)`` runs in every worker after the launcher has validated the config. One
iteration (DESIGN.md "One iteration, as data"): zero the main_grad buffers → draw this DP rank's
micro-batches of the step's global batch (constant, or ramped: ``batches.BatchSchedule``) from the
sampler at ``consumed_samples`` → pipeline
forward/backward (``no_sync`` for all but the last backward, loss scaled under fp16) → finish the
DP gradient reduction → loss reduced over DP and broadcast over the pipeline → NaN/inf check →
optimizer step → LR step by the step's samples (only after a step that was taken, as in Megatron)
→ ``consumed_samples += the step's global batch``. Iterations, consumed samples, and optimizer/scheduler/RNG states round-trip
through checkpoint/dist.py (what goes in: checkpoint/state.py), so a resumed run repeats the
uninterrupted one; --finetune, --no-load-optim and --no-load-rng restore less (training/checkpointing.py:
``save_checkpoint``, ``load_checkpoint``, ``TrainState``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from .. import config as C
from .. import fast
from ..data.gpt_dataset import build_datasets
from ..data.indexed import check_token_ids
from ..data.loader import rank_loader
from ..data.sources import blends, prefixes as data_prefixes
from ..data.tokenizer import NullTokenizer, build_tokenizer, resolve_tokenizer_type
from ..errors import DataError, TrainingError
from ..flops import flops_per_iteration
from ..host_read import start_read
from ..model.chunks import build_model_chunks
from ..model.moe import start_routing_stats
from ..optim.distributed import build_optimizer
from ..batches import BatchSchedule
from ..optim.schedule import scheduler_for
from ..parallel import comm, fp8_delayed
from ..parallel.agree import first_problem
from ..parallel.context import split_batches
from ..parallel.data import DistributedDataParallel
from ..parallel.tensor import deferred_init
from ..parallel.mesh import ParallelState, init_distributed, local_rank
from ..parallel import watchdog
from ..parallel.random import MODEL_PARALLEL_SEED_OFFSET
from ..parallel.pipeline import bubble_fraction, forward_backward, reduce_losses
from ..profile_ranges import annotate
from ..run_logs import worker_log_path
from .checkpointing import TrainState, check_data_lasts, load_checkpoint, save_checkpoint, saved_layout
from .faults import LossSpikes, nan_origin
from .manual_gc import ManualGC
from . import profiling, progress
from .metrics import MetricsLogger
from .stop_signal import SignalFlag
from .stragglers import StragglerWatch

if TYPE_CHECKING:
    from ..checkpoint.async_save import AsyncSaver


@dataclass
class Run:
    """Everything one worker built for training (the loop's arguments, in one place)."""

    cfg: C.Config
    ps: ParallelState
    tokenizer: object
    train_ds: object
    valid_ds: object
    chunks: list
    ddp: DistributedDataParallel
    opt: object
    sched: object
    logger: MetricsLogger
    global_batch: int  # after any --rampup-batch-size ramp: evaluation's batch
    num_microbatches: int
    batches: BatchSchedule  # each training step's global batch
    train_iters: int  # --train-iters, or the steps --train-samples takes
    last_checkpoint: Optional[str] = None
    saver: Optional["AsyncSaver"] = None  # --async-save (with --save)
    loaders: dict = dataclasses.field(default_factory=dict)  # id(dataset) → its MicroBatchLoader
    stop_signal: Optional[SignalFlag] = None  # --exit-signal-handler
    nan_skips: int = 0  # --skip-nan-steps: the steps skipped in a row, up to the last one
    stragglers: Optional[StragglerWatch] = None
    spikes: Optional[LossSpikes] = None  # --loss-spike-threshold
    fp8_states: list = dataclasses.field(default_factory=list)  # --fp8-recipe delayed: every FP8 linear's

    def micro_batches(self, dataset, consumed_samples: int):
        """This DP rank's micro-batches of ``dataset`` from sample ``consumed_samples`` on, read
        ahead by --num-workers processes (data/loader.py); one loader per dataset, kept across steps.
        Under CP each is this CP rank's part of the sequence (parallel/context.py split_batch)."""
        loader = self.loaders.get(id(dataset))
        if loader is None or loader.dataset is not dataset:
            loader = self.loaders[id(dataset)] = rank_loader(dataset, self.cfg, self.ps)
        return split_batches(loader.at(consumed_samples), self.ps)


def params_dtype(cfg: C.Config, device: torch.device) -> torch.dtype:
    """bf16/fp16 parameters on GPU under --bf16/--fp16; fp32 on CPU (and without either flag)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32


def pretrain(cfg: C.Config, dtype: Optional[torch.dtype] = None) -> dict:
    """Train ``cfg`` in this worker (every rank calls it); return a summary for tests and the CLI:
    {"iterations", "train_losses" (per iteration, None when skipped), "final_train_loss",
    "val_losses" ([(iteration, loss)]), "first_val_loss", "last_val_loss", "last_checkpoint"}.

    dtype: the params' dtype, None to pick it from the flags (see ``build``).
    Raises TrainingError on a NaN/inf loss or gradients (naming the iteration, the rank(s) where
    it arose and the last good checkpoint) unless --skip-nan-steps, CheckpointError for a bad
    --load, ConfigError/DataError from builders; TrainingError (``_out_of_memory``) when the GPU or
    the host runs out of memory, building the model or in a step.
    Under --exit-signal-handler, --exit-signal only sets a flag (stop_signal.py) from here to the end.
    From ``build`` on, this rank's hang watchdog and heartbeat run (parallel/watchdog.py).
    """
    t = cfg.training
    with SignalFlag(t.exit_signal) if t.exit_signal_handler else contextlib.nullcontext() as stop:
        run = dog = None
        try:
            run = build(cfg, dtype)
            run.stop_signal = stop
            dog = watchdog.start(run.ps, cfg.parallel.distributed_timeout_minutes, cfg.logging.heartbeat_interval,
                                 _heartbeat_log(cfg, run.ps.rank))
            state = TrainState()
            if cfg.checkpoint.load:
                state = load_checkpoint(run)
                check_data_lasts(run, state)
            _note_start(run, state)
            run.logger.begin(state.iteration)
            return train(run, state)
        except RuntimeError as e:  # out of memory, building the model or in a step: one message, not a traceback
            error = _out_of_memory(cfg, e, run)
            if error is None:
                raise
            raise error from e
        finally:
            if run is not None:
                run.logger.close()
            if dog is not None:
                dog.stop()


def _out_of_memory(cfg: C.Config, exc: RuntimeError, run: Optional[Run]) -> Optional[TrainingError]:
    """The TrainingError for ``exc`` when it is an out-of-memory error (None otherwise): on a GPU
    (torch.OutOfMemoryError) the planner's prediction, what was allocated and the layouts that fit; on
    a CPU run (torch's CPU allocator) the host memory and the flags that shrink a step. ``run`` is None
    when it came while building the model (then the world and vocabulary come from the process group
    and the tokenizer flags)."""
    from ..planner.oom import explain_host_oom, explain_oom, is_host_oom
    if not isinstance(exc, torch.OutOfMemoryError) and not is_host_oom(exc):
        return None
    world = run.ps.world_size if run else (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                                           else 1)
    if isinstance(exc, torch.OutOfMemoryError):
        from ..data.tokenizer import vocab_of
        vocab = run.tokenizer.vocab_size if run else vocab_of(cfg)[0]
        return TrainingError(explain_oom(cfg, exc, world=world, vocab=vocab))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or C.default_nproc(cfg)
    return TrainingError(explain_host_oom(cfg, exc, world=world, local_ranks=local))


def _heartbeat_log(cfg: C.Config, rank: int) -> Optional[str]:
    """This rank's log (run_logs.py's ``rank<R>.log``), where heartbeats go; None without a log dir."""
    return worker_log_path(cfg, rank) if cfg.logging.log_dir or cfg.logging.run_dir else None


def _note_start(run: Run, state: TrainState) -> None:
    """Rank 0 says when a run will train nothing, or will save over an earlier run's checkpoints
    (``_saves_over``)."""
    cfg = run.cfg
    if run.ps.rank != 0:
        return
    if state.iteration >= run.train_iters:
        samples = cfg.training.train_samples
        flag = "--train-iters" if samples is None else "--train-samples"
        length = f"--train-iters {run.train_iters}" if samples is None else \
            f"the {run.train_iters} iterations of --train-samples {samples}"
        print(f"note: the checkpoint is at iteration {state.iteration} ≥ {length}: nothing to train; "
              f"raise {flag} to go on", flush=True)
    note = _saves_over(cfg.checkpoint)
    if note:
        print(f"note: {note}", flush=True)


def _saves_over(c: C.CheckpointConfig) -> Optional[str]:
    """What a run will do to the checkpoints --save already holds when they are not the ones it
    resumes from, or None: a save replaces the folder of its iteration and prunes the older ones
    (``checkpoint.dist.prune``; "saves beside it" was said before, while they went). Such a run: one
    without --load, a --finetune one (whatever --save holds; with --save = --load it replaced the
    very checkpoints it read, silently), or one loading another folder (a Hugging Face model's or
    converted weights, or another run's checkpoint); each starts over from there when run again."""
    from ..checkpoint import convert, dist as ckpt
    save, load = c.save, c.load
    if not save or (load and not c.finetune and _same_folder(load, save)):
        return None
    earlier = ckpt.complete_iterations(save)
    if not earlier:
        return None
    if not load:
        start, fix = "starts from scratch (no --load)", \
            f"pass --load {save} to resume instead, or give another --save to keep them"
    elif c.finetune:
        start, fix = "starts at iteration 0 (--finetune)", \
            ("a restart of this command fine-tunes again from iteration 0, as Megatron's --finetune does: give "
             "another --save to keep them, and resume from it without --finetune")
    else:
        start = f"starts at iteration 0 from the weights of --load {load}" if convert.is_weights_only(load) else \
            f"resumes from --load {load}"
        fix = (f"give another --save to keep them; a restart of this command starts again from --load {load} (to "
               f"go on from its own saves, --load the --save folder)")
    return (f"--save {save} already holds {os.path.basename(ckpt.iteration_dir(save, earlier[-1]))} from an "
            f"earlier run; this run {start} and saves into the same folder: each save replaces the earlier run's "
            f"checkpoint of its iteration and keeps only the newest --keep-checkpoints {c.keep_checkpoints} below "
            f"it, the earlier run's included; {fix}")


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def build(cfg: C.Config, dtype: Optional[torch.dtype] = None) -> Run:
    """Process groups, seeds, tokenizer, datasets, model chunks, DDP, optimizer, scheduler, logger.

    dtype: the params' dtype; None picks it from the flags (``params_dtype``). The parity tests
    pass torch.float64 to train the production path in double precision.
    """
    t, p = cfg.training, cfg.parallel
    init_distributed(p.distributed_timeout_minutes)
    ps = ParallelState.build(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                             p.context_parallel_size, p.expert_model_parallel_size,
                             p.num_distributed_optimizer_instances)
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    if fast.enabled(t.fast_path, ps.device) and ps.device.type == "cuda":
        # the fast path's attention dropout draws from the default CUDA generator: one stream per
        # TP rank, seeded as Megatron's model-parallel RNG (parallel/random.py)
        torch.cuda.manual_seed(t.seed + MODEL_PARALLEL_SEED_OFFSET + ps.tp_rank)
    dtype = dtype or params_dtype(cfg, ps.device)
    if (t.bf16 or t.fp16) and dtype == torch.float32 and ps.rank == 0:
        print("note: --bf16/--fp16 ignored on CPU; training in fp32", flush=True)
    if t.fp8_format and ps.device.type != "cuda" and ps.rank == 0:
        print(f"note: --fp8-format {t.fp8_format} on CPU: the FP8 GEMMs are emulated (quantize → dequantize → "
              f"matmul in {str(dtype).removeprefix('torch.')}), for tests; the speed-up needs a Hopper GPU", flush=True)
    tokenizer = build_tokenizer(cfg.data, cfg.model.vocab_size)
    check_data_vocab(cfg, tokenizer.vocab_size, ps)
    train_ds, valid_ds, _ = build_datasets(cfg, ps=ps, local_rank=local_rank())
    # every loader's workers forked now, once, before the model, the host optimizer state and the
    # loop's collectives (data/loader.py ``start`` says why: a later fork could leave a worker deadlocked)
    loaders = {id(ds): rank_loader(ds, cfg, ps).start() for ds in (train_ds, valid_ds)
               if ds is not None and cfg.data.num_workers > 0}
    t0 = time.perf_counter()
    with deferred_init():  # each weight drawn into its DDP bucket: no rank holds its whole model beside them
        chunks = build_model_chunks(cfg, ps, tokenizer.vocab_size, dtype)
    ddp = DistributedDataParallel(chunks, ps, cfg)
    if ps.device.type == "cuda":
        torch.cuda.synchronize(ps.device)
    build_s = time.perf_counter() - t0
    opt = build_optimizer(cfg, ps, chunks, ddp)
    gb, nmb = C.global_batch(cfg, ps.world_size), C.num_microbatches(cfg, ps.world_size)
    batches, iters = C.batch_schedule(cfg, ps.world_size), C.run_iterations(cfg, ps.world_size)
    sched = scheduler_for(cfg, ps.world_size)
    padded = C.padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, ps.tp)
    log_dir = cfg.logging.log_dir or (os.path.join(cfg.logging.run_dir, "logs") if cfg.logging.run_dir else None)
    logger = MetricsLogger(enabled=ps.is_logging_rank, log_dir=log_dir, train_iters=iters,
                           log_interval=t.log_interval, global_batch=gb, seq_length=cfg.model.seq_length,
                           flops_per_iter=flops_per_iteration(cfg.model, gb, padded),
                           world_size=ps.world_size, dtype=dtype, fp16=t.fp16 and dtype == torch.float16,
                           tensorboard_dir=cfg.logging.tensorboard_dir,
                           layout=dict(saved_layout(ps, cfg), ep=ps.ep, nodes=_nodes(ps)))
    if ps.rank == 0:
        n = sum(q.numel() for c in chunks for q in c.parameters())
        ramp = (f" after a ramp from {t.rampup_batch_size[0]}" if batches.ramp else
                f" by --step-batch-size-schedule from {batches.batch_at(0)}" if batches.steps else "")
        print(f"meshlm: {ps.describe()} | {n:,} parameters on rank 0 | global batch {gb} = "
              f"{nmb} micro-batches × {t.micro_batch_size} × DP {ps.dp}{ramp} | {iters} iterations | "
              f"model built on {ps.device.type} in {build_s:.1f} s", flush=True)
    report_memory(opt.memory_report(), ps)
    saver = None
    if cfg.checkpoint.async_save and cfg.checkpoint.save:
        from ..checkpoint.async_save import AsyncSaver
        saver = AsyncSaver(ps.world_size, p.distributed_timeout_minutes)
    return Run(cfg, ps, tokenizer, train_ds, valid_ds, chunks, ddp, opt, sched, logger, gb, nmb, batches, iters,
               saver=saver, loaders=loaders, stragglers=StragglerWatch(ps), spikes=LossSpikes(t.loss_spike_threshold),
               fp8_states=fp8_delayed.delayed_states(chunks))


def _nodes(ps: ParallelState) -> int:
    """Hosts of the job: the world over the local workers (LOCAL_WORLD_SIZE, set by torchrun and by
    meshlm's own launch; a process started alone is one host)."""
    return max(1, ps.world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or ps.world_size)))


def check_data_vocab(cfg: C.Config, vocab_size: int, ps: ParallelState) -> None:
    """Check the .bin files of the data flags for ids ≥ vocab_size (``check_token_ids``, on rank 0);
    every rank raises the same DataError (naming the file and the largest id) so none is left
    waiting in a collective. A .bin without a recorded range is scanned by all the ranks together,
    each an interleaved share (``token_ranges``): a corpus of terabytes within the collectives'
    timeout, on the first start only."""
    prefixes = [prefix for _, prefix in data_prefixes(blends(cfg.data))]
    if not prefixes:
        return
    ranges = token_ranges(list(dict.fromkeys(prefixes)), cfg.data.data_cache_path, ps)
    problem = None
    if ps.rank == 0:
        try:
            kind = resolve_tokenizer_type(cfg.data, cfg.model.vocab_size)
            check_token_ids(prefixes, vocab_size, kind == "NullTokenizer", kind == "TikTokenizer",
                            cfg.data.data_cache_path, ranges)
        except DataError as e:
            problem = str(e)
    problem = first_problem(problem)
    if problem:
        raise DataError(problem)


def token_ranges(prefixes: list, cache_dir, ps: ParallelState) -> dict:
    """{prefix: (smallest, largest) id} of each .bin: rank 0's recorded ranges, and for the others
    every rank's ``scan_range`` share reduced over the world (min, max), recorded by rank 0.
    Collective; a .bin a rank cannot open is every rank's DataError."""
    from ..data.indexed import IndexedDataset, record_range, recorded_range, scan_range
    problem, datasets = None, {}
    try:
        datasets = {p: IndexedDataset(p) for p in prefixes}
    except DataError as e:
        problem = str(e)
    problem = first_problem(problem)
    if problem:
        raise DataError(problem)
    known = [{p: recorded_range(ds, cache_dir) for p, ds in datasets.items()} if ps.rank == 0 else None]
    if ps.world_size > 1:
        torch.distributed.broadcast_object_list(known, src=0)
    known = known[0]
    todo = [p for p in prefixes if known[p] is None]
    if todo:
        shares = [scan_range(datasets[p], ps.rank, ps.world_size) for p in todo]
        lo = torch.tensor([a for a, _ in shares], dtype=torch.int64, device=ps.device)
        hi = torch.tensor([b for _, b in shares], dtype=torch.int64, device=ps.device)
        if ps.world_size > 1:
            watchdog.call("all_reduce of the token-id ranges", None, torch.distributed.all_reduce, lo,
                          torch.distributed.ReduceOp.MIN)
            watchdog.call("all_reduce of the token-id ranges", None, torch.distributed.all_reduce, hi,
                          torch.distributed.ReduceOp.MAX)
        for p, a, b in zip(todo, lo.tolist(), hi.tolist()):
            known[p] = (0, -1) if b < a else (a, b)
            if ps.rank == 0:
                record_range(datasets[p], known[p], cache_dir)
    return known


def report_memory(report: dict, ps: ParallelState) -> None:
    """Print, on rank 0, each rank's bytes for weights, gradients and optimizer state (and per
    parameter) from the optimizer's memory_report(): the ZeRO-paper accounting, before activations."""
    reports = [report]
    if ps.world_size > 1:
        reports = [None] * ps.world_size
        watchdog.call("all_gather of the memory reports", None, torch.distributed.all_gather_object,
                      reports, report)
    if ps.rank != 0:
        return
    def size(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
    shown = reports if len(reports) <= 8 else [max(reports, key=lambda r: r["total_bytes"])]
    for rank, r in enumerate(shown):
        b = r["bytes_per_param"]
        who = f"rank {rank}" if len(reports) <= 8 else "largest rank"
        host = r.get("optimizer_host_bytes", 0)
        offload = (f" | host (--optimizer-cpu-offload): optimizer {size(host)} + staging "
                   f"{size(r.get('host_staging_bytes', 0))}") if host else ""
        print(f"meshlm: memory {who}: {r['num_params']:,} params | weights {size(r['weights_bytes'])} "
              f"+ grads {size(r['grads_bytes'])} + optimizer {size(r['optimizer_bytes'])} "
              f"= {size(r['total_bytes'])} | bytes/param {b['weights']:.1f} + {b['grads']:.1f} "
              f"+ {b['optimizer']:.1f} = {b['total']:.1f}{offload}", flush=True)


def train(run: Run, state: TrainState) -> dict:
    """The loop from ``state`` to the run's iterations: step, log, evaluate, save; then a last
    evaluation and checkpoint, and a sample. As in Megatron, a step whose number of micro-batches
    differs from the previous step's (a --rampup-batch-size ramp, a --step-batch-size-schedule) is preceded by a checkpoint under
    --save. An early exit (--exit-signal-handler, --exit-duration-in-mins, --exit-interval; checked
    after each iteration's save, as Megatron's checkpoint_and_decide_exit) saves (with --save) and
    returns at once. With --manual-gc, Python's collector runs only where manual_gc.py says."""
    t = run.cfg.training
    collector = ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)
    with collector.running():
        return _train(run, state, collector)


def _train(run: Run, state: TrainState, collector: ManualGC) -> dict:
    cfg, t = run.cfg, run.cfg.training

    def validation(index: int) -> float:
        with collector.evaluation():
            return evaluate(run, state, index)

    save_every = cfg.checkpoint.save_interval
    losses, val_losses, saved_at, exited = [], [], None, False
    start = _job_start(run.ps) if t.exit_duration_in_mins else None
    if t.eval_at_start and state.iteration == 0 and run.valid_ds is not None:
        val_losses.append((0, validation(0)))
    microbatches = run.batches.microbatches_at(state.consumed_samples)
    prof = profiling.for_run(cfg, run.ps)
    bar = progress.for_run(run.ps.is_logging_rank, run.train_iters, state.iteration)
    launched = None  # the step launched last and not yet finished (finish_step)

    def finish() -> None:
        nonlocal launched
        if launched is not None:
            step, launched = launched, None
            loss = finish_step(run, step)
            losses.append(loss)
            bar.update(step.iteration, loss)

    while state.iteration < run.train_iters:
        finish()  # the last step's checks, before this one's zero_grad; the GPU still runs its update
        previous, microbatches = microbatches, run.batches.microbatches_at(state.consumed_samples)
        if microbatches != previous and cfg.checkpoint.save and saved_at != state.iteration:
            save_checkpoint(run, state)
            saved_at = state.iteration
        with prof.step(state.iteration):
            launched = launch_step(run, state)
            if not launched.deferred:
                finish()
        it = state.iteration
        collector.after_step(it)
        evaluate_now = t.eval_interval and it % t.eval_interval == 0 and run.valid_ds is not None
        save_now = cfg.checkpoint.save and save_every and it % save_every == 0
        if evaluate_now or save_now or _may_exit(run, it):
            finish()  # nothing is evaluated, saved or left behind before its step is checked
        if evaluate_now:
            val_losses.append((it, validation(it // t.eval_interval - 1)))
        if save_now:
            save_checkpoint(run, state)
            saved_at = it
        exited = _agreed_stop(run, start, it) or _at_exit_interval(run, it)
        if exited:
            break
    finish()
    prof.close()
    bar.close()
    run.opt.settle_params()  # no all-gather may still be in flight when the process ends
    if not exited and run.valid_ds is not None and (not val_losses or val_losses[-1][0] != state.iteration):
        val_losses.append((state.iteration, validation(state.iteration // max(t.eval_interval, 1))))
    if cfg.checkpoint.save and saved_at != state.iteration:
        save_checkpoint(run, state)
    if run.saver is not None:  # the last background save, complete on every rank (or CheckpointError)
        run.last_checkpoint = run.saver.wait() or run.last_checkpoint
    if not exited:
        _print_sample(run)
    done = [x for x in losses if x is not None]
    return {"iterations": state.iteration, "train_losses": losses,
            "final_train_loss": done[-1] if done else None, "val_losses": val_losses,
            "first_val_loss": val_losses[0][1] if val_losses else None,
            "last_val_loss": val_losses[-1][1] if val_losses else None,
            "last_checkpoint": run.last_checkpoint}


_START_TIME = time.time()  # this worker's start (the import), as Megatron's _TRAIN_START_TIME
_wall_clock = time.time  # the clock --exit-duration-in-mins reads (tests give a rank another one)


def _job_start(ps: ParallelState) -> float:
    """When the job started, seconds since the epoch: the earliest worker start (Megatron's MIN
    over ranks). Collective over all ranks."""
    start = torch.tensor([_START_TIME], dtype=torch.float64, device=ps.device)
    if ps.world_size > 1:
        torch.distributed.all_reduce(start, op=torch.distributed.ReduceOp.MIN)
    return float(start.item())


def _agreed_stop(run: Run, start: Optional[float], iteration: int) -> bool:
    """True on every rank once any rank has received --exit-signal (--exit-signal-handler) or once
    any rank's clock says more than --exit-duration-in-mins minutes have passed since ``start``: a
    MAX over ranks, so all stop at the same iteration and none waits in a collective. Collective
    over all ranks, one host sync, only when one of the two flags is set."""
    t, signalled = run.cfg.training, run.stop_signal
    limit = t.exit_duration_in_mins
    if not limit and signalled is None:
        return False
    minutes = (_wall_clock() - start) / 60.0 if limit else 0.0
    flags = [bool(limit) and minutes > limit, signalled is not None and signalled.received]
    up = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=run.ps.device)
    if run.ps.world_size > 1:
        torch.distributed.all_reduce(up, op=torch.distributed.ReduceOp.MAX)
    out_of_time, got_signal = (bool(x) for x in up.tolist())
    if run.ps.rank == 0 and got_signal:
        print(f"exiting after iteration {iteration}: {t.exit_signal} received (--exit-signal-handler)",
              flush=True)
    if run.ps.rank == 0 and out_of_time:
        print(f"exiting after {minutes:.2f} minutes (--exit-duration-in-mins {limit})", flush=True)
    return out_of_time or got_signal


def _may_exit(run: Run, iteration: int) -> bool:
    """Whether the loop may stop after this iteration: the last, an --exit-interval multiple, or
    any iteration under --exit-duration-in-mins or --exit-signal-handler (whose agreement is a host
    sync each iteration anyway)."""
    t = run.cfg.training
    return (iteration >= run.train_iters or bool(t.exit_interval and iteration % t.exit_interval == 0)
            or bool(t.exit_duration_in_mins) or run.stop_signal is not None)


def _at_exit_interval(run: Run, iteration: int) -> bool:
    """--exit-interval: True after an iteration divisible by it (the same on every rank)."""
    every = run.cfg.training.exit_interval
    if not every or iteration % every:
        return False
    if run.ps.rank == 0:
        print(f"exiting at iteration {iteration} (--exit-interval {every})", flush=True)
    return True


def train_step(run: Run, state: TrainState) -> Optional[float]:
    """One optimizer step on one global batch, waited for; return its loss (None when the step
    was skipped). The training loop instead launches each step and finishes it during the next
    (``launch_step``, ``finish_step``)."""
    return finish_step(run, launch_step(run, state))


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose host checks are not yet done (``finish_step``).

    result: the optimizer's StepResult, or its DeferredStep when ``deferred`` (the norm not yet
    read; the LR schedule already stepped). The rest is what ``finish_step`` logs: the iteration, its start (perf_counter
    s), the schedule's end, the watchdog's wait before it, the LR and batch it used, the samples
    consumed after it, the forward_backward outputs (the NaN origin's losses), the loss's and the
    MoE statistics' reads, the PP timeline's events on log iterations."""

    iteration: int
    result: object
    deferred: bool
    start: float
    schedule_end: float
    waited: float
    lr: float
    batch: int
    consumed_samples: int
    outputs: list
    read_loss: object
    read_moe: object
    log_now: bool
    timeline: Optional[list]


def launch_step(run: Run, state: TrainState) -> LaunchedStep:
    """Queue one step: forward-backward, gradient sync, loss reduction, the optimizer step; and
    advance ``state``. Where the optimizer ``can_defer`` (bf16/fp32 without --skip-nan-steps: a
    non-finite step stops the run, so no host decision waits for it) the step makes no host sync:
    the clip is computed on the device and the LR schedule steps at once. ``finish_step`` reads
    the loss and grad norm, stops on a NaN/inf and logs."""
    cfg, ps, t = run.cfg, run.ps, run.cfg.training
    it = state.iteration + 1
    log_now = it % t.log_interval == 0 or it == run.train_iters
    timeline = [] if log_now and ps.pp > 1 else None
    if log_now:
        comm.start_timing()  # TP collectives and PP waits of this step (metrics.jsonl comm_s)
    start, waited = time.perf_counter(), watchdog.waited_s()
    watchdog.at(it, "forward-backward")
    run.ddp.zero_grad()
    batch = run.batches.batch_at(state.consumed_samples)
    data = run.micro_batches(run.train_ds, state.consumed_samples)
    outputs = forward_backward(run.chunks, data, ps=ps, cfg=cfg,
                               num_microbatches=run.batches.microbatches_at(state.consumed_samples),
                               loss_scale=run.opt.loss_scale, no_sync=run.ddp.no_sync, timeline=timeline)
    schedule_end = time.perf_counter()
    run.ddp.finish_grad_sync()
    if run.fp8_states:  # --fp8-recipe delayed: this step's amaxes into the histories (next step's scales)
        fp8_delayed.end_step(run.fp8_states, (ps.tp_group, ps.dp_cp_group))
    lr = run.sched.lr
    loss_t = reduce_losses(outputs, ps, t.calculate_per_token_loss)
    read_loss = start_read(loss_t)  # copied before the optimizer: reading it waits for no update
    read_moe = start_routing_stats(run.chunks, ps, cfg.model) if log_now and cfg.model.num_experts else None
    watchdog.at(it, "optimizer step")
    defer = run.opt.can_defer and not t.skip_nan_steps
    with annotate("optimizer step"):
        result = run.opt.step(loss_t, defer=defer)  # a NaN loss makes the norm NaN: one check for both
    if defer:  # a deferred step is applied, or it stops the run: the schedule moves on now
        run.sched.step(run.opt, batch)
    state.iteration = it
    state.consumed_samples += batch
    return LaunchedStep(it, result, defer, start, schedule_end, waited, lr, batch, state.consumed_samples,
                        outputs, read_loss, read_moe, log_now, timeline)


def finish_step(run: Run, step: LaunchedStep) -> Optional[float]:
    """The host's half of a launched step: read its loss and grad norm (the step's one wait:
    for the norm, not for the update after it), stop on a NaN/inf (TrainingError, unless
    --skip-nan-steps), step the LR schedule (if not done at launch), log. Returns the loss, None
    when the step was skipped. Call before the next step's ``zero_grad``: the NaN origin reads
    this step's gradients."""
    ps, it, t = run.ps, step.iteration, run.cfg.training
    result = step.result.resolve()
    loss = step.read_loss()
    nan = not math.isfinite(loss)
    if nan and not run.logger.fp16:  # fp16: the loss scaler backs off and the run goes on
        _stop_unless_skipping(run, it, f"lm loss is {loss}", step.outputs)
    elif not result.ok:  # inf/NaN gradients under bf16/fp32, or fp16 at --min-loss-scale
        _stop_unless_skipping(run, it, "gradients are inf/NaN", step.outputs)
    else:
        run.nan_skips = 0
    grad_norm, skipped = (None if nan else result.grad_norm), result.skipped or not result.ok
    spike_mean = None if skipped or nan else run.spikes.check(loss)
    spike_line = None if skipped or nan else run.spikes.report(it, loss, spike_mean)
    if spike_line and ps.is_logging_rank:
        print(spike_line, flush=True)
    if not skipped and not step.deferred:
        run.sched.step(run.opt, step.batch)
    timeline, bubble = step.timeline, None
    if timeline is not None:
        timeline, bubble = _pipeline_timeline(ps, timeline, (step.start, step.schedule_end))
    iter_s = time.perf_counter() - step.start
    run.stragglers.add(iter_s, watchdog.waited_s() - step.waited)
    timed = comm.stop_timing() if step.log_now else None  # after the norm's wait: events have fired
    lg = run.cfg.logging  # --log-params-norm, --log-num-zeros-in-grad: on log iterations, every rank
    extra = {"params_norm": run.opt.params_norm() if step.log_now and lg.log_params_norm else None,
             "num_zeros": run.opt.zeros_in_grad() if step.log_now and lg.log_num_zeros_in_grad else None}
    run.logger.train_step(it, step.consumed_samples, lm_loss=None if nan else loss, lr=step.lr,
                          grad_norm=grad_norm, iter_s=iter_s,
                          loss_scale=run.opt.loss_scale, skipped=skipped and not nan, nan=nan,
                          comm_s=run.ddp.stats.exposed_s if ps.dp * ps.cp > 1 else None,
                          bubble=bubble, timeline=timeline, global_batch=step.batch, timed_comm_s=timed,
                          rank_iter_s=run.stragglers.gather() if step.log_now else None,
                          loss_spike=spike_mean is not None,
                          moe=step.read_moe() if step.read_moe is not None else None, **extra)
    watchdog.at(it, "between steps", step_ended=True)
    return None if skipped or nan else loss


def _pipeline_timeline(ps: ParallelState, timeline: list, window: tuple) -> tuple:
    """Every stage's F/B events of this step, each tagged with its "stage", gathered over the
    pipeline group (perf_counter is CLOCK_MONOTONIC: one clock for the processes of a node), and
    the bubble fraction averaged over the stages, each measured over its own step window."""
    own = {"events": [dict(e, stage=ps.pp_rank) for e in timeline],
           "bubble": bubble_fraction(timeline, window)}
    stages = [None] * ps.pp
    watchdog.call("all_gather of the pipeline timeline", ps.pp_group, torch.distributed.all_gather_object,
                  stages, own, group=ps.pp_group)
    events = [e for st in stages for e in st["events"]]
    return events, sum(st["bubble"] for st in stages) / ps.pp


MAX_NAN_SKIPS = 20  # --skip-nan-steps: this many non-finite steps in a row stop the run


def _stop_unless_skipping(run: Run, iteration: int, what: str, outputs: list) -> None:
    """Raise TrainingError naming the iteration, the rank(s) where the NaN/inf arose
    (faults.nan_origin: collective) and the last good checkpoint, unless --skip-nan-steps, where
    rank 0 prints the same facts and the step is skipped; but :data:`MAX_NAN_SKIPS` such steps in a
    row stop the run too (a skipped step leaves the weights as they were, so weights that make every
    batch non-finite were skipped to the end of the run, training nothing, for as long as it ran)."""
    origin = nan_origin(run.ps, outputs, run.ddp.local_grads_finite())
    run.nan_skips += 1
    if not run.cfg.training.skip_nan_steps:
        raise TrainingError(f"iteration {iteration}: {what} ({origin}); last good checkpoint: "
                            f"{run.last_checkpoint or 'none'}; resume from it with a lower --lr, "
                            f"or pass --skip-nan-steps")
    if run.nan_skips >= MAX_NAN_SKIPS:
        raise TrainingError(f"iteration {iteration}: {what} ({origin}), the {run.nan_skips}th step in a row: "
                            f"--skip-nan-steps cannot recover (a skipped step leaves the weights as they are); "
                            f"last good checkpoint: {run.last_checkpoint or 'none'}; resume from it with a "
                            f"lower --lr")
    if run.ps.rank == 0:
        print(f"iteration {iteration}: {what} ({origin}); step skipped (--skip-nan-steps)", flush=True)


@torch.no_grad()
def evaluate(run: Run, state: TrainState, index: int) -> float:
    """Mean validation loss over --eval-iters global batches (forward only, dropout off).

    index: which evaluation this is; evaluation k reads the k-th block of eval_iters × global
    batch validation samples (Megatron's valid sample count), wrapping round if the split is short.
    """
    cfg, ps, t = run.cfg, run.ps, run.cfg.training
    watchdog.at(state.iteration, "evaluation")
    span = t.eval_iters * run.global_batch
    offset = index * span if (index + 1) * span <= len(run.valid_ds) else 0
    for chunk in run.chunks:
        chunk.eval()
    total = 0.0
    for i in range(t.eval_iters):
        data = run.micro_batches(run.valid_ds, offset + i * run.global_batch)
        outputs = forward_backward(run.chunks, data, ps=ps, cfg=cfg, num_microbatches=run.num_microbatches,
                                   forward_only=True)
        total += float(reduce_losses(outputs, ps, t.calculate_per_token_loss).item())
    for chunk in run.chunks:
        chunk.train()
    val = total / t.eval_iters
    run.logger.evaluation(state.iteration, state.consumed_samples, val)
    return val


def _print_sample(run: Run) -> None:
    """After a run on real text (not mock data) that saved a checkpoint, print a short sample
    from it on rank 0 with a TP=1/PP=1 copy of the model; skipped for models over 1B params.
    A run without --save prints one line instead: a checkpoint it only loaded is the old model.
    generate (and through it torch.distributed.checkpoint, DTensor and sympy: ~0.7 CPU-s) is
    imported only when a sample is printed, not at the end of every rank's run."""
    cfg = run.cfg
    if isinstance(run.tokenizer, NullTokenizer) or run.ps.rank != 0:
        return
    if not _saved_by_this_run(run):
        print("no sample printed: this run saved no checkpoint (pass --save to sample the trained model)",
              flush=True)
        return
    if _approx_params(cfg.model, run.tokenizer.vocab_size) > 1e9:
        return
    from .generate import DEFAULT_PROMPT, load_model, prompt_ids, sample_text
    model, tokenizer = load_model(run.last_checkpoint, device=run.ps.device)
    room = model.max_context - len(prompt_ids(tokenizer, DEFAULT_PROMPT))
    text = sample_text(model, tokenizer, DEFAULT_PROMPT, max_new_tokens=min(48, room), temperature=0.8, top_k=40, seed=0)
    print(f"sample from {run.last_checkpoint}:\n{DEFAULT_PROMPT}{text}", flush=True)


def _saved_by_this_run(run: Run) -> bool:
    """True when run.last_checkpoint lies in --save: train() saves there at the final iteration
    whenever --save is given, so it is this run's model (not the checkpoint --load read)."""
    save = run.cfg.checkpoint.save
    return bool(save and run.last_checkpoint) and \
        os.path.dirname(os.path.abspath(run.last_checkpoint)) == os.path.abspath(save)


def _approx_params(m: C.ModelConfig, vocab: int) -> float:
    h, f = m.hidden_size, C.ffn_hidden(m)
    return m.num_layers * (4 * h * h + (3 if m.swiglu else 2) * h * f) + vocab * h
