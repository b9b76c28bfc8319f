"""The margin below a GPU's memory that a prediction needs before the planner calls a layout safe.

A layout that fits (``memory.Memory.device_bytes`` ≤ the GPU's memory) is *safe* when its predicted
device bytes are at most ``SAFE_FRACTION`` of the memory. The fraction is 1 / (the largest measured /
predicted peak of every run recorded in bench/results.jsonl, rounded down), checked by
``bench/plan_accuracy.py margin`` against every plan_check, plan_accuracy and scaling row
(bench/RESULTS.md, 2026-12-04, sessions 12 and 15): 68 runs with a stored prediction, worst 1.144
(mixtral-small-s2k-m4 on the eager MoE code that no longer exists, predicted by the MoE terms of
before session 10); the other 67, the MoE runs of the current compiled layer among them, need
1 / 1.027 (llama1b-s4k-m2-v128k). No recorded run of the current code would have run out of memory at a
prediction within it. ``device_bytes`` already holds the CUDA context and the allocator's reserve, so the margin covers
only the peak's own error. (One published rule of this kind: "predicted under 80% never ran out of
memory, over 454 runs".)
"""

from __future__ import annotations

SAFE_FRACTION = 0.97  # 1 / 1.027, rounded down: llama1b-s4k-m2-v128k's measured / predicted peak


def is_safe(device_bytes: float, memory_bytes: float) -> bool:
    """Whether a prediction of ``device_bytes`` is within the safety margin of ``memory_bytes`` (bytes)."""
    return device_bytes <= SAFE_FRACTION * memory_bytes
