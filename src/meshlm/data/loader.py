"""``--num-workers``: this DP rank's micro-batches read ahead by worker processes, as Megatron's
``build_pretraining_data_loader`` does (a ``torch.utils.data.DataLoader`` over the pretraining
sampler, persistent workers, pinned memory on CUDA).

The workers change how samples are read, never which: the order is the sampler's
(data/sampler.py), so 0 workers (read in the training process) and N give the same batches.
A loader keeps one running iterator: a step that asks for the samples right after the last
micro-batch it handed out gets the ones the workers have already read; any other start (a resume
from a checkpoint's consumed samples, an evaluation that wraps round) restarts the reading there.
"""

from __future__ import annotations

import re
import sys
from typing import Iterator, Optional

import torch

from .sampler import PretrainingSampler, collate


class MicroBatchLoader:
    """This DP rank's micro-batches of ``dataset`` ({"tokens", "labels": int64 [b, s], "loss_mask":
    fp32 [b, s], …}, b = micro_batch_size), read by ``num_workers`` processes (0: in this one), each
    keeping up to 2 micro-batches ready; in pinned memory under ``pin_memory`` (CUDA).

    Workers are forked on Linux (the dataset's memory maps are shared, not pickled), once, by
    ``start`` (see there for when) or the first ``at``, and live as long as the loader. The loader
    draws no number from torch's global RNG (it has its own generator), so dropout masks do not
    depend on the number of workers.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int,
                 pin_memory: bool = False):
        self.dataset = dataset
        self.sampler = PretrainingSampler(len(dataset), micro_batch_size, dp_rank, dp_size)
        self.block = micro_batch_size * dp_size
        fork = num_workers > 0 and sys.platform.startswith("linux")
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate, num_workers=num_workers,
            pin_memory=pin_memory, persistent_workers=num_workers > 0, generator=torch.Generator(),
            multiprocessing_context="fork" if fork else None)
        self._running: Optional[Iterator] = None
        self._next = -1  # the sample the running iterator's next micro-batch starts at

    def start(self) -> "MicroBatchLoader":
        """Fork the workers now, reading ahead from sample 0 (``at`` restarts the same workers
        elsewhere, forking none). The trainer starts every loader as soon as its datasets exist:

        - before any collective of the training loop. A fork copies the forking thread alone, so a
          lock another thread holds at that instant stays locked in the worker for good. Right
          after a gloo collective the process group's thread drops the work's tensors, and one
          whose Python object has died makes it create a Python thread state, under CPython's
          interpreter lock (``ProcessGroupGloo::runLoop`` → ``~AsyncWork`` → ``decref_pyobject``
          → ``PyThreadState_New``); a worker forked then deadlocks in ``PyOS_AfterFork_Child``
          before it runs any Python (CPython 3.11.7 here; gh-112275, fixed in later releases): its
          rank waits for the first batch for ever and the others wait in their next collective. The
          first evaluation of a TP=2 run forked the validation loader so and hung in CI. At build,
          only the data checks' and the index caches' agreements (a few small collectives; none
          under --mock-data) precede the fork;
        - before --optimizer-cpu-offload allocates its host state, which workers forked later
          would share copy-on-write, so that every host update copies it."""
        if self._running is None:
            self.sampler.start = 0
            self._running, self._next = iter(self.loader), 0
        return self

    def at(self, consumed_samples: int) -> Iterator[dict]:
        """Micro-batches from sample ``consumed_samples`` on, as ``micro_batches(dataset,
        consumed_samples, …)`` yields them; ends where fewer than a whole block remain."""
        if self._running is None or self._next != consumed_samples:
            self.sampler.start = consumed_samples
            self._running = iter(self.loader)  # persistent workers: the same processes, restarted
            self._next = consumed_samples
        return self._take(self._running)

    def _take(self, running: Iterator) -> Iterator[dict]:
        for batch in running:
            self._next += self.block
            yield batch


def rank_loader(dataset, cfg, ps) -> MicroBatchLoader:
    """The loader of ``dataset`` for this rank of ParallelState ``ps``: micro batch and
    --num-workers from ``cfg``, pinned memory on CUDA."""
    return MicroBatchLoader(dataset, cfg.training.micro_batch_size, ps.dp_rank, ps.dp, cfg.data.num_workers,
                            pin_memory=ps.device.type == "cuda")


def loader_died(exc: BaseException) -> Optional[str]:
    """One line for torch's RuntimeError when a data-loader process of this rank died (killed by a
    signal, the kernel's out-of-memory killer's SIGKILL among them, or exited), which otherwise ends
    the worker in a traceback through whatever step it was in; None for anything else."""
    found = re.search(r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (?:is killed by signal: [^.]*|exited unexpectedly)",
                      str(exc))
    if not isinstance(exc, RuntimeError) or found is None:
        return None
    return (f"a data-loader process of this rank died ({found.group(0)}): the kernel's out-of-memory killer is a "
            f"common cause (dmesg names it); give fewer --num-workers (0 reads in the training process) and "
            f"restart with --load to resume from the last checkpoint")
