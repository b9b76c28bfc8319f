"""Training runs given in samples (--train-samples) and with a batch ramp (--rampup-batch-size):
iterations, consumed samples, each step's batch and learning rate against megatron-core, DP=2
against one process in float64, the checkpoints Megatron takes when the batch grows, and resume
in the middle of the ramp and of a --step-batch-size-schedule segment."""

import json
import os

import pytest
import torch

from distributed import run_distributed
from megatron_ref import core_scheduler, core_steps, megatron_train_iters
from meshlm.training import trainer
from test_trainer import _rel, tiny_config

F64 = torch.float64
RAMP = (2, 2, 12)  # 2 → 8 by 2 over 12 samples: batches 2, 2, 4, 6, then 8 (4 is skipped to 6 at 8 consumed)
FINAL, MICRO, SAMPLES = 8, 1, 40


def _rows(tmp):
    with open(os.path.join(tmp, "logs", "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "lm_loss" in r]


def _by_samples(tmp, *, ramp=RAMP, final=FINAL, micro=MICRO, samples=SAMPLES, **training):
    cfg = tiny_config(tmp, micro=micro, global_batch=final, iters=None, train_samples=samples,
                      rampup_batch_size=list(ramp) if ramp else None, eval_iters=1, **training)
    o = cfg.optimizer
    o.lr_warmup_iters, o.lr_warmup_samples, o.lr_decay_style, o.min_lr = 0, 6, "cosine", 1e-3
    return cfg


def _megatron(steps, final, micro, dp, ramp, samples):
    """Megatron's steps: (global batch, consumed before, lr of the update) of each."""
    scheduler = core_scheduler("cosine", 6, samples, max_lr=1e-2, min_lr=1e-3)
    return [(batch, consumed, lr) for batch, _, consumed, lr in
            core_steps(steps, final, micro, dp, ramp and tuple(ramp), scheduler)]


def _constant(rank, world, tmp):
    return trainer.pretrain(_by_samples(tmp, ramp=None, final=4, micro=2, samples=30), F64)


def test_a_run_in_samples_takes_the_steps_that_fit_with_megatrons_sample_schedule(tmp_path):
    """--train-samples 30 at a global batch of 4: 7 steps (28 samples; the partial last batch is
    dropped), the LR warm-up and cosine decay counted in samples (6, 30)."""
    result = run_distributed(_constant, 1, str(tmp_path))[0]
    assert result["iterations"] == megatron_train_iters(30, 4, 2, 1) == 7
    rows = _rows(str(tmp_path))
    expected = _megatron(7, 4, 2, 1, None, 30)
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in rows] == [(b, c + b) for b, c, _ in expected]
    for r, (_, _, lr) in zip(rows, expected):
        assert r["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15)


def _ramped(rank, world, tmp, save):
    cfg = _by_samples(tmp)
    cfg.checkpoint.save, cfg.checkpoint.keep_checkpoints = save, 100  # keep every checkpoint to count them
    return trainer.pretrain(cfg, F64)


@pytest.fixture(scope="module")
def ramp_dp2(tmp_path_factory):
    """The ramped run over DP=2 (micro 1), saving: (its folder, rank 0's result)."""
    tmp = str(tmp_path_factory.mktemp("ramp_dp2"))
    return tmp, run_distributed(_ramped, 2, tmp, os.path.join(tmp, "ckpt"))[0]


def test_each_steps_batch_consumed_samples_and_lr_follow_megatron_core(ramp_dp2):
    tmp, result = ramp_dp2
    iterations = megatron_train_iters(SAMPLES, FINAL, MICRO, 2, RAMP)
    assert result["iterations"] == iterations == 7
    expected = _megatron(iterations, FINAL, MICRO, 2, RAMP, SAMPLES)
    rows = _rows(tmp)
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in rows] == [(b, c + b) for b, c, _ in expected]
    assert [b for b, _, _ in expected] == [2, 2, 4, 6, 8, 8, 8]
    for r, (_, _, lr) in zip(rows, expected):
        assert r["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15)
    assert len({r["lm_loss"] for r in rows}) == len(rows)


def test_a_checkpoint_is_saved_before_each_step_whose_micro_batches_change(ramp_dp2):
    """Megatron's rule: under --save, the batch growing saves first (after iterations 2, 3 and 4
    here), besides the checkpoint at the end."""
    tmp, _ = ramp_dp2
    saved = sorted(int(name[5:]) for name in os.listdir(os.path.join(tmp, "ckpt")) if name.startswith("iter_"))
    assert saved == [2, 3, 4, 7]


def _ramped_dp1(rank, world, tmp):
    return trainer.pretrain(_by_samples(tmp), F64)


def test_a_ramped_run_over_dp2_computes_what_one_process_does(ramp_dp2, tmp_path):
    """The same samples per step on either layout, the loss the mean of its micro-batch means:
    every loss equal within 1e-10 (float64)."""
    _, dp2 = ramp_dp2
    dp1 = run_distributed(_ramped_dp1, 1, str(tmp_path))[0]
    assert dp1["iterations"] == dp2["iterations"]
    for a, b in zip(dp2["train_losses"], dp1["train_losses"]):
        assert _rel(a, b) < 1e-10, (a, b)
    assert _rel(dp2["last_val_loss"], dp1["last_val_loss"]) < 1e-10


def _resume_in_the_ramp(rank, world, tmp):
    first = _by_samples(os.path.join(tmp, "first"), exit_interval=3)
    first.checkpoint.save = os.path.join(tmp, "ckpt")
    trainer.pretrain(first, F64)
    rest = _by_samples(os.path.join(tmp, "rest"))
    rest.checkpoint.save = rest.checkpoint.load = os.path.join(tmp, "ckpt")
    return trainer.pretrain(rest, F64)


def test_a_run_resumed_inside_the_ramp_repeats_the_uninterrupted_one(ramp_dp2, tmp_path):
    """Stopped after iteration 3 (8 samples consumed, the next batch 6) and resumed: the batch,
    the consumed samples, the LR and the losses go on as without the stop."""
    tmp, full = ramp_dp2
    resumed = run_distributed(_resume_in_the_ramp, 2, str(tmp_path))[0]
    assert resumed["iterations"] == full["iterations"]
    for a, b in zip(resumed["train_losses"], full["train_losses"][3:]):
        assert _rel(a, b) < 1e-12, (a, b)
    rows, full_rows = _rows(os.path.join(str(tmp_path), "rest")), _rows(tmp)[3:]
    assert [(r["global_batch_size"], r["consumed_samples"], r["lr"]) for r in rows] == \
        [(r["global_batch_size"], r["consumed_samples"], r["lr"]) for r in full_rows]


SCHEDULE = "0:2 64:4 160:6"  # tokens at --seq-length 16: 2 from sample 0, 4 from sample 4, 6 from sample 10


def _step_config(tmp, **training):
    cfg = tiny_config(tmp, micro=1, global_batch=None, iters=6, eval_iters=1, step_batch_size_schedule=SCHEDULE,
                      **training)
    cfg.optimizer.lr_decay_iters, cfg.optimizer.lr_decay_style, cfg.optimizer.min_lr = 5, "cosine", 1e-3
    return cfg


def _step_scheduled(rank, world, tmp):
    """The run; then the same stopped after iteration 3 (inside the batch-4 segment: 8 samples
    consumed, one more step of 4) and resumed from its checkpoint."""
    full = trainer.pretrain(_step_config(tmp), F64)
    first = _step_config(os.path.join(tmp, "first"), exit_interval=3)
    first.checkpoint.save = os.path.join(tmp, "ckpt")
    trainer.pretrain(first, F64)
    rest = _step_config(os.path.join(tmp, "rest"))
    rest.checkpoint.save = rest.checkpoint.load = os.path.join(tmp, "ckpt")
    return full, trainer.pretrain(rest, F64)


@pytest.mark.slow  # two processes, three runs
def test_a_step_batch_size_schedule_run_over_dp2_takes_each_steps_batch_and_lr_by_samples(tmp_path):
    """--train-iters 6 over DP 2 (micro 1): batches 2, 2, 4, 4, 6, 6 (the step at 12 samples is the
    first past sample 10); the LR's warm-up (1 iteration) and cosine decay (5 iterations) end where
    those steps end in samples, 2 and 18, as megatron-core's scheduler counts them. Resumed after
    iteration 3, inside a segment, the batches, samples, LR and losses go on as without the stop."""
    result, resumed = run_distributed(_step_scheduled, 2, str(tmp_path))[0]
    assert result["iterations"] == resumed["iterations"] == 6
    for a, b in zip(resumed["train_losses"], result["train_losses"][3:], strict=True):
        assert _rel(a, b) < 1e-12, (a, b)
    rest = [(r["global_batch_size"], r["consumed_samples"], r["lr"]) for r in _rows(os.path.join(tmp_path, "rest"))]
    assert rest == [(r["global_batch_size"], r["consumed_samples"], r["lr"]) for r in _rows(str(tmp_path))[3:]]
    rows = _rows(str(tmp_path))
    assert [(r["global_batch_size"], r["consumed_samples"]) for r in rows] == \
        [(2, 2), (2, 4), (4, 8), (4, 12), (6, 18), (6, 24)]
    ref, group = core_scheduler("cosine", 2, 18, max_lr=1e-2, min_lr=1e-3)
    for r in rows:  # the lr each step's update used, then the step's samples counted
        assert r["lr"] == pytest.approx(group["lr"], rel=1e-12, abs=1e-15)
        ref.step(r["global_batch_size"])
    assert rows[-1]["lr"] == pytest.approx(1e-3)  # past the decay


def _norm_logged(rank, world, tmp, tp):
    cfg = tiny_config(tmp, tp=tp, micro=2, global_batch=4, iters=3, eval_iters=1)
    cfg.logging.log_params_norm = cfg.logging.log_num_zeros_in_grad = True
    cfg.model.add_bias_linear = False  # a key bias's gradient is zero but for rounding: it would count by chance
    phase, forks = ["build"], []
    os.register_at_fork(before=lambda: forks.append(phase[0]))  # this worker process's own forks
    run = trainer.build(cfg, F64)
    phase[0] = "train"
    result = trainer.train(run, trainer.TrainState())
    whole = torch.cat([q.detach().reshape(-1) for c in run.chunks for q in c.parameters()]) if tp == 1 else None
    return result, None if whole is None else float(whole.norm()), forks


def test_params_norm_and_num_zeros_count_each_parameter_once_whatever_the_layout(tmp_path):
    """--log-params-norm and --log-num-zeros-in-grad (Megatron's "params norm", "num zeros"): the same
    norm at TP 2 (a TP-split weight counted in pieces, a replicated norm weight once) as in one
    process, that of every weight after the step; the zeros exactly the padded vocabulary's rows of
    the tied embedding, which get no gradient: 100 → 112 at TP 1 (12 rows × 32), 128 at TP 2 (28).
    The TP 2 run once hung in CI at its first evaluation: the validation loader's workers, forked
    just after the step's collectives, deadlocked (data/loader.py ``start``). Every data-loader
    worker (2 datasets × 2) is forked in ``build`` now, none in the loop; a hang fails at the
    harness's timeout with the stacks."""
    (one, norm, forks_one), = run_distributed(_norm_logged, 1, os.path.join(str(tmp_path), "one"), 1)
    two = run_distributed(_norm_logged, 2, os.path.join(str(tmp_path), "two"), 2)
    rows = {name: _rows(os.path.join(str(tmp_path), name)) for name in ("one", "two")}
    assert len(rows["one"]) == 3 and one["iterations"] == two[0][0]["iterations"] == 3
    assert rows["one"][-1]["params_norm"] == pytest.approx(norm, rel=1e-12)
    assert rows["one"][0]["params_norm"] != rows["one"][-1]["params_norm"]
    assert [r["num_zeros"] for r in rows["one"]] == [12 * 32] * 3
    assert [r["num_zeros"] for r in rows["two"]] == [28 * 32] * 3
    for a, b in zip(rows["one"], rows["two"]):
        assert a["params_norm"] == pytest.approx(b["params_norm"], rel=1e-10)
    assert forks_one == two[0][2] == two[1][2] == ["build"] * 4
