"""What would make a layout fit, when ``search`` finds none: `meshlm plan` says it and exits non-zero.

Three answers, each from the planner's own models:

- the smallest layout that is valid but too large, and what it needs (device bytes, ``memory.Memory``):
  a GPU with that much memory fits it;
- the first job size, doubling ``--num-gpus`` up to ``MAX_DOUBLINGS`` times (whole nodes), at which
  ``search`` finds a layout, with that layout's flags;
- when no layout is even valid (every one refused by meshlm's rules), the first rule's reason.
"""

from __future__ import annotations

from .gpus import GPU, GiB

MAX_DOUBLINGS = 6  # --num-gpus × 2 … × 64 tried


def no_fit_advice(cfg, world: int, gpu: GPU, vocab: int, excluded: list, *, gpus_per_node: int,
                  half: bool = True) -> list:
    """Lines saying what would make a layout of cfg's model fit (module doc); ``excluded`` is
    ``search``'s second result for ``world`` GPUs; gpus_per_node the cluster's (--gpus-per-node). cfg
    carries --global-batch-size."""
    from .search import search
    lines = []
    sized = [e for e in excluded if "needs_bytes" in e]
    if sized:
        small = min(sized, key=lambda e: e["needs_bytes"])
        lines.append(f"the smallest layout, {small['layout']}, needs {small['needs_bytes'] / GiB:.1f} GiB a GPU "
                     f"> {gpu.memory_bytes / GiB:.1f} GiB of {gpu.name}: a GPU with at least "
                     f"{small['needs_bytes'] / GiB:.1f} GiB fits it (--gpu, or --gpu-memory-gib)")
    elif excluded:
        lines.append(f"every layout is refused by meshlm's rules, e.g. {excluded[0]['layout']}: "
                     f"{excluded[0]['reason']}")
    for k in range(1, MAX_DOUBLINGS + 1):
        n = world * 2 ** k
        fits, _ = search(cfg, n, gpu, vocab, gpus_per_node=min(gpus_per_node, n), half=half)
        if fits:
            best = fits[0]
            lines.append(f"--num-gpus {n} fits: {best.layout.describe()}, {best.memory.device_bytes / GiB:.1f} GiB "
                         f"a GPU, flags {' '.join(best.layout.flags())}")
            break
    else:
        lines.append(f"no layout fits on up to {world * 2 ** MAX_DOUBLINGS} GPUs either: shorten --seq-length, "
                     f"lower --global-batch-size or plan a smaller model")
    return lines
