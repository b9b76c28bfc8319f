"""Megatron's pretraining sampler: sequential samples from ``consumed_samples``, split over DP.

The dataset is read in blocks of ``micro_batch × dp_size`` consecutive samples; DP rank r takes
``[r · micro_batch, (r + 1) · micro_batch)`` of each block. A global batch (several blocks) thus
holds the same samples whatever the layout, and resuming from ``consumed_samples`` is exact.
"""

from __future__ import annotations

import torch


def collate(samples: list) -> dict:
    """Stack sample dicts of [s] tensors into one micro-batch dict of [b, s] tensors; in pinned
    memory when CUDA is up, so the schedule's non_blocking copy to the GPU does not stall the host."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    if torch.cuda.is_available():
        batch = {key: t.pin_memory() for key, t in batch.items()}
    return batch


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Yield this DP rank's micro-batches ({"tokens", "labels": int64 [b, s], "loss_mask": fp32 [b, s]},
    b = micro_batch_size) from sample ``consumed_samples`` on, until fewer than a whole block
    (micro_batch_size × dp_size samples) remain. Raises ValueError on an invalid rank or size.
    """
    if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"micro_batch_size {micro_batch_size}, dp_rank {dp_rank}, dp_size {dp_size}")
    block = micro_batch_size * dp_size
    start = consumed_samples
    while start + block <= len(dataset):
        first = start + dp_rank * micro_batch_size
        yield collate([dataset[i] for i in range(first, first + micro_batch_size)])
        start += block
