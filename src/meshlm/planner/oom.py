"""An out-of-memory error explained: what the planner predicted, what was allocated, what would fit.

``explain_oom`` is called by the trainer when a step raises ``torch.OutOfMemoryError`` and its text
becomes the one-line-per-fact TrainingError the CLI prints (training/trainer.py, ``pretrain``);
``explain_host_oom`` likewise for the RuntimeError of torch's CPU allocator (``is_host_oom``), where
a CPU run's host memory runs out.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import Config, global_batch
from .gpus import GPU, PRESETS, GiB
from .layout import Layout
from .memory import estimate
from .search import search


def _device_gpu() -> GPU:
    """This machine's GPU as a profile: the H200 preset's speeds with the device's own memory."""
    base = PRESETS["H200-141GB"]
    if not torch.cuda.is_available():
        return base
    from dataclasses import replace
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return replace(base, name=props.name, memory_bytes=props.total_memory)


def explain_oom(cfg: Config, exc: BaseException, *, world: int, vocab: int, gpus_per_node: Optional[int] = None,
                gpu: Optional[GPU] = None, top: int = 3) -> str:
    """The message for an out-of-memory ``exc`` in a run of cfg on ``world`` ranks: the planner's
    prediction by category for this layout, torch's allocated / peak bytes when it failed (CUDA; "n/a"
    on CPU), and the flags of up to ``top`` layouts of the same world that the planner says fit,
    those that keep this run's TP and PP first (recompute, a smaller micro-batch, the distributed
    optimizer), then the rest (more TP/PP)."""
    gpu = gpu or _device_gpu()
    gpus_per_node = gpus_per_node or (torch.cuda.device_count() if torch.cuda.is_available() else world)
    c = Layout.of(cfg, world).apply(cfg)
    c.training.global_batch_size = global_batch(cfg, world)
    lay = Layout.of(c, world)
    lines = [f"out of memory on a {gpu.name} ({gpu.memory_bytes / GiB:.1f} GiB) at {lay.describe()}, micro-batch "
             f"{lay.micro_batch}, {lay.recompute_name} recompute{f', ZeRO-{lay.stage}' if lay.stage else ''}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"]
    try:
        mem = estimate(c, lay, vocab)
        lines.append(f"planner's prediction per GPU: weights {mem.weights / GiB:.2f} + grads {mem.grads / GiB:.2f} + "
                     f"optimizer {mem.optimizer / GiB:.2f} + activations {mem.activations / GiB:.2f} + logits/loss "
                     f"{mem.loss / GiB:.2f} GiB → peak {mem.peak_bytes / GiB:.2f} GiB, {mem.device_bytes / GiB:.2f} GiB "
                     f"with CUDA context and allocator reserve")
    except Exception as e:  # an unusual layout the planner cannot split: say so, keep the rest
        lines.append(f"planner's prediction: n/a ({e})")
    if torch.cuda.is_available():
        lines.append(f"allocated when it failed: {torch.cuda.memory_allocated() / GiB:.2f} GiB (peak "
                     f"{torch.cuda.max_memory_allocated() / GiB:.2f} GiB, reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB)")
    else:
        lines.append("allocated when it failed: n/a (no CUDA device)")
    fits, _ = search(c, world, gpu, vocab, gpus_per_node=gpus_per_node)
    same = [f for f in fits if (f.layout.tp, f.layout.pp) == (lay.tp, lay.pp)]
    picks = (same + [f for f in fits if f not in same])[:top]
    if picks:
        lines.append("layouts that fit (planner): " + " | ".join(
            f"{' '.join(f.layout.flags())} ({f.memory.device_bytes / GiB:.1f} GiB)" for f in picks))
    else:
        lines.append(f"no layout of {world} GPUs fits this model and batch; add GPUs (`meshlm plan --num-gpus N`)")
    return "\n".join(lines)


HOST_OOM = "DefaultCPUAllocator: can't allocate memory"  # torch's CPU allocator (c10/core/impl/alloc_cpu.cpp)


def is_host_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's CPU allocator failing (a RuntimeError; CUDA raises OutOfMemoryError)."""
    return isinstance(exc, RuntimeError) and HOST_OOM in str(exc)


def explain_host_oom(cfg: Config, exc: BaseException, *, world: int, local_ranks: int) -> str:
    """The message for the host running out of memory in a CPU run of cfg on ``world`` ranks
    (``local_ranks`` of them on this machine): the layout, torch's request, the host memory available
    now, and the flags that shrink a step's activations. No planner figures: its activation model
    is the GPU kernels' (flash attention), not the CPU math path's s² attention scores."""
    from ..host_memory import available_bytes
    lay = Layout.of(cfg, world)
    text = str(exc)
    request = text[text.index(HOST_OOM):].split(". Error code")[0].rstrip(".")
    free = available_bytes()
    lines = [f"out of host memory at {lay.describe()}, micro-batch {lay.micro_batch}, --seq-length "
             f"{cfg.model.seq_length}, {lay.recompute_name} recompute: {request}",
             f"host memory available now: {free / GiB:.1f} GiB for {local_ranks} local rank(s)" if free is not None
             else "host memory available now: unknown",
             "lower --micro-batch-size or --seq-length (attention on CPU computes micro-batch × seq-length² scores "
             "at a time), or add --recompute-activations (fewer activations kept for backward)"]
    return "\n".join(lines)
