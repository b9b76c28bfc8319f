"""When a rank is a straggler: the thresholds the live watch and ``meshlm analyze`` share.

A rank whose own-work time per iteration exceeds ``FACTOR`` × the median of all ranks, and the
median by at least ``MIN_EXCESS_S`` seconds, for ``CONSECUTIVE`` log intervals in a row is a
straggler (training/stragglers.py prints it live; planner/analyze.py names it from metrics.jsonl).
"""

FACTOR = 1.2
CONSECUTIVE = 3
MIN_EXCESS_S = 0.002
