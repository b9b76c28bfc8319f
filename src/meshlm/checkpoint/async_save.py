"""--async-save: a checkpoint is snapshotted, then written in the background while training goes on.

The state a save is given holds views of the live model and optimizer (Boxes, model_space.py),
which the next optimizer step changes in place: a writer reading them later would save post-step
or torn values. So ``AsyncSaver.start`` first copies every tensor into host buffers
(``Staging``: on CUDA pinned buffers, non-blocking copies and a stream sync; on CPU plain copies)
and only then returns; a thread writes the copy. The rules (checked facts in
shared/notes/checkpoint-faults-hf.md §2, after Megatron-LM's and NeMo's async-save bugs):

- snapshot, then step: ``start`` returns once the copy is complete;
- one save in flight: ``start`` first waits for the previous save (``wait``);
- the staging buffers are reused by the next save (pinned memory is slow to allocate), so only
  after the write that reads them is done, which ``wait`` guarantees;
- finalise (dist.finalize: manifest, rename of the .tmp folder, tracker) only when every rank's
  write is done.

Collectives. The writer thread runs the steps of dist.save: rank 0 makes the .tmp folder → agree
→ every rank writes its files (dist.write; DCP's plan exchange; an error on any rank raises on all)
→ agree → rank 0 finalises. Each "agree" is an all-gather of every rank's problem (None or one
line), reached by every rank whatever failed before, so none is left waiting for one that gave up.
They run on a gloo group of the writer's own, created once at start by every rank: the training
loop's collectives go on meanwhile on the other groups, from the main thread. The checkpoint
becomes the latest as soon as the last rank's write is done, with nothing for the loop to check
each iteration. A problem only rank 0 sees (finalising) is agreed on by ``wait`` — on the same
group, from the main thread, once the thread has ended on every rank — so that every rank raises
the same one-line CheckpointError at the next save or at the end of training, never a hang; so is
a failed copy (no host memory), at once. Two small gloo all-gathers per save, none per iteration.

Memory: the host buffers hold a copy of this rank's whole saved state (weights, fp32 masters and
Adam moments: 14 bytes per parameter of its shard under bf16 with ZeRO-1 off) for the whole run.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..parallel.agree import first_problem
from . import dist as ckpt
from .boxes import Boxes


class Staging:
    """Host copies of a state's tensors, in buffers kept from one snapshot to the next."""

    def __init__(self):
        self._buffers: list = []
        self._next = 0

    def copy(self, state):
        """``state`` (a nested dict/list/tuple of tensors, Boxes and JSON values) with every tensor
        (each piece of a Boxes) copied to a host buffer and every container rebuilt, complete when
        this returns. The buffers of the previous copy are overwritten: call it only once nothing
        reads them any more."""
        self._next, devices = 0, set()
        out = self._copy(state, devices)
        del self._buffers[self._next:]
        for device in devices:  # the copies are done before the next step may change the source
            torch.cuda.current_stream(device).synchronize()
        return out

    def _copy(self, obj, devices: set):
        if isinstance(obj, Boxes):
            return Boxes(obj.shape, [(off, self._stage(t, devices)) for off, t in obj.pieces])
        if isinstance(obj, torch.Tensor):
            return self._stage(obj.detach(), devices)
        if isinstance(obj, dict):
            return {k: self._copy(v, devices) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, devices) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    def _stage(self, t: torch.Tensor, devices: set) -> torch.Tensor:
        cuda = t.device.type == "cuda"
        i, self._next = self._next, self._next + 1
        buf = self._buffers[i] if i < len(self._buffers) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != cuda:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            if i < len(self._buffers):
                self._buffers[i] = buf
            else:
                self._buffers.append(buf)
        buf.copy_(t, non_blocking=cuda)
        if cuda:
            devices.add(t.device)
        return buf


