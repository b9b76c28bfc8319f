"""The grad norm's kernels at mixtral-small's gradient buckets on one GPU (issue 31): the multi-tensor
norm the optimizer runs now against one reduction a bucket and one compiled call for all of them.

Usage (lent H200, repository root):
    python bench/grad_norm_probe.py
The buckets under ``config.half_grads`` (bf16): per layer the experts' two stacks, fc1 [8, 7,168, 1,024]
and fc2 [8, 1,024, 3,584], each its own bucket (parallel/grad_buffer.py ``adopt``), and the dense 115 M
parameters in buckets of 40 M: 35 tensors, 1.53 B elements, 3.06 GB. Each way sums the squares in
fp32 and returns the norm as a device scalar (no host sync), as ``Optimizer._norm_tensor`` does;
median of 30 CUDA-event timings after 5 warm-ups (``grouped_gemm_probe.timed``); GB/s = bytes read /
time. Session 15's profile had the multi-tensor way at 1.27 ms (74 launches, ~2.4 TB/s).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grouped_gemm_probe import timed  # noqa: E402

LAYERS, H, F, E = 16, 1024, 3584, 8
DENSE = 115_000_000  # embeddings, output layer, attention and norms of mixtral-small
BUCKET = 40_000_000


def buckets(dev: str) -> list:
    """The bf16 gradient buckets, in the optimizer's order (experts' stacks, then the dense)."""
    sizes = [E * 2 * F * H, E * H * F] * LAYERS
    sizes += [BUCKET] * (DENSE // BUCKET) + [DENSE % BUCKET]
    return [torch.randn(n, device=dev, dtype=torch.bfloat16) for n in sizes]


def multi_tensor(views: list) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double().pow(2).sum().sqrt()


def per_bucket(views: list) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(v, 2, dtype=torch.float32) for v in views]).double().pow(2) \
        .sum().sqrt()


def _squares(views: list) -> torch.Tensor:
    return sum(v.float().pow(2).sum(dtype=torch.float32).double() for v in views).sqrt()


def main() -> None:
    torch.manual_seed(0)
    views = buckets("cuda")
    nbytes = sum(v.numel() * v.element_size() for v in views)
    compiled = torch.compile(_squares)
    ref = multi_tensor(views)
    print(f"{len(views)} buckets, {sum(v.numel() for v in views) / 1e9:.2f} B elements, {nbytes / 1e9:.2f} GB")
    print("| way | ms | GB/s | relative error vs multi-tensor |")
    print("|---|---|---|---|")
    for name, fn in (("multi-tensor (now)", multi_tensor), ("a reduction a bucket", per_bucket),
                     ("one compiled call", compiled)):
        ms = timed(lambda: fn(views))
        err = abs(fn(views).item() / ref.item() - 1)
        print(f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:,.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
