"""Profiling the steps Megatron's flags name, and NVTX ranges for Nsight Systems.

Megatron's semantics (megatron/training/training.py, ProfilingConfig): under --profile, on the
--profile-ranks (all ranks when none is given), profiling covers the iterations after
--profile-step-start iterations are done through iteration --profile-step-end (defaults 10 and 12:
iterations 11 and 12). With --use-pytorch-profiler a torch profiler records them (CPU activity,
and CUDA kernels on GPUs; shapes and stacks under --pytorch-profiler-collect-shapes/-callstack)
and writes ``<run-dir>/torch_profile/rank-<R>.pt.trace.json.gz``: a Chrome trace that Perfetto
opens and TensorBoard's profiler plugin finds (``tensorboard --logdir <run-dir>/torch_profile``).
Without it, cudaProfilerStart/Stop bracket the steps for ``nsys profile
--capture-range=cudaProfilerApi`` (nothing on CPU). --nvtx-ranges adds NVTX ranges during the
profiled steps (Megatron: ``configure_nvtx_profiling``): forward and backward of each micro-batch,
each torch.distributed collective (named by its process group: tp, pp, dp, …) and the optimizer
step; under the torch profiler the same names appear as user annotations, and each profiled
iteration is a range "iteration N".

The ranges themselves are meshlm/profile_ranges.py's ``annotate`` (the pipeline's and the trainer's
too); this module turns them on for the profiled steps. Off (the default), nothing is patched and
``annotate`` returns one shared null context: the only cost is a module-global check per call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist

from .. import profile_ranges
from ..profile_ranges import annotate

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce_scatter", "all_to_all_single", "all_to_all", "batch_isend_irecv", "send", "recv",
               "all_gather_object", "barrier")  # not isend/irecv: P2POp accepts only the originals


def _group_names(ps) -> dict:
    """{process group: "tp", "pp", "dp", …} from the ParallelState's ``*_group`` attributes."""
    names = {}
    for attr, group in vars(ps).items():
        if attr.endswith("_group") and group is not None:
            names.setdefault(group, attr[: -len("_group")])
    return names


def _wrap(fn, label: str, groups: dict):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and args and isinstance(args[0], (list, tuple)) and args[0] \
                and isinstance(args[0][0], dist.P2POp):
            group = args[0][0].group
        with annotate(f"{label} {groups.get(group, 'world')}"):
            return fn(*args, **kwargs)
    return wrapper


class _Collectives:
    """Wraps each torch.distributed collective in ``annotate`` while active: in torch.distributed
    and wherever a meshlm module holds the same function under another name (e.g. data.py's
    reduce_scatter_flat). ``undo`` puts the originals back."""

    def __init__(self, ps):
        groups = _group_names(ps)
        originals = {id(getattr(dist, n)): n for n in COLLECTIVES if hasattr(dist, n)}
        self.patched = []
        modules = [dist] + [m for name, m in list(sys.modules.items()) if name.startswith("meshlm.") and m]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if id(value) in originals and callable(value):
                    self.patched.append((module, attr, value))
                    setattr(module, attr, _wrap(value, originals[id(value)], groups))

    def undo(self):
        for module, attr, value in reversed(self.patched):
            setattr(module, attr, value)


class StepProfiler:
    """Profiles the step range of --profile on this rank; ``step(done)`` wraps one training step
    (``done`` iterations completed before it), ``close()`` ends a range the run ended inside."""

    def __init__(self, cfg, ps, rank: int):
        lg = cfg.logging
        self.first, self.last, self.rank, self.ps = lg.profile_step_start, lg.profile_step_end, rank, ps
        self.torch, self.nvtx = lg.use_pytorch_profiler, lg.nvtx_ranges
        self.shapes, self.stack = lg.pytorch_profiler_collect_shapes, lg.pytorch_profiler_collect_callstack
        self.path = os.path.join(lg.run_dir or ".", "torch_profile", f"rank-{rank}.pt.trace.json.gz")
        self.cuda = ps.device.type == "cuda"
        self.prof, self.collectives, self.active = None, None, False

    @contextlib.contextmanager
    def step(self, done: int):
        if not self.active and self.first <= done < self.last:
            self._start(done)
        with annotate(f"iteration {done + 1}"):  # a step marker in the trace and in Nsight
            yield
        if self.active and done + 1 >= self.last:
            self.close()

    def _start(self, done: int) -> None:
        self.active, self.started_after = True, done
        if self.torch:
            activities = [torch.profiler.ProfilerActivity.CPU] + \
                ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=activities, record_shapes=self.shapes,
                                               with_stack=self.stack)
            self.prof.start()
        elif self.cuda:
            torch.cuda.profiler.start()
        if self.torch or self.nvtx:
            profile_ranges.enable(nvtx=self.nvtx and self.cuda)
            self.collectives = _Collectives(self.ps)

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.collectives is not None:
            self.collectives.undo()
            profile_ranges.disable()
        if self.prof is not None:
            self.prof.stop()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.prof.export_chrome_trace(self.path)
            self.prof = None
            print(f"meshlm: rank {self.rank}: torch profiler trace of iterations {self.started_after + 1}–"
                  f"{self.last}: {self.path}", flush=True)
        elif self.cuda:
            torch.cuda.profiler.stop()


class _Off:
    """--profile off, or a rank not in --profile-ranks: nothing happens."""

    def step(self, done: int):
        return profile_ranges.NULL

    def close(self) -> None:
        pass


def for_run(cfg, ps):
    """The profiler of this rank: a StepProfiler under --profile on a --profile-ranks rank, else a
    no-op with the same methods."""
    lg = cfg.logging
    if not lg.profile or (lg.profile_ranks and ps.rank not in lg.profile_ranks):
        return _Off()
    return StepProfiler(cfg, ps, ps.rank)


def problems(cfg, world: int) -> list:
    """Config problems of the profiling flags (validate.py): an empty step range, a rank outside
    the job."""
    lg, out = cfg.logging, []
    if lg.profile_step_end <= lg.profile_step_start:
        out.append(f"--profile-step-end {lg.profile_step_end} must be greater than --profile-step-start "
                   f"{lg.profile_step_start}: profiling covers the iterations after the start through the end")
    bad = [r for r in lg.profile_ranks if not 0 <= r < world]
    if bad:
        out.append(f"--profile-ranks {' '.join(map(str, bad))}: no such rank in a job of {world} processes "
                   f"(ranks 0–{world - 1})")
    return out


def notes(cfg) -> list:
    """Profiling flags that do nothing as given (as in Megatron), one line each."""
    lg = cfg.logging
    flags = [f for f, on in (("--use-pytorch-profiler", lg.use_pytorch_profiler), ("--nvtx-ranges", lg.nvtx_ranges),
                             ("--profile-ranks", bool(lg.profile_ranks))) if on]
    if flags and not lg.profile:
        return [f"{' '.join(flags)} ignored without --profile (as in Megatron); add --profile"]
    iters = cfg.training.train_iters
    if lg.profile and iters is not None and cfg.training.train_samples is None and lg.profile_step_end > iters:
        start, end = lg.profile_step_start, lg.profile_step_end
        if start >= iters:
            return [f"--profile: iterations {start + 1}–{end} (--profile-step-start {start}, --profile-step-end "
                    f"{end}) are beyond the run's {iters} iterations: nothing is profiled; give "
                    f"--profile-step-start below {iters}"]
        return [f"--profile: the run ends at iteration {iters}, so only iterations {start + 1}–{iters} of "
                f"{start + 1}–{end} are profiled"]
    return []
