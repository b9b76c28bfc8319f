"""The margin below a GPU's memory that a prediction needs before the planner calls a layout safe.

A layout that fits (``memory.Memory.device_bytes`` ≤ the GPU's memory) is *safe* when its predicted
device bytes are at most ``SAFE_FRACTION`` of the memory. The fraction is 1 / (the largest measured /
predicted peak of every run recorded in bench/results.jsonl, rounded down), checked by
``bench/plan_accuracy.py margin`` against every plan_check, plan_accuracy and scaling row
(bench/RESULTS.md, 2026-12-03, session 10): 27 runs with a stored prediction, worst 1.144
(mixtral-small on the eager MoE code, predicted by the MoE terms before session 10, which missed the
stacked expert weights the grouped GEMM keeps); the 26 dense runs need only 1 / 1.027. It stays
until the corrected MoE terms' predictions have run. No recorded run would have run out of memory at a
prediction within it. ``device_bytes`` already holds the CUDA context and the allocator's reserve, so the margin covers
only the peak's own error. (One published rule of this kind: "predicted under 80% never ran out of
memory, over 454 runs".)
"""

from __future__ import annotations

SAFE_FRACTION = 0.87  # 1 / 1.144: mixtral-small's measured / predicted peak (dense runs: ≤ 1.027)


def is_safe(device_bytes: float, memory_bytes: float) -> bool:
    """Whether a prediction of ``device_bytes`` is within the safety margin of ``memory_bytes`` (bytes)."""
    return device_bytes <= SAFE_FRACTION * memory_bytes
