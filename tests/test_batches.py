"""The global batch of every step and the run length (batches.py) against megatron-core's
num-microbatches calculator and Megatron's update_train_iters."""

import pytest

from megatron_ref import core_calculator, core_steps, megatron_train_iters
from meshlm.batches import BatchSchedule, parse_step_schedule
from meshlm.config import Config, batch_schedule, run_iterations, run_samples

# (final global batch, micro, DP, (START, INCREMENT, SAMPLES)): increments of several steps each,
# increments shorter than a step (some batch sizes skipped), a fractional SAMPLES / increments,
# Megatron's GPT-3 ramp at a tenth of its length
RAMPS = [(64, 2, 2, (8, 8, 1000)), (96, 4, 2, (8, 8, 50)), (40, 1, 1, (10, 10, 7)), (12, 1, 2, (2, 2, 12)),
         (1536, 1, 8, (16, 16, 585937))]


@pytest.mark.parametrize("final, micro, dp, ramp", RAMPS)
def test_each_steps_batch_and_micro_batches_match_megatron_core(final, micro, dp, ramp):
    ours = BatchSchedule(final, micro * dp, ramp)
    steps = ramp[2] // ramp[0] + 5  # past the ramp's end
    for batch, microbatches, consumed, _ in core_steps(steps, final, micro, dp, ramp):
        assert (ours.batch_at(consumed), ours.microbatches_at(consumed)) == (batch, microbatches), consumed


@pytest.mark.parametrize("final, micro, dp, ramp", RAMPS)
def test_batch_at_any_consumed_count_matches_megatron_core(final, micro, dp, ramp):
    """Off the run's path too: every count up to past the ramp (the float boundaries included)."""
    ours, core = BatchSchedule(final, micro * dp, ramp), core_calculator(final, micro, dp, ramp)
    for consumed in range(0, ramp[2] + 2 * final, max(1, ramp[2] // 3000)):
        core.update(consumed, consistency_check=True)
        assert ours.batch_at(consumed) == core.get_current_global_batch_size(), consumed


@pytest.mark.parametrize("final, micro, dp, ramp", RAMPS + [(64, 2, 2, None)])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.999, 1.0, 1.7, 40.0])
def test_run_length_in_samples_matches_megatrons_update_train_iters(final, micro, dp, ramp, fraction):
    """fraction: --train-samples as a share of the ramp's samples (a run ending inside the ramp,
    at its end, long after it); 0 is one sample."""
    samples = max(1, int(fraction * (ramp[2] if ramp else 1000)))
    assert BatchSchedule(final, micro * dp, ramp).iterations(samples) == \
        megatron_train_iters(samples, final, micro, dp, ramp)


def test_a_ramp_walked_by_hand():
    """G 64, micro × DP 4, ramp 8 → 64 by 8 over 100 samples: 7 increments, one per 100/7 ≈ 14.3
    samples. Steps start at 0, 8, 16, 32, 56, 88 consumed samples with batches 8, 8, 16, 24, 32, 56
    (int(c / 14.29) = 0, 0, 1, 2, 3, 6; 40 and 48 are skipped), reaching 144 > 100: 6 ramp steps,
    then (1000 − 144) // 64 = 13 at 64."""
    s = BatchSchedule(64, 4, (8, 8, 100))
    assert [s.batch_at(c) for c in (0, 8, 16, 32, 56, 88, 144)] == [8, 8, 16, 24, 32, 56, 64]
    assert s.ramp_end() == (6, 144) and s.iterations(1000) == 19
    assert s.sizes() == [8, 16, 24, 32, 40, 48, 56, 64]


def test_the_ramp_ends_at_the_first_step_of_the_full_batch():
    """G 16, ramp 8 → 16 over 8 samples: the step at c = 0 takes 8, the one at c = 8 = SAMPLES
    int(8 / 8) = 1 increment, i.e. 16 already (the dry-run said "from iteration 3")."""
    s = BatchSchedule(16, 4, (8, 8, 8))
    assert [s.batch_at(c) for c in (0, 8)] == [8, 16]
    assert s.ramp_end() == (1, 8) and s.iterations(40) == 1 + 1 + (40 - 24) // 16


