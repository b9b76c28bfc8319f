"""bench/gpu_clocks.py: nvidia-smi's clock and power samples parsed and summarised over the busy
moments (the power cap's share from the throttle bits); nothing on a machine without nvidia-smi."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import gpu_clocks  # noqa: E402


def test_busy_samples_give_the_clock_power_and_capped_share():
    lines = ["1980, 120.5, 0x0000000000000000",  # idle: left out
             "1710, 449.1, 0x0000000000000004", "1515, 697.3, 0x0000000000000004",
             "1965, 531.0, 0x0000000000000000", "[N/A], [N/A], [N/A]", "1800, 701.0, 0x0000000000000004"]
    samples = gpu_clocks.parse(lines)
    assert len(samples) == 5 and samples[1] == (1710.0, 449.1, 4)
    assert gpu_clocks.summarize(samples) == {"sm_mhz_median": 1755.0, "sm_mhz_min": 1515.0, "power_w_max": 701.0,
                                             "power_capped_share": 0.75}
    assert gpu_clocks.summarize(samples[:1]) == {}


def test_without_nvidia_smi_the_sampler_says_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.Sampler() as clocks:
        pass
    assert clocks.summary() == {}
