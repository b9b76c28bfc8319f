"""Reading one device value on the host without draining the GPU of later work.

``start_read(t)`` starts copying a one-element tensor to the host and returns a function giving its
float. On CUDA the copy is non-blocking and an event is recorded right after it, so the read waits
for the work queued before the call and none queued after (the optimizer's update, the next
step's forward): the step's loss and grad norm are read this way. On the CPU the read is direct.
"""

from __future__ import annotations

from typing import Callable

import torch


def start_read(t: torch.Tensor) -> Callable[[], float]:
    """Start copying the one-element tensor t to the host; return a function giving its float
    value (blocking only until the copy has happened)."""
    if t.device.type != "cuda":
        return lambda: float(t.item())
    host = t.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return lambda: (copied.synchronize(), float(host.item()))[1]
