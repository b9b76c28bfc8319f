"""Activation recomputation with Megatron-LM's meanings (Korthikanti et al. 2022, §5).

- selective (``--recompute-activations`` or ``--recompute-granularity selective``): only core
  attention, softmax(QKᵀ/√d)·V with its dropout, is re-run in backward; its inputs q, k, v are
  kept. On the math/dropout path this drops the s²-sized scores, probabilities and dropout mask
  (the 5as/h term of sbh(34 + 5as/h) bytes a layer); with SDPA flash/cuDNN kernels, which never
  store them, it drops the attention output and its log-sum-exp (2sbh + 4bas bytes a layer in
  bf16) for one more attention forward.
- full (``--recompute-granularity full``) keeps only the input of each checkpointed unit:
  ``uniform`` checkpoints consecutive groups of ``--recompute-num-layers`` layers of each pipeline
  chunk; ``block`` checkpoints each of the first ``--recompute-num-layers`` layers of each chunk
  and none of the rest.

Dropout masks replay identically: keyed streams are functions of their key (parallel/random.py),
and torch.utils.checkpoint restores the default generators for the one-call attention dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Recompute:
    """What to recompute: granularity None/"selective"/"full"; method and num_layers for full."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None

    @classmethod
    def of(cls, training) -> "Recompute":
        """From a TrainingConfig (validated: see meshlm.validate)."""
        if training.recompute_activations:
            return cls("selective")
        return cls(training.recompute_granularity, training.recompute_method, training.recompute_num_layers)

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    def segments(self, n: int) -> list:
        """The chunk's n layers as consecutive (start, end, checkpointed) runs, in order."""
        if self.granularity != "full":
            return [(0, n, False)] if n else []
        if self.method == "uniform":
            k = self.num_layers
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        k = min(self.num_layers, n)
        return [(i, i + 1, True) for i in range(k)] + ([(k, n, False)] if k < n else [])
