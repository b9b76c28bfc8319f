"""Megatron's pretraining sampler: sequential samples from ``consumed_samples``, split over DP.

The dataset is read in blocks of ``micro_batch × dp_size`` consecutive samples; DP rank r takes
``[r · micro_batch, (r + 1) · micro_batch)`` of each block. A global batch (several blocks) thus
holds the same samples whatever the layout, and resuming from ``consumed_samples`` is exact.
How the samples are read (worker processes, pinned memory) is data/loader.py's business.
"""

from __future__ import annotations

import torch


class PretrainingSampler:
    """A batch sampler (for ``torch.utils.data.DataLoader(batch_sampler=...)``): iterating yields
    this DP rank's index lists, one per block, from sample :attr:`start` on, until fewer than a
    whole block (micro_batch_size × dp_size samples) of ``num_samples`` remain.

    start: consumed samples where the next iteration begins; the loader sets it to resume.
    Raises ValueError on an invalid rank or size.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, start: int = 0):
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"micro_batch_size {micro_batch_size}, dp_rank {dp_rank}, dp_size {dp_size}")
        self.num_samples, self.micro, self.dp_rank, self.dp_size = num_samples, micro_batch_size, dp_rank, dp_size
        self.start = start

    def __iter__(self):
        block = self.micro * self.dp_size
        start = self.start
        while start + block <= self.num_samples:
            first = start + self.dp_rank * self.micro
            yield list(range(first, first + self.micro))
            start += block


def collate(samples: list) -> dict:
    """Stack sample dicts of [s] tensors into one micro-batch dict of [b, s] tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Yield this DP rank's micro-batches ({"tokens", "labels": int64 [b, s], "loss_mask": fp32 [b, s]},
    b = micro_batch_size) from sample ``consumed_samples`` on, read here one after the other, in
    :class:`PretrainingSampler` order. Raises ValueError on an invalid rank or size.
    """
    for indices in PretrainingSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples):
        yield collate([dataset[i] for i in indices])
