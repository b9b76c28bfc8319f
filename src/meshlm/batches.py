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

Pure Python (no torch): the launcher's validation and --dry-run use it as well as the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch per step. global_batch: G, the batch after any ramp (samples); micro_dp:
    micro-batch size × DP (samples per micro-batch round over the DP ranks); ramp: (START,
    INCREMENT, SAMPLES) of --rampup-batch-size, or None for a constant batch.

    The ramp's values must already be valid (``meshlm.validate``): START < G, INCREMENT dividing
    G − START, SAMPLES ≥ 1; otherwise the methods raise ZeroDivisionError like Megatron's.
    """

    global_batch: int
    micro_dp: int
    ramp: Optional[tuple] = None

    def batch_at(self, consumed: int) -> int:
        """B(c): samples in the step that starts after ``consumed`` samples (formula above)."""
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
        """Every global batch the schedule can take, smallest first: START, START + INCREMENT, …, G."""
        if self.ramp is None:
            return [self.global_batch]
        start, increment, _ = self.ramp
        return list(range(start, self.global_batch + 1, increment))

    def iterations(self, train_samples: int) -> int:
        """Steps of a run of ``train_samples`` samples (Megatron's update_train_iters, above)."""
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
