"""A training run's checkpoints: what ``train`` saves and ``pretrain`` resumes from (the glue between the
trainer's Run and checkpoint/: dist.py writes and reads, state.py says what goes in).

``save_checkpoint`` writes the model and optimizer in model space (any layout loads any other), the
scheduler, RNG states and progress (``TrainState``); ``load_checkpoint`` resumes from --load with
Megatron's switches (--finetune, --no-load-optim, --no-load-rng), or fine-tunes from a Hugging Face
folder's weights; every rank agrees on one problem line before any goes on. The checkpoint modules
(torch.distributed.checkpoint and DTensor: about 0.9 s of imports) load inside these functions, so a
worker that neither saves nor loads never imports them. ``run`` is the trainer's Run (training/trainer.py), not
imported here: the trainer imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Optional

from .. import config as C
from ..errors import CheckpointError, DamagedCheckpoint
from ..parallel import watchdog
from ..parallel.agree import first_problem
from ..parallel.mesh import ParallelState
from ..parallel.pipeline import virtual_size


@dataclass
class TrainState:
    """Progress that a checkpoint must restore: optimizer steps done and samples consumed."""

    iteration: int = 0
    consumed_samples: int = 0


def saved_layout(ps: ParallelState, cfg: C.Config) -> dict:
    """The layout a checkpoint records (checkpoint.json; any layout loads any other). ZeRO stage 1–3
    by any of its flags (``config.zero_stage``) shards the optimizer: ``distributed_optimizer``."""
    zero = C.zero_stage(cfg.parallel)
    return {"tp": ps.tp, "pp": ps.pp, "cp": ps.cp, "dp": ps.dp, "virtual_pipeline": virtual_size(cfg),
            "distributed_optimizer": zero >= 1, "zero_stage": zero}


def _coords(ps: ParallelState) -> dict:
    return {"tp": ps.tp_rank, "pp": ps.pp_rank, "cp": ps.cp_rank, "dp": ps.dp_rank}


def save_checkpoint(run, state: TrainState) -> str:
    """Save model, optimizer, scheduler, RNG and progress to --save/iter_XXXXXXX (collective);
    return that folder.

    Model and optimizer tensors go in model space, each rank writing its own pieces (nothing
    gathered: checkpoint/state.py); RNG states under this rank's key; the rest is global.
    With --async-save (``run.saver``) the state is snapshotted and written in the background
    (checkpoint/async_save.py): the previous background save is waited for first (it becomes
    ``run.last_checkpoint``; a failure of it raises CheckpointError here), and this one is
    complete once the next save or the end of ``train`` has waited for it. The time the loop was
    blocked is printed and written to metrics.jsonl (``save_blocked_ms``), for both kinds.
    """
    from ..checkpoint import dist as ckpt
    from ..checkpoint.model_space import ModelSpace
    from ..checkpoint.state import model_state, optimizer_state, rng_state
    cfg, ps = run.cfg, run.ps
    watchdog.at(state.iteration, "checkpoint save")
    start = time.perf_counter()
    run.opt.settle_params()  # ZeRO-1 --overlap-param-gather: weights complete first; ZeRO-3: its shards are read
    space = ModelSpace(run.chunks, ps)
    tree = {**model_state(space, shards=run.ddp.shard_pieces()),
            "optimizer": optimizer_state(run.opt, space),
            "scheduler": run.sched.state_dict(),
            ckpt.rank_key("rng", ps.rank): rng_state(),
            "dropout_call": max(chunk.rng.call for chunk in run.chunks),
            "train": dataclasses.asdict(state)}
    where = dict(layout=saved_layout(ps, cfg), config=_portable_config(cfg), coords=_coords(ps),
                 keep=cfg.checkpoint.keep_checkpoints)
    root, background = cfg.checkpoint.save, run.saver is not None
    if background:
        run.last_checkpoint = run.saver.start(root, state.iteration, tree, **where) or run.last_checkpoint
        path = ckpt.iteration_dir(root, state.iteration)
    else:
        path = run.last_checkpoint = ckpt.save(root, state.iteration, tree, **where)
    blocked = time.perf_counter() - start
    run.logger.checkpoint(state.iteration, state.consumed_samples, path, blocked, background)
    if ps.rank == 0:
        print(f"{'saving checkpoint' if background else 'saved checkpoint'} {path}"
              f"{' in the background' if background else ''} (loop blocked {1000 * blocked:.1f} ms)", flush=True)
    return path


def load_checkpoint(run) -> TrainState:
    """Resume from --load, at any layout. No tracker and --load == --save: a fresh start (Megatron's rule).

    What is restored: the model and the optimizer's tensors (read in place by ``_read_checkpoint``,
    resharded to this layout), the optimizer's scalars, the scheduler, the progress (iteration,
    consumed samples: global, so the data position follows) and the dropout call counter (global:
    every chunk of every rank counts the same forwards); RNG states from the saved rank at the
    same (tp, cp, dp, pp) coordinates — this rank itself when the layout is unchanged — and, when
    the saved layout has no rank there, the states ``build`` seeded are kept (as Megatron keeps
    them on a TP/PP change).

    Less is restored under Megatron's switches (checkpointing.py load_checkpoint): the optimizer
    state (fp32 masters, Adam moments and step, loss scale) and the LR schedule unless
    --no-load-optim or --finetune, which leave both fresh and rebuild the masters from the loaded
    weights (their tensors are not read); the RNG states (python, numpy, torch, dropout call counts)
    unless --no-load-rng or --finetune; the iteration and consumed samples unless --finetune,
    which starts both at 0 (and, as Megatron skips its argument check, does not compare the
    saved architecture flags: the tensors' names and shapes must still match).

    Raises CheckpointError, the same line on every rank (agreed before any rank goes on, so none
    is left waiting in a collective), when --load is not a checkpoint, is damaged, or holds another
    model (config.json's architecture fields, then the model tensors' names and shapes).
    """
    from ..checkpoint import convert, dist as ckpt
    from ..checkpoint.state import set_rng_state
    cfg, ps = run.cfg, run.ps
    c = cfg.checkpoint
    root = c.load
    if convert.is_weights_only(root):  # a Hugging Face folder, or `meshlm convert`'s output
        return _load_weights_only(run)
    loaded, problem = _agreed_read(run, c.verify_integrity)
    if problem and problem[1] and not c.verify_integrity:  # damage that kept every file's size
        if ps.rank == 0:
            print(f"note: {problem[1]}: comparing every file's SHA-256 with its manifest (as --verify-integrity) "
                  f"to load the newest intact checkpoint", flush=True)
        loaded, problem = _agreed_read(run, True)
    if problem:
        raise CheckpointError(problem[0])
    if loaded is None:
        if ps.rank == 0:
            print(f"--load {c.load}: no checkpoint yet, starting from scratch", flush=True)
        return TrainState()
    iteration, tree = loaded
    if c.finetune:
        _check_every_weight_read(run, ckpt.iteration_dir(c.load, iteration))
    if _loads(c, "optim"):  # the schedule first: its check raises the same on every rank, before any collective
        run.sched.load_state_dict(tree["scheduler"], "override" if c.override_opt_param_scheduler else
                                  "checkpoint" if c.use_checkpoint_opt_param_scheduler else "check", c.load)
        run.opt.load_state_dict(tree["optimizer"])
        # --decoupled-lr's value where the loaded schedule stands (the optimizer's scalars hold --lr's only)
        run.opt.set_lr(run.opt.lr, run.sched.decoupled_lr)
    else:
        run.opt.reload_model_params(from_whole=False)  # ZeRO-3's shards were read as they lie
    if _loads(c, "rng"):
        if tree["rng"] is not None:
            set_rng_state(tree["rng"])
        for chunk in run.chunks:
            chunk.rng.call = tree["dropout_call"]
    run.last_checkpoint = ckpt.iteration_dir(c.load, iteration)
    if ps.rank == 0:
        fresh = [what for what, kind in (("optimizer and LR schedule", "optim"), ("RNG", "rng"))
                 if not _loads(c, kind)]
        print(f"loaded checkpoint {run.last_checkpoint} (iteration {iteration})"
              + (" for --finetune: model weights only, starting at iteration 0" if c.finetune else "")
              + (f"; {' and '.join(fresh)} fresh" if fresh and not c.finetune else ""), flush=True)
        differ = _flag_differences(run, run.last_checkpoint) if c.finetune else []
        if differ:  # weights of the same shapes under another function (e.g. --apply-layernorm-1p): as asked
            print(f"note: --finetune compares no architecture flags, and this run's differ from the checkpoint's: "
                  f"{', '.join(differ)}; the weights fit, so it trains them as this run's model", flush=True)
    return TrainState() if c.finetune else TrainState(**tree["train"])


def _check_every_weight_read(run, path: str) -> None:
    """--finetune compares no architecture flags, so a run whose model lacks some of the saved
    weights (fewer layers; tied embeddings where the checkpoint has its own output layer; no
    learned positions, biases...) read the rest and trained another model without a word: raise
    CheckpointError (the same line on every rank) naming them and the flags that differ. One
    all_gather of the model-space names each rank read (a stage reads only its own)."""
    from ..checkpoint.model_space import ModelSpace
    from ..checkpoint.state import model_state, unused_model_tensors
    from ..parallel.agree import all_problems
    mine = sorted(model_state(ModelSpace(run.chunks, run.ps), load=True, shards=run.ddp.shard_pieces())["model"])
    unused = unused_model_tensors(path, set(all_problems(mine)))
    if not unused:
        return
    names = f"{', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}"
    raise CheckpointError(f"--load {run.cfg.checkpoint.load}: checkpoint {os.path.basename(path)} holds "
                          f"{len(unused)} weight(s) this run's model has no place for ({names}); --finetune "
                          f"would drop them: pass the saved model's flags{_saved_flags(run, path)}")


def _flag_differences(run, path: str) -> list:
    """The architecture flags in which the run's model differs from the checkpoint folder's, as
    ``--flag saved=X now=Y`` (which --finetune does not compare up front); [] when none is found."""
    from ..checkpoint.state import model_config_differences
    try:
        return model_config_differences(path, run.cfg.model, run.cfg.checkpoint.load, run.tokenizer.vocab_size)
    except CheckpointError:
        return []


def _saved_flags(run, path: str) -> str:
    """" (--flag saved=X now=Y, ...)" of ``_flag_differences``, or ""."""
    diffs = _flag_differences(run, path)
    return f" ({', '.join(diffs)})" if diffs else ""


def _loads(c: C.CheckpointConfig, kind: str) -> bool:
    """Whether --load restores the "optim" (optimizer and LR schedule) or the "rng" states."""
    return not (c.finetune or (c.no_load_optim if kind == "optim" else c.no_load_rng))


def _load_weights_only(run) -> TrainState:
    """Fine-tune from --load's weights alone (checkpoint/convert.py): each rank copies its slice,
    the optimizer starts fresh from them, the run at iteration 0. Errors as load_checkpoint's."""
    from ..checkpoint import convert
    problem = None
    run.opt.finish_param_sync()  # ZeRO-3: the params whole (their shards are all they hold), then copied back
    try:
        convert.load_weights(run.chunks, run.cfg.model, run.cfg.checkpoint.load)
    except CheckpointError as e:
        problem = str(e)
    problem = first_problem(problem)
    if problem:
        raise CheckpointError(problem)
    run.opt.reload_model_params()
    if run.ps.rank == 0:
        print(f"loaded the weights of {run.cfg.checkpoint.load} to fine-tune: iteration 0, fresh optimizer",
              flush=True)
    return TrainState()


def _agreed_read(run, checksums: bool) -> tuple:
    """(``_read_checkpoint``'s result or None, the lowest rank's problem as (its line, what was
    damaged or None) or None), the problem the same on every rank (one all_gather)."""
    loaded, problem = None, None
    try:
        loaded = _read_checkpoint(run, checksums)
    except CheckpointError as e:
        problem = (str(e), e.damage if isinstance(e, DamagedCheckpoint) else None)
    return loaded, first_problem(problem)


def _read_checkpoint(run, checksums: bool) -> Optional[tuple]:
    """This rank's part of load_checkpoint: check --load, compare the saved model config (not under
    --finetune), read the model tensors (and, unless a switch says otherwise, the optimizer's) into
    place and the saved values. None for a fresh start. checksums: compare every file's SHA-256 too
    (--verify-integrity, or the retry after a damaged read), the load's one collective (the ranks
    share the hashing out); every rank reaches it alike, since the checks before it read the same
    shared --load folder."""
    from ..checkpoint import dist as ckpt
    from ..checkpoint.model_space import ModelSpace
    from ..checkpoint.state import check_model_config, model_state, optimizer_state
    cfg, ps = run.cfg, run.ps
    c = cfg.checkpoint
    problems = ckpt.check_loadable(c.load, c.save)
    if problems:
        raise CheckpointError(problems[0])
    if ckpt.read_tracker(c.load) is None and os.path.abspath(c.load) == os.path.abspath(c.save or ""):
        return None
    path = ckpt.checkpoint_dir(c.load, checksums=checksums)  # may fall back, saying so
    if not c.finetune:
        check_model_config(path, cfg.model, load=c.load, vocab_size=run.tokenizer.vocab_size)
    run.opt.settle_params()
    space = ModelSpace(run.chunks, ps)
    targets = model_state(space, load=True, shards=run.ddp.shard_pieces())
    if _loads(c, "optim"):
        targets["optimizer"] = optimizer_state(run.opt, space, load=True)
    try:
        return ckpt.load(c.load, targets, coords=_coords(ps), iteration=ckpt.read_manifest(path)["iteration"])
    except ckpt.TensorMismatch as e:  # --finetune compared no flags first: name those that differ
        if not c.finetune:
            raise
        raise CheckpointError(f"--load {c.load}: checkpoint {os.path.basename(path)} does not fit this run's model "
                              f"({e.found}); --finetune compares no flags, but the tensors must match: pass the "
                              f"saved model's flags{_saved_flags(run, path)}") from None


def _portable_config(cfg: C.Config) -> dict:
    """The config as a dict with tokenizer/data paths made absolute (read back by generate)."""
    d = cfg.to_dict()
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if d["data"][key]:
            d["data"][key] = os.path.abspath(d["data"][key])
    return d


def check_data_lasts(run, state: TrainState) -> None:
    """CheckpointError (the same line on every rank, before the first step) when the training data,
    sized from sample 0 for this run's steps (``num_samples_per_split``: the samples its steps take at
    its global batch or ramp, at least --train-samples), ends before the steps from the loaded position do: a checkpoint that
    consumed more samples a step than this run's global batch (saved at a larger DP, which the default
    global batch follows). The run stopped with a StopIteration traceback at the step that ran out."""
    if run.train_ds is None or state.iteration >= run.train_iters:
        return
    schedule = run.batches
    end = schedule.consumed_after(run.train_iters - state.iteration, state.consumed_samples)
    if end <= len(run.train_ds):
        return
    hint = ""
    if schedule.constant:
        unit = schedule.micro_dp
        need = -(-(-(-state.consumed_samples // state.iteration)) // unit) * unit
        hint = f"give --global-batch-size {need} or more (the checkpoint's steps averaged "
        hint += f"{state.consumed_samples / state.iteration:g} samples), or "
        batches = (f"this run's global batch {schedule.global_batch} × {state.iteration} steps", "at that batch")
    else:  # a ramp or step schedule: its first steps take less than G
        flag = "--rampup-batch-size" if schedule.ramp is not None else "--step-batch-size-schedule"
        batches = (f"the {schedule.consumed_after(state.iteration):,} of this run's first {state.iteration} steps by "
                   f"its {flag}", "by that schedule")
    raise CheckpointError(
        f"--load {run.cfg.checkpoint.load}: the checkpoint is at iteration {state.iteration} with "
        f"{state.consumed_samples:,} samples consumed, more than {batches[0]}; its training data, sized from "
        f"sample 0 {batches[1]}, holds {len(run.train_ds):,} samples and would run out before its last step "
        f"(which reads up to sample {end:,}): {hint}--finetune to start the data position at 0")
