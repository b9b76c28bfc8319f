"""Starting the workers of a run: self-launch through torch.distributed.run, or join a launched job.

Three ways a ``meshlm pretrain`` process can find itself:

* **launcher** (plain ``meshlm pretrain`` on a node): the config is resolved and validated here,
  then :func:`launch_local` starts ``--nproc-per-node`` workers with torch.distributed.run's
  elastic agent (the engine behind ``torchrun --standalone``); each re-enters
  ``meshlm pretrain --config <run_dir>/config.yaml`` with ``MESHLM_WORKER=1`` in its environment.
* **self-launched worker** (``MESHLM_WORKER=1``): :func:`run_worker` joins the job and trains.
* **user-launched job** (``torchrun …`` or Slurm's ``srun`` set RANK / SLURM_PROCID): rank 0
  resolves the config — including preparing the embedded default corpus, which therefore needs a
  run directory on a filesystem every node sees — and broadcasts it while the others wait
  (:func:`resolve_on_rank0`); then every rank runs :func:`run_worker`.

Every worker copies its stdout/stderr to ``<log dir>/rank<R>.log``. When a self-launched worker
fails, the launcher prints one line naming the rank (and the worker's own error message, or the
tail of its log) instead of the elastic agent's tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import traceback
import uuid
from typing import Callable

from .config import Config
from .errors import MeshlmError

WORKER_ENV = "MESHLM_WORKER"
ERROR_PREFIX = "meshlm: error: "
LOG_TAIL_LINES = 30


def is_self_launched_worker() -> bool:
    """True in a worker that :func:`launch_local` started."""
    return os.environ.get(WORKER_ENV) == "1"


def in_launched_job() -> bool:
    """True when torchrun (RANK) or Slurm (SLURM_PROCID) started this process as one rank of a job."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def job_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def worker_log_path(cfg: Config, rank: int) -> str:
    """``<log dir>/rank<R>.log``: a copy of that worker's stdout and stderr."""
    log_dir = cfg.logging.log_dir or os.path.join(cfg.logging.run_dir or ".", "logs")
    return os.path.join(log_dir, f"rank{rank}.log")


def worker_threads(nproc: int) -> int:
    """CPU threads per worker: this machine's usable cores shared evenly, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // nproc)


# ----------------------------------------------------------------------------- workers

class _Tee:
    """A text stream that writes to the console stream and to a log file."""

    def __init__(self, console, log):
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._console.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._console.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, … of the console
        return getattr(self._console, name)


@contextlib.contextmanager
def _tee_output(path: str):
    """Copy sys.stdout and sys.stderr to ``path`` (appending) inside the block; yield the log file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", buffering=1) as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield log
        finally:
            sys.stdout, sys.stderr = out, err


def run_worker(cfg: Config) -> int:
    """Join the job (gloo on CPU, NCCL on CUDA) and run ``training.trainer.pretrain(cfg)``.

    Everything the worker prints is copied to this rank's log (``worker_log_path``), and so is
    an error: a MeshlmError as one ``meshlm: error: …`` line, anything else as its traceback. In a
    self-launched worker the error is left for the launcher to report and the exit status is
    returned (2 for a MeshlmError, 1 otherwise); elsewhere the error is re-raised. Returns 0 on
    success.
    """
    import torch.distributed as dist

    with _tee_output(worker_log_path(cfg, job_rank())) as log:
        try:
            from .parallel.mesh import init_distributed
            from .training.trainer import pretrain
            init_distributed(cfg.parallel.distributed_timeout_minutes)
            pretrain(cfg)
        except MeshlmError as e:
            log.write(f"{ERROR_PREFIX}{e}\n")
            if is_self_launched_worker():
                return 2
            raise
        except Exception:
            log.write(traceback.format_exc())
            if is_self_launched_worker():
                return 1
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def resolve_on_rank0(resolve: Callable[[], Config], timeout_minutes: int) -> Config:
    """In a user-launched job: rank 0 runs ``resolve()`` (run dir, default corpus, validation,
    config.yaml) while the other ranks wait, then every rank gets rank 0's config.

    A MeshlmError on rank 0 is re-raised there; the other ranks exit with status 2 quietly, so the
    job reports the problem once. Collective over the whole job (a broadcast from rank 0).
    """
    import torch.distributed as dist

    from .parallel.mesh import init_distributed

    init_distributed(timeout_minutes)
    if dist.get_rank() == 0:
        payload, error = None, None
        try:
            payload = {"config": resolve().to_dict()}
        except MeshlmError as e:
            payload, error = {"error": str(e)}, e
        except BaseException:
            dist.broadcast_object_list([{"error": "rank 0 failed while resolving the config"}], src=0)
            raise
        dist.broadcast_object_list([payload], src=0)
        if error is not None:
            raise error
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
        if "error" in payload:
            dist.destroy_process_group()
            raise SystemExit(2)
    return Config.from_dict(payload["config"])


