"""The fast path: one switch, ``--fast-path auto|on|off`` (TrainingConfig.fast_path).

On (the default on CUDA; ``auto`` leaves it off on CPU, where the parity tests run):
- each transformer layer and the cross-entropy's element-wise math run under ``torch.compile``
  (Inductor fuses the norm scale, RoPE, SwiGLU, residual adds and the loss's softmax passes);
- AdamW runs as ``torch._fused_adamw_`` over the optimizer's flat shards (optim/adamw.py);
- attention dropout is one SDPA call per layer drawing from the device's default generator
  (Megatron's per-TP-rank model-parallel stream; masks differ between TP layouts, weights do not).
Off: the same functions eagerly, AdamW as foreach kernels, attention dropout keyed per head so the
masks are layout-independent (parallel/random.py).

Either way the model computes the same function: float64 stays float64 (``dtypes.py``).

``eager(fn)`` marks a function that compiled code must call eagerly (``torch.compiler.disable``)
without importing dynamo (about 0.6 s of a worker's start-up) until something is compiled: the
mark is applied when ``compile_fn`` or ``compile_module`` first runs.
"""

from __future__ import annotations

import functools

import torch

# per-layer compile: dynamo guards on each layer's index (dropout keys) and on train/eval mode, so
# each layer holds up to two cache entries of the shared forward code; the default limit (8) would
# silently send later layers back to eager
_CACHE_LIMIT = 256


def enabled(setting: str, device: torch.device) -> bool:
    """Whether the fast path is on: ``on``, ``off``, or ``auto`` (on exactly when device is CUDA)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


class _Eager:
    """A callable that runs ``fn``; ``fn`` becomes ``torch.compiler.disable(fn)`` before the first compile."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


_EAGER: list = []  # every _Eager not yet disabled


def eager(fn) -> _Eager:
    """fn, run eagerly (a graph break) when compiled code calls it; see the module doc."""
    wrapper = _Eager(fn)
    _EAGER.append(wrapper)
    return wrapper


def _before_compile() -> None:
    """Disable compilation of the ``eager`` functions, and raise dynamo's cache limits so that
    per-layer compilation never falls back to eager."""
    while _EAGER:
        wrapper = _EAGER.pop()
        wrapper.fn = torch.compiler.disable(wrapper.fn)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _CACHE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * _CACHE_LIMIT)


def compile_fn(fn, dynamic=None):
    """fn under torch.compile (Inductor; compiled on first call, for the shapes it sees, or for
    any size with ``dynamic=True``)."""
    _before_compile()
    return torch.compile(fn, dynamic=dynamic)


def compile_module(module: torch.nn.Module) -> None:
    """Run module's calls under torch.compile (``nn.Module.compile``: parameters and state_dict
    names unchanged)."""
    _before_compile()
    module.compile()
