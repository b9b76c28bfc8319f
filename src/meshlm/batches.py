"""The global batch of every step, and how many steps a run of --train-samples samples takes.

Constant batch: every step takes the global batch G = --global-batch-size. With
``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM's batch-size ramp-up,
megatron/core/num_microbatches_calculator.py ``RampupBatchsizeNumMicroBatchesCalculator``) the
gap G − START is crossed in n = (G − START) / INCREMENT increments, one per SAMPLES / n consumed
samples (a float, as in Megatron). The step that starts after c consumed samples takes

    B(c) = G                                               if c > SAMPLES
    B(c) = START + int(c / (SAMPLES / n)) · INCREMENT      otherwise

samples in B(c) / (micro × DP) micro-batches per DP rank; the sampler, the consumed-samples count
and the LR schedule advance by B(c). A run of T = --train-samples samples takes (Megatron's
``update_train_iters``, megatron/training/training.py): floor(T / G) steps at a constant batch;
with a ramp, the steps counted from c = 0 while c ≤ SAMPLES and c ≤ T (each adding B(c)), then
floor((T − c) / G) more when T > c — a partial last batch is dropped.

With ``--step-batch-size-schedule "THRESHOLD:BATCH ..."`` (Megatron-LM's step schedule,
num_microbatches_calculator.py ``StepBatchsizeNumMicroBatchesCalculator``, which replaces the ramp
there) the step that starts after c consumed samples takes the BATCH of the last entry whose
threshold is ≤ c. Thresholds count tokens (Megatron's training passes --seq-length, so each is
floor(tokens / seq) samples), take a K/M/B/T suffix (10^3 … 10^12), must start at 0 and increase
strictly once in samples; the global batch G is the last entry's. A run of T samples takes the
steps from c = 0 while c < T (Megatron's update_train_iters for the schedule: the last step may
pass T); a run of --train-iters N takes N steps whose samples the schedule sums.

Pure Python (no torch): the launcher's validation and --dry-run use it as well as the trainer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_step_schedule(text: str, seq_length: int) -> tuple:
    """--step-batch-size-schedule "THRESHOLD:BATCH ..." (spaces or commas between entries) as
    ((threshold in samples, global batch), ...), thresholds ascending. THRESHOLD counts tokens
    (floor(tokens / seq_length) samples) and, like BATCH, may end in K, M, B or T (module doc).

    Raises ValueError, naming the entry, for an entry without ':', a value that is not a number, a
    first threshold other than 0, thresholds not strictly increasing in samples, a batch below 1 or
    not whole."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError("give at least one THRESHOLD:BATCH entry, e.g. \"0:16 2.4B:320\"")
    steps = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH (tokens:global batch, e.g. 2.4B:320)")
        threshold, batch = (_number(part, entry) for part in entry.split(":", 1))
        if batch != int(batch):
            raise ValueError(f"entry {entry!r}: the global batch must be a whole number of samples")
        threshold, batch = int(threshold), int(batch)
        if batch < 1:
            raise ValueError(f"entry {entry!r}: the global batch must be at least 1")
        if threshold < 0:
            raise ValueError(f"entry {entry!r}: the token threshold must not be negative")
        steps.append((threshold // seq_length, batch, entry))
    steps.sort(key=lambda s: s[0])
    if steps[0][0] != 0:
        raise ValueError(f"the first threshold must be 0 (the batch of the first step), not {steps[0][2]!r}")
    for (before, _, a), (after, _, b) in zip(steps, steps[1:]):
        if after == before:
            raise ValueError(f"entries {a!r} and {b!r} start at the same sample ({before} at --seq-length "
                             f"{seq_length}): make the thresholds at least one sequence apart")
    return tuple((threshold, batch) for threshold, batch, _ in steps)


def _number(text: str, entry: str) -> float:
    """float(digits) × suffix of one side of an entry (Megatron's reading: 2.4B is 2.4e9), finite."""
    value = text.strip().upper()
    scale = SUFFIXES.get(value[-1:], 1)
    try:
        number = float(value[:-1] if scale > 1 else value) * scale
        int(number)  # OverflowError for inf, ValueError for nan
        return number
    except (ValueError, OverflowError):
        raise ValueError(f"entry {entry!r}: {text!r} is not a number (digits with an optional K, M, B or T)") from None


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch per step. global_batch: G, the batch after any ramp or step schedule (samples);
    micro_dp: micro-batch size × DP (samples per micro-batch round over the DP ranks); ramp: (START,
    INCREMENT, SAMPLES) of --rampup-batch-size; steps: ((threshold samples, batch), ...) of
    --step-batch-size-schedule (``parse_step_schedule``); neither: a constant batch.

    The ramp's values must already be valid (``meshlm.validate``): START < G, INCREMENT dividing
    G − START, SAMPLES ≥ 1; otherwise the methods raise ZeroDivisionError like Megatron's.
    """

    global_batch: int
    micro_dp: int
    ramp: Optional[tuple] = None
    steps: Optional[tuple] = None

    @property
    def constant(self) -> bool:
        """Every step takes G."""
        return self.ramp is None and self.steps is None

    def batch_at(self, consumed: int) -> int:
        """B(c): samples in the step that starts after ``consumed`` samples (formula above)."""
        if self.steps is not None:
            return self.steps[bisect.bisect_right(self.steps, (consumed, float("inf"))) - 1][1]
        if self.ramp is None:
            return self.global_batch
        start, increment, samples = self.ramp
        if consumed > samples:
            return self.global_batch
        per_increment = samples / ((self.global_batch - start) // increment)
        return start + int(consumed / per_increment) * increment

    def microbatches_at(self, consumed: int) -> int:
        """Micro-batches each DP rank runs in the step that starts after ``consumed`` samples."""
        return self.batch_at(consumed) // self.micro_dp

    def sizes(self) -> list:
        """Every global batch the schedule can take, smallest first (a ramp's: START, START + INCREMENT, …, G)."""
        if self.steps is not None:
            return sorted({batch for _, batch in self.steps})
        if self.ramp is None:
            return [self.global_batch]
        start, increment, _ = self.ramp
        return list(range(start, self.global_batch + 1, increment))

    def iterations(self, train_samples: int) -> int:
        """Steps of a run of ``train_samples`` samples (Megatron's update_train_iters, above)."""
        if self.steps is not None:  # steps from c = 0 while c < T, a segment of one batch at a time
            steps = consumed = 0
            while consumed < train_samples:
                batch, end = self.batch_at(consumed), min(self._next_threshold(consumed), train_samples)
                taken = -(-(end - consumed) // batch)
                steps, consumed = steps + taken, consumed + taken * batch
            return steps
        if self.ramp is None:
            return train_samples // self.global_batch
        steps, consumed = self._ramp_steps(train_samples)
        if train_samples > consumed:
            steps += (train_samples - consumed) // self.global_batch
        return steps

    def ramp_end(self) -> tuple:
        """(steps, consumed samples) before the first step that takes G: the ramp's steps (a step
        that starts at exactly c = SAMPLES already takes G)."""
        steps = consumed = 0
        while self.batch_at(consumed) < self.global_batch:
            consumed += self.batch_at(consumed)
            steps += 1
        return steps, consumed

    def _ramp_steps(self, limit) -> tuple:
        """(steps, consumed) after stepping from 0 while consumed ≤ SAMPLES and consumed ≤ limit."""
        steps = consumed = 0
        while consumed <= self.ramp[2] and consumed <= limit:
            consumed += self.batch_at(consumed)
            steps += 1
        return steps, consumed

    def consumed_after(self, steps: int, start: int = 0) -> int:
        """Samples consumed after ``steps`` more steps from ``start`` consumed samples (each step
        takes B(c) at the c it starts from)."""
        consumed = start
        if self.ramp is not None:
            while steps and self.batch_at(consumed) != self.global_batch:  # the ramp's steps one by one
                consumed, steps = consumed + self.batch_at(consumed), steps - 1
            return consumed + steps * self.global_batch
        while steps:
            batch, end = self.batch_at(consumed), self._next_threshold(consumed)
            taken = steps if end == float("inf") else min(steps, -(-(end - consumed) // batch))
            consumed, steps = consumed + taken * batch, steps - taken
        return consumed

    def _next_threshold(self, consumed: int) -> float:
        """The first step-schedule threshold above ``consumed`` samples; infinity past the last (or
        for a constant batch)."""
        later = [threshold for threshold, _ in self.steps or () if threshold > consumed]
        return later[0] if later else float("inf")
