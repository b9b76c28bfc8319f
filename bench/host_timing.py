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


def canary(device=None) -> dict:
    """Fixed host work, timed (ms), to tell a slower machine from a slower program: a pure-Python loop
    (``py``), 2,000 torch CPU dispatches (``dispatch``) and, with a CUDA ``device``, 500 tiny kernel
    launches then a sync (``launch``). The same work every call: if these drift as a step does, the
    machine (clock, neighbours) is slower; if they stay while the step drifts, the program does more."""
    import torch
    out = {}
    t0 = time.perf_counter()
    s = 0
    for i in range(200_000):
        s += i
    out["py"] = (time.perf_counter() - t0) * 1e3
    x = torch.zeros(4)
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    out["dispatch"] = (time.perf_counter() - t0) * 1e3
    if device is not None:
        y = torch.zeros(4, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            y.add_(1)
        torch.cuda.synchronize()
        out["launch"] = (time.perf_counter() - t0) * 1e3
    return out


class Rusage:
    """The process's resource use between ``delta`` calls: user and system CPU ms, minor and major page
    faults, voluntary and involuntary context switches; and the machine's steal time (ms, all CPUs,
    from /proc/stat; None where it cannot be read)."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read():
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        steal = None
        try:
            with open("/proc/stat") as fh:
                cpu = fh.readline().split()
            steal = int(cpu[8]) * 1000 / __import__("os").sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
        return (r.ru_utime * 1e3, r.ru_stime * 1e3, r.ru_minflt, r.ru_majflt, r.ru_nvcsw, r.ru_nivcsw, steal)

    def delta(self) -> str:
        """One line of what changed since the last call."""
        now = self._read()
        d = [None if b is None or a is None else b - a for a, b in zip(self._last, now)]
        self._last = now
        steal = "n/a" if d[6] is None else f"{d[6]:.0f}"
        return (f"user {d[0]:.1f} sys {d[1]:.1f} ms, faults {d[2]}/{d[3]}, csw {d[4]}/{d[5]}, "
                f"steal {steal} ms")
