"""Host-side agreement across ranks: every rank learns the lowest rank's problem.

A rank that finds a problem (a file it cannot write, a config it cannot load) must not raise alone:
the others would wait in their next collective until the timeout. Each rank passes its problem
(a one-line message, or None) to ``first_problem``; all get the same answer and stop together.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from . import watchdog


def all_problems(problems: list, group=None) -> list:
    """Every rank's ``problems`` (lists of one-line messages) over ``group`` (None: the world),
    concatenated in rank order; the same list on every rank. One watched ``all_gather_object``;
    the identity without torch.distributed or on a group of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(problems)
    gathered: list = [None] * dist.get_world_size(group)
    watchdog.call("all_gather of the ranks' problems", group, dist.all_gather_object, gathered, list(problems),
                  group=group)
    return [p for ranks in gathered for p in ranks]


def first_problem(problem: Optional[str], group=None, watch: bool = True) -> Optional[str]:
    """The lowest rank's problem over ``group`` (None: the world), None if no rank has one.

    One ``all_gather_object`` (so also a barrier: every rank waits for the slowest); the identity
    without torch.distributed or on a group of one. ``watch``: bracketed by the hang watchdog
    (parallel/watchdog.py); pass False from a background thread, since the watchdog follows the
    main thread's collectives.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return problem
    problems: list = [None] * dist.get_world_size(group)
    if watch:
        watchdog.call("all_gather of the ranks' problems", group, dist.all_gather_object, problems, problem,
                      group=group)
    else:
        dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p), None)
