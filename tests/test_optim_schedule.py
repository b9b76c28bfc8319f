"""LR schedule: warm-up from 0, then constant/linear/cosine decay to min_lr (optim/schedule.py)."""

import math
import types
import warnings

import pytest

from megatron_ref import core_scheduler, core_steps
from meshlm.config import Config, OptimizerConfig, batch_schedule
from meshlm.optim.schedule import LRScheduler, scheduler_for


def sched(style, warmup=10, decay=None, train_iters=110, lr=1e-3, min_lr=1e-4):
    cfg = OptimizerConfig(lr=lr, min_lr=min_lr, lr_decay_style=style, lr_warmup_iters=warmup,
                          lr_decay_iters=decay)
    return LRScheduler(cfg, train_iters)


def test_warmup_rises_linearly_from_zero_to_peak():
    s = sched("cosine")
    assert s.lr_at(0) == 0.0
    assert s.lr_at(5) == pytest.approx(0.5e-3)
    assert s.lr_at(10) == pytest.approx(1e-3)


@pytest.mark.parametrize("style,mid", [("linear", 0.55e-3), ("cosine", 0.55e-3), ("constant", 1e-3)])
def test_decay_midpoint_and_end(style, mid):
    s = sched(style)  # decay over iterations 10..110, midpoint 60
    assert s.lr_at(60) == pytest.approx(mid)
    end = 1e-3 if style == "constant" else 1e-4
    assert s.lr_at(110) == pytest.approx(end)
    assert s.lr_at(500) == pytest.approx(end)


def test_cosine_quarter_point():
    s = sched("cosine")
    want = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert s.lr_at(35) == pytest.approx(want)


def test_lr_decay_iters_overrides_train_iters():
    assert sched("linear", decay=20).lr_at(20) == pytest.approx(1e-4)


def test_step_sets_the_next_lr_on_the_optimizer_and_state_round_trips():
    seen = []
    opt = types.SimpleNamespace(set_lr=lambda lr, decoupled_lr=None: seen.append(lr))
    s = sched("cosine")
    for _ in range(15):
        s.step(opt)
    assert seen[-1] == s.lr == s.lr_at(15)
    t = sched("cosine")
    t.load_state_dict(s.state_dict())
    assert t.lr == s.lr


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_matches_megatron_core_scheduler(style):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    group = {}
    opt = types.SimpleNamespace(param_groups=[group])
    ref = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=10,
                                  lr_decay_steps=110, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                                  wd_incr_steps=110, wd_incr_style="constant")
    ours = sched(style)
    for _ in range(130):
        assert ours.lr == pytest.approx(group["lr"], rel=1e-12, abs=1e-15)
        ref.step(1)
        ours.step()


STYLES = [("inverse-square-root", 10, None, None), ("inverse-square-root", 0, None, None),
          ("cosine", 0, 0.07, None), ("linear", 0, 0.0, None),
          ("WSD", 10, None, "exponential"), ("WSD", 0, 0.1, "linear"), ("WSD", 10, None, "cosine"),
          ("WSD", 10, None, "minus_sqrt")]


@pytest.mark.parametrize("style,warmup,fraction,wsd_style", STYLES)
def test_new_styles_and_warmup_fraction_match_megatron_core(style, warmup, fraction, wsd_style):
    """Megatron's training.py: steps are samples (B per iteration), warm-up = fraction · decay
    samples when --lr-warmup-fraction is given, WSD anneal = --lr-wsd-decay-iters · B."""
    batch, train_iters, wsd_iters = 8, 110, 30
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style=style, lr_warmup_iters=warmup,
                          lr_warmup_fraction=fraction, lr_wsd_decay_style=wsd_style or "exponential",
                          lr_wsd_decay_iters=wsd_iters if style == "WSD" else None)
    ours = LRScheduler(cfg, train_iters, batch)
    decay = train_iters * batch
    kw = dict(wsd_decay_steps=wsd_iters * batch, lr_wsd_decay_style=wsd_style) if style == "WSD" else {}
    ref, group = core_scheduler(style, fraction * decay if fraction is not None else warmup * batch, decay, **kw)
    for _ in range(130):
        assert ours.lr == pytest.approx(group["lr"], rel=1e-12, abs=1e-15)
        ref.step(batch)
        ours.step()


def _sample_config(style, warmup=0, fraction=None, wsd_style=None, decay=None, anneal=None, *, samples=900,
                   batch=8, micro=8, ramp=None) -> Config:
    cfg = Config()
    t, o = cfg.training, cfg.optimizer
    t.train_samples, t.global_batch_size, t.micro_batch_size, t.rampup_batch_size = samples, batch, micro, ramp
    o.lr, o.min_lr, o.lr_decay_style, o.lr_warmup_samples, o.lr_warmup_fraction = 1e-3, 1e-5, style, warmup, fraction
    o.lr_decay_samples, o.lr_wsd_decay_samples, o.lr_wsd_decay_style = decay, anneal, wsd_style or "exponential"
    return cfg


