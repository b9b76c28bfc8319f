"""--manual-gc: the collector is off during training steps, runs at the chosen iterations and
around evaluations, and is restored when the loop ends (however it ends)."""

import gc

import pytest

from distributed import run_distributed
from meshlm.errors import ConfigError
from meshlm.training import manual_gc, trainer
from meshlm.validate import validate
from test_trainer import tiny_config


def _watched_run(rank, world, tmp, manual):
    seen, collected = [], []
    real_step, real_collect = trainer.launch_step, gc.collect

    def step(run, state):
        seen.append(gc.isenabled())
        return real_step(run, state)

    def collect(*a):
        collected.append(len(seen))  # the steps taken when it ran
        return real_collect(*a)

    trainer.launch_step, manual_gc.gc.collect = step, collect
    try:
        cfg = tiny_config(tmp, iters=4, manual_gc=manual, manual_gc_interval=2)
        cfg.training.eval_interval = 3
        trainer.pretrain(cfg)
    finally:
        trainer.launch_step, manual_gc.gc.collect = real_step, real_collect
    return seen, collected, gc.isenabled(), gc.get_freeze_count()


def test_manual_gc_collects_at_the_interval_and_around_evaluations_only(tmp_path):
    seen, collected, enabled_after, frozen_after = run_distributed(_watched_run, 1, str(tmp_path), True)[0]
    assert seen == [False] * 4
    # start; after steps 2 and 4; around the evaluations after step 3 and the last one after step 4
    assert collected == [0, 2, 3, 3, 4, 4, 4]
    assert enabled_after and frozen_after == 0


def test_without_manual_gc_the_collector_runs_as_python_sets_it(tmp_path):
    seen, collected, enabled_after, _ = run_distributed(_watched_run, 1, str(tmp_path), False)[0]
    assert seen == [True] * 4 and collected == [] and enabled_after


def test_the_collector_is_restored_when_the_loop_raises():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with manual_gc.ManualGC(True, 0, True).running():
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            raise RuntimeError("a failed step")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_negative_interval_is_refused_naming_the_flag(tmp_path):
    cfg = tiny_config(str(tmp_path), manual_gc=True, manual_gc_interval=-1)
    with pytest.raises(ConfigError, match="--manual-gc-interval -1"):
        validate(cfg, world=1, check_files=False)