def test_config_derives_the_schedule_and_the_run_length():
    cfg = Config()
    t = cfg.training
    t.micro_batch_size, t.global_batch_size = 2, 64
    assert run_iterations(cfg, 2) == 100 and run_samples(cfg, 2) == 6400  # meshlm's default length
    t.train_iters = 7
    assert run_iterations(cfg, 2) == 7 and run_samples(cfg, 2) == 448
    t.train_iters, t.train_samples, t.rampup_batch_size = None, 1000, [8, 8, 100]
    assert batch_schedule(cfg, 2) == BatchSchedule(64, 4, (8, 8, 100))
    assert run_iterations(cfg, 2) == 19 and run_samples(cfg, 2) == 1000


@pytest.mark.parametrize("train_samples, ramp", [(60, [2, 2, 1000]), (41, [2, 2, 40])])
def test_the_data_holds_a_ramps_last_step_that_passes_train_samples(train_samples, ramp):
    # the ramp's step that starts at c <= --train-samples (Megatron's update_train_iters) reads past
    # it: the training split was sized to --train-samples and that step stopped with StopIteration
    cfg = Config()
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.train_samples, t.rampup_batch_size = 2, 8, train_samples, ramp
    steps = run_iterations(cfg, 1)
    assert steps == megatron_train_iters(train_samples, 8, 2, 1, ramp)
    taken = batch_schedule(cfg, 1).consumed_after(steps)
    assert taken > train_samples and run_samples(cfg, 1) == taken


