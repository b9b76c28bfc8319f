"""Dropout randomness that depends on the seed and on *what* is drawn, not on TP, SP or PP.

Megatron-LM's rule (``model_parallel_cuda_manual_seed``): dropout inside TP-split regions
(attention probabilities) draws from a "model-parallel" RNG state seeded with
``seed + 2718 + tp_rank``, so different shards get different masks; dropout in replicated regions
(hidden states) draws from the default state, identical on every TP rank of a replica.

We keep that rule at a finer grain, so that a TP=1 run reproduces a TP=k run *exactly*:

- TP-split region: the stream of attention head j is seeded from ``seed + 2718 + j`` (j the
  global head index; Megatron's value when each rank holds one head). A rank holding heads
  [r·a/tp, (r+1)·a/tp) draws each head's mask from that head's stream, whatever tp is.
- Replicated region: the stream is seeded from ``seed``, the same on every TP rank; the mask is
  drawn for the full [s, b, h] tensor and, under sequence parallelism, each rank keeps its s/tp
  rows, under context parallelism the rows of its two chunks (parallel/context.py) — the mask of
  one process, sliced.
- Every draw is keyed by (stream seed, global layer index, site, call), where ``call`` counts the
  training forwards of the model. Keys, unlike advancing states, do not depend on which pipeline
  stage holds a layer and replay identically when a layer is recomputed in backward.

Data parallelism is the exception, as in Megatron: ``call`` counts this rank's forwards and a
micro-batch's mask has the micro-batch's shape, so DP replicas draw the same masks for different
samples, and DP=2 and DP=1 runs with dropout on differ (with dropout 0 they agree to round-off).

``RNGTracker.fork(*key)`` swaps the device's default generator (torch.get_rng_state /
torch.cuda.get_rng_state) for one seeded from the key, and restores it on exit, so library
kernels that draw from the default generator (SDPA's dropout) see the keyed stream. Works on CPU
and CUDA.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel stream


def derive_seed(*key) -> int:
    """A 63-bit seed from any tuple of ints/strings, stable across processes and runs."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class RNGTracker:
    """Keyed dropout streams for one model chunk (no module globals).

    seed: the run's --seed. device: where dropout runs (its default generator is forked).
    ``call`` is advanced by the model once per training forward (``next_call``).
    """

    def __init__(self, seed: int, device: torch.device):
        self.seed = seed
        self.device = torch.device(device)
        self.call = 0

    def next_call(self) -> int:
        self.call += 1
        return self.call

    def head_stream(self, head: int) -> int:
        """Seed of attention head ``head``'s stream (TP-split region)."""
        return self.seed + MODEL_PARALLEL_SEED_OFFSET + head

    @contextlib.contextmanager
    def fork(self, stream: int, *key):
        """Run the block with the device's default generator seeded from (stream, *key)."""
        cuda = self.device.type == "cuda"
        saved = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        seed = derive_seed(stream, *key)
        if cuda:
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)

    def dropout(self, x: torch.Tensor, p: float, key: tuple, full_rows: int | None = None,
                rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Replicated-region dropout of x, mask from the default stream keyed by ``key``.

        x: [s_local, ...]. full_rows / rows: under sequence or context parallelism the full
        sequence length s and this rank's rows of it (a slice, or int64 positions [s_local]); the
        mask is drawn for [s, ...] and those rows kept, so it equals the mask one process draws.
        """
        if p == 0.0:
            return x
        with self.fork(self.seed, *key):
            keep = torch.empty((full_rows or x.shape[0],) + tuple(x.shape[1:]), device=x.device,
                               dtype=x.dtype).bernoulli_(1 - p)
        if rows is not None:
            keep = keep[rows]
        return x * keep / (1 - p)
