"""Named ranges in a profile: an NVTX range (--nvtx-ranges, CUDA) and a torch profiler annotation.

``annotate`` marks code (a micro-batch's forward or backward, a collective, the optimizer step);
training/profiling.py turns the ranges on for the profiled steps (``enable``/``disable``). Off,
``annotate`` returns the one shared null context ``NULL``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

NULL = contextlib.nullcontext()
_ranges = {"on": False, "nvtx": False}  # inside a profiled step: annotate; also push NVTX ranges
KIND_NAMES = {"F": "forward", "B": "backward"}


def enable(nvtx: bool) -> None:
    """Ranges on (a profiled step begins); NVTX ranges as well when ``nvtx``."""
    _ranges.update(on=True, nvtx=nvtx)


def disable() -> None:
    """Ranges off: ``annotate`` returns ``NULL`` again."""
    _ranges.update(on=False, nvtx=False)


def annotate(name: str, mb: Optional[int] = None, chunk: int = 0):
    """A context naming the code inside (``name``, or "forward mb 3" for ``name`` "F" and mb 3)
    in the profile: an NVTX range (--nvtx-ranges, CUDA) and a torch profiler user annotation.
    Outside profiled steps the shared null context."""
    if not _ranges["on"]:
        return NULL
    if mb is not None:
        name = f"{KIND_NAMES.get(name, name)} mb {mb}" + (f" chunk {chunk}" if chunk else "")
    return _Range(name)


class _Range:
    def __init__(self, name: str):
        self.name, self.record = name, torch.profiler.record_function(name)

    def __enter__(self):
        if _ranges["nvtx"]:
            torch.cuda.nvtx.range_push(self.name)
        self.record.__enter__()

    def __exit__(self, *exc):
        self.record.__exit__(*exc)
        if _ranges["nvtx"]:
            torch.cuda.nvtx.range_pop()
