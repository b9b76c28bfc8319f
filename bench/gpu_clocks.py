"""The GPU's SM clock and power while a benchmark runs, sampled by nvidia-smi (issues 29, 31).

An H200 at its 700 W cap runs its SMs at 1,515–1,800 MHz instead of 1,980 (throttle reason 0x4, SW
power cap; bench/RESULTS.md session 15), so the same code's step time depends on how hot and how
power-bound a run is. ``Sampler`` records it beside a benchmark's figures:

    with Sampler() as clocks:
        ...  # the measured work
    row.update(clocks.summary())

``summary()``: {"sm_mhz_median", "sm_mhz_min", "power_w_max", "power_capped_share"} over the samples
where the GPU drew more than ``BUSY_W`` (idle moments left out), or {} where nvidia-smi is absent or
gave none (a CPU machine).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
BUSY_W = 200.0  # watts: samples below this are an idle GPU (between processes, compiling)
POWER_CAP = 0x4  # nvidia-smi's throttle-reason bit: SW power cap


def parse(lines: list) -> list:
    """[(SM MHz, watts, throttle bits)] of nvidia-smi ``--format=csv,noheader,nounits`` lines of
    ``QUERY`` (lines that do not parse, such as "[N/A]" readings, skipped)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            out.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except (IndexError, ValueError):
            continue
    return out


def summarize(samples: list) -> dict:
    """The module doc's summary of ``parse``'s samples."""
    busy = [s for s in samples if s[1] > BUSY_W]
    if not busy:
        return {}
    return {"sm_mhz_median": statistics.median(s[0] for s in busy), "sm_mhz_min": min(s[0] for s in busy),
            "power_w_max": max(s[1] for s in busy),
            "power_capped_share": round(sum(bool(s[2] & POWER_CAP) for s in busy) / len(busy), 3)}


class Sampler:
    """nvidia-smi sampling every ``period_ms`` from enter to exit, on GPU ``index``."""

    def __init__(self, period_ms: int = 250, index: int = 0):
        self.period_ms, self.index, self.proc, self.file = period_ms, index, None, None

    def __enter__(self) -> "Sampler":
        if shutil.which("nvidia-smi"):
            self.file = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen(["nvidia-smi", f"--id={self.index}", f"--query-gpu={QUERY}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                         stdout=self.file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def summary(self) -> dict:
        if self.file is None:
            return {}
        self.file.seek(0)
        return summarize(parse(self.file.readlines()))
