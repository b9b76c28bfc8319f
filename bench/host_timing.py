"""Host-side timing shared by the host probes (bench/host_probe.py, bench/moe_idle_probe.py).

``Spans``: seconds spent inside wrapped functions, by key, reset each step. Python's garbage
collector is timed through ``gc.callbacks``: ``gc_seconds`` and ``gc_counts`` by generation.
"""

from __future__ import annotations

import gc
import time


class Spans:
    """Per-step host seconds inside wrapped functions (``wrap``) and inside the collector."""

    def __init__(self, *keys: str):
        self.seconds = dict.fromkeys(keys, 0.0)
        self.gc_seconds, self.gc_counts = {}, {}
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def wrap(self, key: str, fn):
        """fn, its time added to ``seconds[key]`` at every call."""
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[key] += time.perf_counter() - t0
        return wrapper

    def reset(self) -> None:
        """Zero every figure (call at each step's start)."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.gc_seconds, self.gc_counts = {}, {}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        g = info["generation"]
        self.gc_seconds[g] = self.gc_seconds.get(g, 0.0) + time.perf_counter() - self._gc_start
        self.gc_counts[g] = self.gc_counts.get(g, 0) + 1