def _problems(world=4, **fields):
    """validate's problems for a small config with ``fields`` set (by section-free name)."""
    from meshlm.config import apply_mapping
    from meshlm.errors import ConfigError
    from meshlm.validate import validate
    cfg = Config()
    apply_mapping(cfg, dict(dict(micro_batch_size=2, global_batch_size=64, mock_data=True, vocab_size=100),
                            **fields), source="test")
    try:
        validate(cfg, world, check_files=False)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("fields, problem", [
    (dict(train_iters=10, train_samples=100), "--train-iters 10 and --train-samples 100 are exclusive"),
    (dict(train_samples=1000, lr_warmup_iters=3), "--lr-warmup-iters 3 counts iterations, but --train-samples"),
    (dict(train_samples=1000, lr_decay_iters=5), "--lr-decay-iters 5 counts iterations"),
    (dict(train_samples=1000, lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_samples=10),
     "--lr-wsd-decay-iters 4 counts iterations"),
    (dict(lr_warmup_samples=3), "--lr-warmup-samples 3 needs --train-samples"),
    (dict(train_iters=9, lr_decay_samples=9), "--lr-decay-samples 9 needs --train-samples"),
    (dict(rampup_batch_size=[8, 8, 100]), "--rampup-batch-size needs --train-samples"),
    (dict(train_samples=1000, lr_warmup_fraction=0.1, lr_warmup_samples=5),
     "--lr-warmup-fraction 0.1 and --lr-warmup-samples 5 are exclusive"),
    (dict(train_samples=1000, lr_warmup_samples=5000), "--lr-warmup-samples 5000 exceeds the decay samples 1000"),
    (dict(train_samples=1000, lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-samples N"),
    (dict(train_samples=1000, lr_decay_style="WSD", lr_wsd_decay_samples=2000),
     "--lr-wsd-decay-samples 2000 exceeds the decay samples 1000"),
    (dict(train_samples=10), "--train-samples 10 is less than one global batch (64)"),
    (dict(train_samples=1000, rampup_batch_size=[6, 8, 100]),
     "--rampup-batch-size: START 6 is not divisible by --micro-batch-size 2 × DP 4 = 8; nearest valid START: 8"),
    (dict(train_samples=1000, rampup_batch_size=[8, 12, 100], global_batch_size=80),
     "--rampup-batch-size: INCREMENT 12 is not divisible"),
    (dict(train_samples=1000, rampup_batch_size=[16, 16, 100], global_batch_size=56),
     "--rampup-batch-size: INCREMENT 16 does not divide the ramp from START 16 to the global batch 56"),
    (dict(train_samples=1000, rampup_batch_size=[64, 8, 100]), "--rampup-batch-size: START 64 must be below"),
    (dict(train_samples=1000, rampup_batch_size=[8, 8, 0]), "--rampup-batch-size 8 8 0: give three positive"),
    (dict(train_samples=1000, rampup_batch_size=[8, 8]), "--rampup-batch-size 8 8: give three positive"),
    (dict(train_samples=1000, rampup_batch_size=[4, 4, 100], pipeline_model_parallel_size=2,
          virtual_pipeline_model_parallel_size=2, micro_batch_size=2),
     "--rampup-batch-size: the ramp's global batch 4 is 1 micro-batches, but interleaved 1F1B needs a multiple"),
])
def test_bad_length_schedule_and_ramp_flags_are_one_line_each_naming_the_flag(fields, problem):
    """A START that is no multiple of micro × DP also leaves the final batch out of step with the
    INCREMENTs (both reported); every other mistake is the one problem."""
    found = _problems(**fields)
    assert any(p.startswith(problem) for p in found) and all("\n" not in p for p in found), found
    assert len(found) == (2 if "START 6 " in problem else 1), found


def test_a_valid_run_in_samples_with_a_ramp_passes_and_yaml_spells_the_ramp_either_way():
    assert _problems(train_samples=1000, rampup_batch_size="8 8 100", lr_warmup_samples=50,
                     lr_decay_samples=900, lr_decay_style="WSD", lr_wsd_decay_samples=200) == []
    assert _problems(train_samples=1000, rampup_batch_size=[8, 8, 100], lr_warmup_fraction=0.01) == []
    from meshlm.config import apply_mapping
    from meshlm.errors import ConfigError
    with pytest.raises(ConfigError, match="rampup-batch-size='8 x 100' is not integers"):
        apply_mapping(Config(), {"rampup_batch_size": "8 x 100"}, source="c.yaml")


# --step-batch-size-schedule: Megatron's StepBatchsizeNumMicroBatchesCalculator (not in megatron-core
# 0.16.1, the tests' pin), walked one step at a time as its docstrings and update_train_iters state it.
def _reference_batch(steps, consumed):
    """The batch of the last entry whose threshold is at or below ``consumed``."""
    return [batch for threshold, batch in steps if threshold <= consumed][-1]


def _reference_walk(steps, n, start=0):
    consumed = start
    for _ in range(n):
        consumed += _reference_batch(steps, consumed)
    return consumed


def _reference_iterations(steps, train_samples):
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += _reference_batch(steps, consumed)
        iterations += 1
    return iterations


STEP_SCHEDULES = [((0, 16), (100, 32), (250, 64)),  # growing, thresholds inside steps
                  ((0, 8), (9, 16), (10, 24), (11, 48)),  # entries a step passes over
                  ((0, 64), (200, 32), (300, 96)),  # a smaller batch in the middle
                  ((0, 8),)]


@pytest.mark.parametrize("steps", STEP_SCHEDULES)
def test_step_schedule_batches_run_length_and_consumed_samples_follow_the_step_by_step_walk(steps):
    ours = BatchSchedule(steps[-1][1], 8, steps=steps)
    assert [ours.batch_at(c) for c in range(600)] == [_reference_batch(steps, c) for c in range(600)]
    for samples in (1, 8, 9, 99, 100, 101, 255, 256, 1000):
        assert ours.iterations(samples) == _reference_iterations(steps, samples), samples
    for start in (0, 5, 100, 260):
        assert [ours.consumed_after(n, start) for n in range(40)] == \
            [_reference_walk(steps, n, start) for n in range(40)], start
    assert ours.sizes() == sorted({b for _, b in steps}) and ours.constant is False


def test_consumed_after_walks_a_ramp_and_a_constant_batch():
    ramp = BatchSchedule(64, 4, (8, 8, 100))  # test_a_ramp_walked_by_hand's steps: 8, 8, 16, 24, 32, 56, then 64
    assert [ramp.consumed_after(n) for n in range(8)] == [0, 8, 16, 32, 56, 88, 144, 208]
    assert ramp.consumed_after(2, 16) == 16 + 16 + 24
    assert BatchSchedule(64, 4).consumed_after(3, 10) == 202 and BatchSchedule(64, 4).constant


def test_a_step_schedule_reads_tokens_with_suffixes_as_megatron_does():
    """Thresholds in tokens, floor-divided by the sequence: 2.4B tokens at 2,048 are 1,171,875
    samples; K/M/B/T suffixes on either side, commas or spaces between entries, any order."""
    assert parse_step_schedule("0:16 2.4B:320 4.8B:624", 2048) == ((0, 16), (1171875, 320), (2343750, 624))
    assert parse_step_schedule("5k:2K,0:1k", 1000) == ((0, 1000), (5, 2000))
    assert parse_step_schedule(" 0:4   1.5M:8 ", 3) == ((0, 4), (500000, 8))


@pytest.mark.parametrize("text, problem", [
    ("", "give at least one THRESHOLD:BATCH entry"),
    ("0:16 100", "entry '100' is not THRESHOLD:BATCH"),
    ("0:16 1x:32", "entry '1x:32': '1x' is not a number"),
    ("16:16 100:32", "the first threshold must be 0 (the batch of the first step), not '16:16'"),
    ("0:16 5:32", "entries '0:16' and '5:32' start at the same sample (0 at --seq-length 16)"),
    ("0:0", "entry '0:0': the global batch must be at least 1"),
    ("0:8 -32:16", "entry '-32:16': the token threshold must not be negative"),
    ("0:2.5", "entry '0:2.5': the global batch must be a whole number"),
    ("0:8 inf:16", "entry 'inf:16': 'inf' is not a number"),
    ("0:nan", "entry '0:nan': 'nan' is not a number"),
])
def test_a_bad_step_schedule_is_one_value_error_naming_the_entry(text, problem):
    with pytest.raises(ValueError) as e:
        parse_step_schedule(text, 16)
    assert str(e.value).startswith(problem), str(e.value)


@pytest.mark.parametrize("fields, problem", [
    (dict(step_batch_size_schedule="0:8 1k"), "--step-batch-size-schedule '0:8 1k': entry '1k' is not"),
    (dict(step_batch_size_schedule="0:8 1k:16", rampup_batch_size=[8, 8, 100], train_samples=1000,
          global_batch_size=None),
     "--step-batch-size-schedule and --rampup-batch-size are exclusive"),
    (dict(step_batch_size_schedule="0:8 1k:64", gradient_accumulation_steps=8, global_batch_size=None),
     "--step-batch-size-schedule and --gradient-accumulation-steps are exclusive"),
    (dict(step_batch_size_schedule="0:8 1k:32"),
     "--global-batch-size 64 disagrees with the last --step-batch-size-schedule entry's batch 32"),
    (dict(step_batch_size_schedule="0:12 1k:20 2k:64"),
     "--step-batch-size-schedule: the batch 12 from sample 0 is not divisible by --micro-batch-size 2 × DP 4 = 8; "
     "nearest valid: 8 or 16 (2 entries are not)"),
    (dict(step_batch_size_schedule="0:4 1k:64", pipeline_model_parallel_size=2, micro_batch_size=2,
          virtual_pipeline_model_parallel_size=2),
     "--step-batch-size-schedule: the schedule's global batch 4 is 1 micro-batches, but interleaved 1F1B needs"),
    (dict(step_batch_size_schedule="0:8 1k:12", global_batch_size=None, pipeline_model_parallel_size=2,
          micro_batch_size=2, virtual_pipeline_model_parallel_size=2),  # the last entry's: named once, by its flag
     "--step-batch-size-schedule: the schedule's global batch 12 is 3 micro-batches, but interleaved 1F1B needs"),
])
def test_bad_step_schedule_flags_are_one_line_each_naming_the_flag(fields, problem):
    found = _problems(**fields)
    assert any(p.startswith(problem) for p in found) and all("\n" not in p for p in found), found
    assert len(found) == 1, found


def test_a_step_schedule_with_an_agreeing_global_batch_or_none_passes_and_sets_the_run():
    assert _problems(step_batch_size_schedule="0:8 256:16 2k:64", train_iters=10) == []
    assert _problems(step_batch_size_schedule="0:8 256:16 2k:64", global_batch_size=None, train_samples=100) == []
    cfg = Config()
    t = cfg.training
    t.micro_batch_size, t.train_iters, t.step_batch_size_schedule = 2, 5, "0:8 512:16"  # 8 from 0, 16 from 16
    cfg.model.seq_length = 32
    assert batch_schedule(cfg, 4) == BatchSchedule(16, 8, None, ((0, 8), (16, 16)))
    assert run_samples(cfg, 4) == 8 + 8 + 16 + 16 + 16