# ----------------------------------------------------------------------------- launcher

@contextlib.contextmanager
def _environ(**values):
    """Set environment variables (those not already set) inside the block; restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _agent_log(path: str):
    """Send torch.distributed's (elastic agent's) log records to ``path`` instead of the console."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    logger = logging.getLogger("torch.distributed")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = logger.handlers[:], logger.propagate  # torch's own handler prints to stderr
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved
        handler.close()


def _last_error_line(path: str):
    """The worker's one-line MeshlmError message from its log, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as fh:
        lines = [line.rstrip("\n") for line in fh if line.startswith(ERROR_PREFIX)]
    return lines[-1][len(ERROR_PREFIX):] if lines else None


def _tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    if not os.path.isfile(path):
        return f"  (no log at {path})"
    with open(path, errors="replace") as fh:
        lines = fh.read().splitlines()[-n:]
    return "\n".join("  " + line for line in lines)


def launch_local(cfg: Config, config_path: str, nproc: int) -> int:
    """Start ``nproc`` workers on this node running ``meshlm pretrain --config config_path``.

    Uses torch.distributed.run's elastic agent with a standalone c10d rendezvous (what
    ``torchrun --standalone --nproc-per-node`` does), no restarts. Workers get OMP_NUM_THREADS =
    usable cores // nproc (unless set), NCCL_NVLS_ENABLE=0 (unless set) and MESHLM_WORKER=1.

    Returns 0 on success, 1 when a worker crashed (after printing which rank, its exit code and
    the tail of its log), 130 on interrupt. Raises MeshlmError carrying a worker's own one-line
    error (a data or config problem found inside the worker).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                              role="meshlm", rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                              max_restarts=0, monitor_interval=0.1,
                              logs_specs=DefaultLogsSpecs(log_dir=os.devnull))
    log_dir = os.path.dirname(worker_log_path(cfg, 0))
    env = {"OMP_NUM_THREADS": str(worker_threads(nproc)), "NCCL_NVLS_ENABLE": "0", WORKER_ENV: "1"}
    argv = ["-u", "-m", "meshlm", "pretrain", "--config", config_path]
    try:
        with _environ(**env), _agent_log(os.path.join(log_dir, "launcher.log")):
            elastic_launch(launch_cfg, sys.executable)(*argv)
    except ChildFailedError as e:
        # the first rank that failed by itself, not one the agent then stopped with SIGTERM
        rank, failure = min(e.failures.items(), key=lambda kv: (
            kv[1].exitcode == -signal.SIGTERM, kv[1].timestamp, kv[0]))
        log = worker_log_path(cfg, rank)
        message = _last_error_line(log)
        if message is not None:
            raise MeshlmError(f"rank {rank}: {message}") from None
        how = (f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        print(f"{ERROR_PREFIX}worker rank {rank} {how}; the end of its log {log}:\n{_tail(log)}",
              file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"meshlm: interrupted ({e.sigval.name}); workers stopped", file=sys.stderr)
        return 130
    return 0
