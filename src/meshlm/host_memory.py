"""Host memory as meshlm reads it: the bytes available to a new allocation on this machine, and the
resident bytes of a process with all its descendants.

psutil when it is installed (``virtual_memory().available``, ``Process.memory_info().rss``), else
Linux's /proc (MemAvailable of /proc/meminfo, which is what psutil reports there; VmRSS of each
/proc/<pid>/status). Used by validate.py (--optimizer-cpu-offload must fit the host) and by
bench/offload_7b.py's watch of a run.
"""

from __future__ import annotations

import os
from typing import Optional


def available_bytes() -> Optional[int]:
    """Bytes of host memory available without swapping (MemAvailable); None where neither psutil
    nor /proc/meminfo can tell."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (0 for a process that is gone)."""
    try:
        import psutil
    except ImportError:
        return sum(_status_rss(p) for p in _descendants_proc(pid))
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass  # ended since it was listed
    return total


def _descendants_proc(pid: int) -> list:
    """pid and its descendants, from each /proc/<pid>/stat's parent field."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    parents[int(name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _status_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
