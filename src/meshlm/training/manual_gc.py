"""Megatron's ``--manual-gc``: Python's garbage collector run at chosen iterations, not by threshold.

CPython's collector starts by itself whenever allocations outnumber frees by its thresholds; a full
(generation 2) collection walks every live Python object — the modules, the compiled graphs'
wrappers, the autograd nodes of a step in flight — and stops the host for tens of ms at a moment no
rank agrees on. One rank paused holds the others at the next collective, and a host-bound step (many
small kernels a layer) loses the pause outright. With ``--manual-gc`` the collector is off during
training (``gc.disable``); the objects alive at the start (the model, the optimizer, the data
pipeline) are collected once and frozen (``gc.freeze``: moved to a permanent generation the collector
never walks again), and ``gc.collect`` runs every ``--manual-gc-interval`` iterations (0: never during
training) and around each evaluation unless ``--no-manual-gc-eval`` — at the same iteration on every
rank. Reference counting still frees everything without a reference cycle at once; only cycles wait
for the next collection. Megatron-LM: ``--manual-gc``, ``--manual-gc-interval``,
``--no-manual-gc-eval`` (megatron/training/training.py).
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC:
    """The collector's schedule for one training loop.

    enabled: ``--manual-gc``; interval: ``--manual-gc-interval`` (iterations, 0: no collection between
    steps); at_eval: collect before and after each evaluation (``--no-manual-gc-eval`` clears it).
    Use :meth:`running` around the loop: it restores the collector's state on the way out, however
    the loop ends.
    """

    def __init__(self, enabled: bool, interval: int, at_eval: bool):
        self.enabled, self.interval, self.at_eval = enabled, interval, at_eval

    @contextlib.contextmanager
    def running(self):
        """Collector off (after one collection and a freeze) inside; as before outside."""
        if not self.enabled:
            yield self
            return
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        gc.freeze()
        try:
            yield self
        finally:
            gc.unfreeze()
            if was_enabled:
                gc.enable()

    def after_step(self, iteration: int) -> None:
        """Collect after ``iteration`` when it is a multiple of the interval."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        """Collect before and after an evaluation (with ``--manual-gc`` and not ``--no-manual-gc-eval``)."""
        if self.enabled and self.at_eval:
            gc.collect()
        yield
        if self.enabled and self.at_eval:
            gc.collect()