@pytest.mark.parametrize("decay", [None, 700])
@pytest.mark.parametrize("style,warmup,fraction,wsd_style", STYLES + [("cosine", 60, None, None),
                                                                      ("linear", 17, None, None)])
def test_sample_based_schedule_matches_megatron_core(style, warmup, fraction, wsd_style, decay):
    """--train-samples T (Megatron's training.py, sample-based branch): the steps are the sample
    counts as given, decay = --lr-decay-samples or T, warm-up = --lr-warmup-samples or
    --lr-warmup-fraction × decay, WSD anneal = --lr-wsd-decay-samples; each step adds B samples."""
    samples, batch, anneal = 900, 8, 240
    cfg = _sample_config(style, warmup * 3, fraction, wsd_style, decay, anneal if style == "WSD" else None,
                         samples=samples, batch=batch)
    ours = scheduler_for(cfg, 1)
    steps = decay or samples
    kw = dict(wsd_decay_steps=anneal, lr_wsd_decay_style=wsd_style) if style == "WSD" else {}
    ref, group = core_scheduler(style, fraction * steps if fraction is not None else warmup * 3, steps, **kw)
    for _ in range(130):
        assert ours.lr == pytest.approx(group["lr"], rel=1e-12, abs=1e-15)
        ref.step(batch)
        ours.step(samples=batch)


@pytest.mark.parametrize("style", ["cosine", "WSD", "inverse-square-root"])
def test_lr_under_a_batch_ramp_matches_megatron_core(style):
    """--rampup-batch-size 8 8 600 to 64 over micro 2 × DP 2: each step advances the schedule by its
    own batch, as megatron-core's scheduler stepped by Megatron's training loop."""
    cfg = _sample_config(style, 100, anneal=500 if style == "WSD" else None, samples=3000, batch=64, micro=2,
                         ramp=[8, 8, 600])
    ours, batches = scheduler_for(cfg, 2), batch_schedule(cfg, 2)
    kw = dict(wsd_decay_steps=500, lr_wsd_decay_style="exponential") if style == "WSD" else {}
    ref = core_scheduler(style, 100, 3000, **kw)
    walked = core_steps(60, 64, 2, 2, (8, 8, 600), ref)
    assert len({batch for batch, *_ in walked}) > 4  # the batch did grow
    for batch, _, consumed, lr in walked:
        assert ours.lr == pytest.approx(lr, rel=1e-12, abs=1e-15), consumed
        ours.step(samples=batches.batch_at(consumed))


def test_a_checkpoint_from_before_the_sample_count_resumes_at_its_samples():
    s = LRScheduler(OptimizerConfig(lr_decay_style="cosine", lr_warmup_iters=2), 110, 8)
    s.load_state_dict({"num_steps": 5})  # 5 iterations of 8 samples
    assert s.lr == s.lr_at(40)
    t = LRScheduler(OptimizerConfig(lr_decay_style="cosine", lr_warmup_iters=2), 110, 8)
    t.load_state_dict(s.state_dict())
    assert t.lr == s.lr and s.lr != s.lr_at(5)


def test_a_resume_with_another_schedule_is_refused_unless_a_megatron_switch_says_whose():
    """A run saved at --train-iters 110 and resumed at 210 (the decay length follows it) jumped to
    another cosine silently; Megatron's OptimizerParamScheduler asserts instead, and so does meshlm,
    naming the setting and the two switches (--override-/--use-checkpoint-opt_param-scheduler)."""
    import json

    from meshlm.errors import CheckpointError
    saved = sched("cosine")
    saved.step(samples=50)
    sd = json.loads(json.dumps(saved.state_dict()))  # as rank_XXXXX.json holds it
    sched("cosine").load_state_dict(sd)  # the same flags: no complaint
    longer = sched("cosine", train_iters=210, lr=2e-3)
    with pytest.raises(CheckpointError, match=r"--load ck: .*--lr saved=0.001 now=0.002; decay samples .*"
                                              r"saved=110 now=210; pass --override-opt_param-scheduler"):
        longer.load_state_dict(sd, where="ck")
    longer.load_state_dict(sd, "override")
    assert longer.samples == 50 and longer.lr == sched("cosine", train_iters=210, lr=2e-3).lr_at(50)
    longer.load_state_dict(sd, "checkpoint")
    assert longer.samples == 50 and longer.lr == saved.lr and longer.lr_at(150) == pytest.approx(1e-4)
    old = {"num_samples": 50}  # a checkpoint from before the settings were saved: not compared
    longer.load_state_dict(old)


def test_the_two_scheduler_switches_parse_in_both_spellings_and_exclude_each_other(capsys):
    from meshlm.cli import build_parser, main
    from meshlm.config import config_from_args
    for flag in ("--override-opt-param-scheduler", "--override-opt_param-scheduler"):
        args = build_parser("pretrain").parse_args(["pretrain", flag])
        assert config_from_args(args).checkpoint.override_opt_param_scheduler
    assert main(["pretrain", "--mock-data", "--vocab-size", "64", "--train-iters", "2", "--dry-run",
                 "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]) == 2
    assert "are exclusive" in capsys.readouterr().err
