"""The deferred optimizer step (trainer.launch_step / finish_step, optimizer ``step(defer=True)``):
the loop launches each step without reading its grad norm and finishes it at the next step's start.
It must train exactly as the synchronous step does (float64, with and without clipping), be what
the loop runs where allowed, and lose nothing when a step turns out NaN."""

import os

import pytest
import torch

from distributed import run_distributed
from inject_faults import inject
from meshlm.errors import TrainingError
from meshlm.optim.optimizer import DeferredStep
from meshlm.training import trainer
from test_trainer import tiny_config


def _losses_and_order(rank, world, tmp, clip, skip):
    """pretrain's losses and grad norms in float64 (--skip-nan-steps forces the synchronous step), and
    the order of launches (L), deferred results' reads (R) and optimizer calls' defer flags."""
    events, launch, resolve = [], trainer.launch_step, DeferredStep.resolve

    def launch_step(run, state):
        step = run.opt.step
        run.opt.step = lambda *a, **k: (events.append(("defer", k.get("defer"))), step(*a, **k))[1]
        out = launch(run, state)
        run.opt.step = step
        events.append(("L", state.iteration))
        return out

    def read(self):
        events.append(("R",))
        return resolve(self)
    trainer.launch_step, DeferredStep.resolve = launch_step, read
    try:
        cfg = tiny_config(tmp, iters=4, skip_nan_steps=skip)
        cfg.optimizer.clip_grad = clip
        summary = trainer.pretrain(cfg, dtype=torch.float64)
    finally:
        trainer.launch_step, DeferredStep.resolve = launch, resolve
    return summary["train_losses"], summary["val_losses"], events


def _both(rank, world, tmp, clip):
    return [_losses_and_order(rank, world, os.path.join(tmp, k), clip, skip) for k, skip in (("d", False), ("s", True))]


@pytest.mark.parametrize("clip", [1.0, 1e-3])  # 1e-3: every step clipped
def test_deferred_steps_train_exactly_as_synchronous_ones_and_are_read_after_their_launch(tmp_path, clip):
    deferred, synced = run_distributed(_both, 1, str(tmp_path), clip)[0]
    assert deferred[0] == synced[0] and deferred[1] == synced[1]  # bitwise, in float64
    assert len(set(deferred[0])) == 4  # the weights moved: four different losses
    events = deferred[2]
    assert [e for e in events if e[0] == "defer"] == [("defer", True)] * 4
    assert [e for e in synced[2] if e[0] == "defer"] == [("defer", False)] * 4
    # each step's norm is read after its launch returned, once, before the next launch
    assert [e for e in events if e[0] != "defer"] == [("L", 1), ("R",), ("L", 2), ("R",), ("L", 3), ("R",),
                                                      ("L", 4), ("R",)]


def _nan_with_saves(rank, world, tmp):
    inject("nan:0:3")
    cfg = tiny_config(tmp, iters=5)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = os.path.join(tmp, "ckpt"), 1
    try:
        trainer.pretrain(cfg, dtype=torch.float64)
    except TrainingError as e:
        return str(e), sorted(os.listdir(cfg.checkpoint.save))
    return None, None


def test_a_nan_step_deferred_stops_at_its_iteration_before_anything_is_saved_after_it(tmp_path):
    error, saved = run_distributed(_nan_with_saves, 1, str(tmp_path))[0]
    assert error is not None and error.startswith("iteration 3: lm loss is nan"), error
    assert "last good checkpoint: " in error and "iter_0000002" in error, error
    assert not any(name.startswith("iter_0000003") for name in saved), saved