class AsyncSaver:
    """Writes checkpoints in the background, one at a time (see the module docstring).

    Construct it on every rank at start (it creates the writer's gloo group: collective over the
    whole job when ``world_size`` > 1); ``timeout_minutes``: the group's collective timeout
    (--distributed-timeout-minutes).
    """

    def __init__(self, world_size: int, timeout_minutes: int = 10):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes)) \
            if world_size > 1 else None
        self.staging = Staging()
        self._thread: Optional[threading.Thread] = None
        self._saving: Optional[tuple] = None  # (root, iteration) of the save in flight
        self._outcome: Optional[str] = None  # its problem, set by the thread

    def start(self, root: str, iteration: int, state: dict, *, layout: Optional[dict] = None,
              config: Optional[dict] = None, coords: Optional[dict] = None,
              keep: Optional[int] = None) -> Optional[str]:
        """Begin saving ``state`` as ``dist.save`` would (same files, same arguments) and return
        once it is snapshotted: the caller may change the state's tensors from then on.

        Collective: every rank calls it at the same point. Waits for the previous save first and
        returns its folder (None if there was none); raises CheckpointError as ``wait``, and on
        every rank when any rank could not copy its state (host memory).
        """
        previous = self.wait()
        copied: list = []
        problem = self._agree(ckpt.attempt(lambda: copied.append(self.staging.copy(state))))
        if problem:
            raise CheckpointError(f"--async-save: the state of iteration {iteration} could not be copied to "
                                  f"host memory ({problem}); give the job more host memory or save without "
                                  f"--async-save")
        self._saving, self._outcome = (root, iteration), None
        self._thread = threading.Thread(target=self._write, name=f"meshlm-save-{iteration}", daemon=True,
                                        args=(root, iteration, copied[0], layout, config, coords, keep))
        self._thread.start()
        return previous

    def wait(self) -> Optional[str]:
        """Wait for the save in flight, if any, and return its folder, complete and the latest.

        Collective over the writer's group when a save is in flight (every rank has one then).
        Raises CheckpointError, the same line on every rank, when any rank failed to write or
        finalise it.
        """
        if self._thread is None:
            return None
        self._thread.join()
        (root, iteration), self._thread, self._saving = self._saving, None, None
        problem = self._agree(self._outcome)
        if problem:
            free = self._agree(ckpt.free_space(root)) or ""  # the lowest rank's reading: one line everywhere
            raise CheckpointError(f"--async-save: the checkpoint of iteration {iteration} in {root} was not "
                                  f"saved ({problem}{free}); {ckpt.TRACKER} still names the previous one, "
                                  f"which a resume loads")
        return ckpt.iteration_dir(root, iteration)

    def in_flight(self) -> bool:
        """Whether this rank's writer thread is still at work (no collective, no host sync)."""
        return self._thread is not None and self._thread.is_alive()

    def _agree(self, problem: Optional[str]) -> Optional[str]:
        """The lowest rank's problem (None if no rank has one), known to every rank of the writer's
        group; watched by the hang watchdog only from the main thread."""
        if self.group is None:
            return problem
        return first_problem(problem, self.group, watch=threading.current_thread() is threading.main_thread())

    def _write(self, root, iteration, state, layout, config, coords, keep) -> None:
        """The writer thread: dist.save's steps, with every rank at every collective; its outcome
        (None, or the agreed problem; rank 0's own finalising problem) for ``wait``."""
        try:
            start, rank = time.perf_counter(), dist.get_rank() if dist.is_initialized() else 0
            problem = self._agree(ckpt.attempt(lambda: ckpt.make_temp_dir(root, iteration))
                                  if rank == 0 else None)
            written: list = []
            if problem is None:
                tmp = ckpt.temp_dir(root, iteration)
                problem = self._agree(ckpt.attempt(lambda: written.append(
                    ckpt.write(tmp, state, coords=coords, group=self.group))))
            if problem is None:
                files = ckpt.gather_files(written[0], group=self.group)
            if problem is None and rank == 0:
                world = dist.get_world_size() if dist.is_initialized() else 1
                problem = ckpt.attempt(lambda: ckpt.finalize(root, iteration, files, world_size=world,
                                                             layout=layout, config=config, keep=keep))
                if problem is None:
                    print(f"saved checkpoint {ckpt.iteration_dir(root, iteration)} in the background "
                          f"({time.perf_counter() - start:.1f} s)", flush=True)
            self._outcome = problem
        except BaseException as e:  # a collective of the writer's group itself failed
            self._outcome = ckpt.one_line(e)
