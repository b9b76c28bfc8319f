"""The global batch of every step and the run length (batches.py) against megatron-core's
num-microbatches calculator and Megatron's update_train_iters."""

import pytest

from megatron_ref import core_calculator, core_steps, megatron_train_iters
from meshlm.batches import BatchSchedule
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
