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
  (:func:`resolve_on_rank0`; each node keeps its own --data-cache-path); then every rank runs
  :func:`run_worker`.

Every worker copies its stdout/stderr to ``<log dir>/rank<R>.log`` (appending across runs). When a
self-launched worker fails, the launcher prints one line naming the rank (and the worker's own
error message, or its exit code or signal and the tail of what it wrote in this run) instead of
the elastic agent's tracebacks. Self-launched workers die with their launcher. Under
``--exit-signal-handler`` the launcher passes ``--exit-signal`` on to its workers (instead of the
agent's stop-and-kill) and exits 0 once they have saved and exited 0 (:func:`_forward_signal`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import Callable

from .config import Config
from .errors import MeshlmError
from .run_logs import worker_log_path

WORKER_ENV = "MESHLM_WORKER"
LAUNCHER_PID_ENV = "MESHLM_LAUNCHER_PID"
ERROR_PREFIX = "meshlm: error: "
LOG_TAIL_LINES = 30
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the elastic agent's (LaunchConfig's default)
# what the workers' forkserver imports once, so that each forked worker starts without the ~2 s of
# imports a fresh interpreter pays (torch, torch.distributed, the trainer and what it imports)
PRELOAD = ("torch", "torch.distributed", "meshlm.cli", "meshlm.training.trainer")


def is_self_launched_worker() -> bool:
    """True in a worker that :func:`launch_local` started."""
    return os.environ.get(WORKER_ENV) == "1"


def in_launched_job() -> bool:
    """True when torchrun (RANK) or Slurm (SLURM_PROCID) started this process as one rank of a job."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def job_rank() -> int:
    """This process's global rank: RANK (torchrun), else SLURM_PROCID, else 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def error_rank() -> str:
    """The ``rank R: `` that starts an error line in a launched job of more than one process, else
    '' (also where the launcher's variables are not numbers: that is then the error itself)."""
    if not in_launched_job():
        return ""
    from .parallel.mesh import job_env_problem
    if job_env_problem(os.environ):
        return ""
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    return f"rank {job_rank()}: " if int(world) > 1 else ""


def worker_threads(nproc: int) -> int:
    """CPU threads per worker: this machine's usable cores shared evenly, at least 1."""
    from .parallel.mesh import usable_cores
    return max(1, usable_cores() // nproc)


# ----------------------------------------------------------------------------- workers

class _Tee:
    """A text stream that writes to the console stream and to a log file. A log write that fails
    (a full disk) ends the copy to the file with one warning on the console, which keeps every line:
    the run is not stopped by its log (a full disk stops it at metrics.jsonl or the next save)."""

    def __init__(self, console, log):
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        self._copy(lambda: self._log.write(text))
        return self._console.write(text)

    def flush(self) -> None:
        self._copy(lambda: self._log.flush())
        self._console.flush()

    def _copy(self, step) -> None:
        if self._log is None or self._log.closed:
            return
        try:
            step()
        except OSError as e:
            name, log, self._log = self._log.name, self._log, None
            with contextlib.suppress(OSError):  # closed: the other stream's tee of this file stops too
                log.close()
            self._console.write(f"meshlm: warning: {name}: {e.strerror}; the log file stops here (the console "
                                f"keeps every line)\n")

    def __getattr__(self, name):  # isatty, fileno, encoding, … of the console
        return getattr(self._console, name)


@contextlib.contextmanager
def _tee_output(path: str):
    """Copy sys.stdout and sys.stderr to ``path`` (appending) inside the block; yield the log file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(path, "a", buffering=1)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    try:
        yield log
    finally:
        sys.stdout, sys.stderr = out, err
        with contextlib.suppress(OSError):  # a full disk: the last buffered line is lost, not the run's status
            log.close()


def exit_with_launcher() -> None:
    """In a self-launched worker: be killed (SIGKILL) as soon as the launcher dies, however it dies,
    so a ``kill -9`` of ``meshlm pretrain`` leaves no worker training and writing checkpoints.

    A worker is forked from the launcher's forkserver (:func:`launch_local`), whose life the
    workers themselves prolong (each holds the forkserver's pipe, so a parent-death signal on it
    would never come): a daemon thread waits on a pidfd of the launcher instead (Linux 5.3; where
    there is none it polls once a second). A worker whose launcher died before this call (it is
    no longer its parent's parent) kills itself at once.
    """
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if not launcher:
        return
    try:
        pidfd = os.pidfd_open(launcher)
    except (AttributeError, OSError):  # no pidfd (not Linux, an old kernel), or the launcher is gone
        pidfd = None
    if not _launcher_alive(launcher):
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_kill_when_orphaned, args=(launcher, pidfd), name="meshlm-launcher-watch",
                     daemon=True).start()


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 where /proc cannot say: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid
    except (OSError, IndexError, ValueError):
        return 0


def _launcher_alive(launcher: int) -> bool:
    """Whether this worker's parent (the forkserver) is still the launcher's child; where /proc cannot
    say (not Linux), whether a process ``launcher`` exists."""
    grandparent = _parent_of(os.getppid())
    if grandparent:
        return launcher in (os.getppid(), grandparent)
    try:
        os.kill(launcher, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the pid reused by another user's process
        return False
    return True


def _kill_when_orphaned(launcher: int, pidfd) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the launcher has exited
    else:
        while _launcher_alive(launcher):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def run_worker(cfg: Config) -> int:
    """Join the job (gloo on CPU, NCCL on CUDA) and run ``training.trainer.pretrain(cfg)``.

    A self-launched worker first ties its life to the launcher's (:func:`exit_with_launcher`).
    Everything the worker prints is copied to this rank's log (``worker_log_path``), and so is
    an error: a MeshlmError as one ``meshlm: error: …`` line (so are a collective a dead peer broke,
    ``watchdog.lost_peer``, and a dead data-loader process, ``loader.loader_died``), anything else as
    its traceback. In a
    self-launched worker the error is left for the launcher to report and the exit status is
    returned (2 for a MeshlmError, 1 otherwise); elsewhere the error is re-raised. Returns 0 on
    success.
    """
    import torch.distributed as dist

    if is_self_launched_worker():
        exit_with_launcher()
    with _tee_output(worker_log_path(cfg, job_rank())) as log:
        if is_self_launched_worker():  # where the watchdog's last words go: the launcher reports them once
            sys.stderr.error_log = log
        try:
            from .errors import TrainingError
            from .parallel.mesh import init_distributed
            from .data.loader import loader_died
            from .parallel.watchdog import lost_peer
            from .training.trainer import pretrain
            init_distributed(cfg.parallel.distributed_timeout_minutes)
            try:
                pretrain(cfg)
            except RuntimeError as e:  # a peer or a data-loader process died: one line, not a traceback
                lost = lost_peer(e) or loader_died(e)
                if lost is None:
                    raise
                raise TrainingError(lost) from None
            dist.barrier()  # no rank tears its connections down while a peer is still in a collective
        except MeshlmError as e:
            _log_error(log, f"{ERROR_PREFIX}{e}\n")
            if is_self_launched_worker():
                return 2
            raise
        except Exception:
            _log_error(log, traceback.format_exc())
            if is_self_launched_worker():
                return 1
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def _log_error(log, text: str) -> None:
    """Write a worker's error to its log, where the launcher of a self-launched worker reads it;
    where the log cannot take it (a full disk) its last line (a traceback's exception) to the
    console instead, so that it is not lost (elsewhere the error is re-raised and reported by the
    caller)."""
    try:
        log.write(text)
        log.flush()
    except (OSError, ValueError):  # ValueError: the tee closed it when a write failed
        if is_self_launched_worker():
            last = text.strip().splitlines()[-1]
            sys.__stderr__.write(last if last.startswith(ERROR_PREFIX) else f"{ERROR_PREFIX}{last}")
            sys.__stderr__.write("\n")
            sys.__stderr__.flush()


# Settings each node keeps from its own command line (or --config) instead of taking rank 0's: they
# name folders on that node's own file system.
NODE_LOCAL = (("data", "data_cache_path"),)


def resolve_on_rank0(resolve: Callable[[], Config], own: Config) -> Config:
    """In a user-launched job: rank 0 runs ``resolve()`` (run dir, default corpus, validation,
    config.yaml) while the other ranks wait, then every rank gets rank 0's config, except for the
    :data:`NODE_LOCAL` settings, which every rank takes from ``own`` (its own flags' Config, also
    the source of --distributed-timeout-minutes) where it sets them: two nodes may give different
    --data-cache-path folders.

    A MeshlmError on rank 0 is re-raised there; the other ranks exit with status 2 quietly, so the
    job reports the problem once. Collective over the whole job (a broadcast from rank 0).
    """
    import torch.distributed as dist

    from .parallel.mesh import init_distributed

    init_distributed(own.parallel.distributed_timeout_minutes)
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
    cfg = Config.from_dict(payload["config"])
    for section, name in NODE_LOCAL:
        value = getattr(getattr(own, section), name)
        if value is not None:
            setattr(getattr(cfg, section), name, value)
    return cfg


# ----------------------------------------------------------------------------- launcher

@contextlib.contextmanager
def _environ(defaults: dict, forced: dict):
    """Set environment variables inside the block (``defaults`` only where not already set);
    restore them after."""
    saved = {k: os.environ.get(k) for k in {**defaults, **forced}}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.update(forced)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker_pids() -> list:
    """Pids of this launcher's self-launched workers: the children of its children (the workers
    are forked from its forkserver) that run with MESHLM_WORKER=1, read from /proc (Linux; an
    empty list elsewhere)."""
    me = os.getpid()
    parents = {int(e): _parent_of(int(e)) for e in (os.listdir("/proc") if os.path.isdir("/proc") else [])
               if e.isdigit()}
    children = {pid for pid, parent in parents.items() if parent == me}
    return [pid for pid, parent in parents.items() if parent in children and _is_worker(pid)]


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return f"{WORKER_ENV}=1".encode() in fh.read().split(b"\0")
    except OSError:  # gone meanwhile, or not ours to read
        return False


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc; True where
    that cannot be read, so the signal is sent, as before)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(line.split()[1] for line in fh if line.startswith("SigCgt:"))
        return bool(int(mask, 16) >> (sig - 1) & 1)
    except (OSError, StopIteration, IndexError, ValueError):
        return True


@contextlib.contextmanager
def _forward_signal(name):
    """Inside the block, signal ``name`` (None: do nothing) is passed on to each worker process
    alone, not its process group, so their --exit-signal-handler stops them after the current
    iteration. A worker still starting up (no handler for it yet: the signal would kill it), or
    not yet started, gets it once its handler is in place (a thread checks every 0.1 s), so a
    stop during start-up stops cleanly too. Yields the list of signals received (empty if none
    came). The elastic agent must not handle ``name`` itself (it would stop the workers and kill
    them 30 s later): launch_local leaves it out of the agent's ``signals_to_handle``."""
    received = []
    if name is None:
        yield received
        return
    sig = signal.Signals[name]
    sent, done = set(), threading.Event()

    def deliver():  # to every worker that has its handler and has not had this signal yet
        for pid in _worker_pids():
            if pid not in sent and _catches(pid, sig):
                sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def forward(signum, frame):
        received.append(signum)
        sent.clear()
        deliver()

    def retry():  # workers still starting up (or not yet started) when the signal came
        while not done.wait(0.1):
            if received:
                deliver()
    previous = signal.signal(sig, forward)
    thread = threading.Thread(target=retry, name="meshlm-forward-signal", daemon=True)
    thread.start()
    try:
        yield received
    finally:
        done.set()
        thread.join()
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _agent_log(path: str):
    """Send the elastic agent's log records to ``path`` instead of the console: torch.distributed's and
    torch.multiprocessing's (whose process context, which starts the forked workers, warns as it stops
    the others after one failed). A record the file cannot take, on a full disk, is dropped: the
    agent's log only informs."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    loggers = [logging.getLogger(name) for name in ("torch.distributed", "torch.multiprocessing")]
    handler = logging.FileHandler(path)
    handler.handleError = lambda record: None
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = [(lg.handlers[:], lg.propagate) for lg in loggers]  # torch's own handlers print to stderr
    for lg in loggers:
        lg.handlers[:] = [handler]
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (handlers, propagate) in zip(loggers, saved):
            lg.handlers[:], lg.propagate = handlers, propagate
        with contextlib.suppress(OSError):
            handler.close()


def _log_size(path: str) -> int:
    return os.path.getsize(path) if os.path.isfile(path) else 0


def _written_since(path: str, start: int) -> list:
    """Lines of the log ``path`` from byte ``start`` on: what this run wrote to a log that is
    appended to across runs (all of it if the file has since shrunk)."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as fh:
        fh.seek(start if os.path.getsize(path) >= start else 0)
        return fh.read().decode(errors="replace").splitlines()


def _last_error_line(lines: list):
    """The worker's one-line MeshlmError message among its log lines, or None."""
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    return errors[-1][len(ERROR_PREFIX):] if errors else None


def _tail(lines: list, n: int = LOG_TAIL_LINES) -> str:
    return ("\n".join("  " + line for line in lines[-n:]) if lines
            else "  (nothing; a worker whose log cannot be written, on a full disk, prints its error above)")


def _forkserver_preload() -> None:
    """Have the workers' forkserver import torch and the training code once (:data:`PRELOAD`)."""
    import multiprocessing
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))


def _own_temp_dir() -> None:
    """Forget the launcher's multiprocessing temporary folder (``/tmp/pymp-…``), which this worker
    inherited: the launcher removes it when it exits, while the worker's data-loader processes,
    which keep the sockets that share their batches with the worker there, may outlive it by a
    few seconds (they notice their parent's death every 5 s), and each then printed a
    FileNotFoundError traceback as it exited (after a stop signal or a killed worker). A process
    that needs such a folder now makes its own and removes it as it exits."""
    import multiprocessing
    multiprocessing.current_process()._config["tempdir"] = None


def become_worker(env: dict) -> None:
    """The start of a self-launched worker forked from the launcher's forkserver (cli's
    ``worker_main``): lead a session of its own, as torch.distributed.run's subprocess workers do
    (a terminal's Ctrl-C, SIGINT to the foreground group, reaches the launcher alone, whose agent
    then stops each worker once, and the worker's data-loader processes with it); put ``env`` (the
    launcher's settings for its workers) in the environment; print each line as written, as the
    console of ``python -u``; take OMP_NUM_THREADS's threads; keep multiprocessing's temporary
    files out of the launcher's folder (:func:`_own_temp_dir`)."""
    import torch
    os.setsid()
    _own_temp_dir()
    os.environ.update(env)
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def launch_local(cfg: Config, config_path: str, nproc: int, entry: Callable[[str, dict], None]) -> int:
    """Start ``nproc`` workers on this node running ``meshlm pretrain --config config_path``:
    each runs ``entry(config_path, env)`` (cli's ``worker_main``), forked from one forkserver.

    Uses torch.distributed.run's elastic agent with a standalone c10d rendezvous (what
    ``torchrun --standalone --nproc-per-node`` does), no restarts. Workers get OMP_NUM_THREADS =
    usable cores // nproc (unless set), NCCL_NVLS_ENABLE=0 (unless set), MESHLM_WORKER=1 and this
    process's pid (see :func:`exit_with_launcher`).

    With --exit-signal-handler, --exit-signal sent to this process goes to the workers
    (:func:`_forward_signal`); they save and exit 0 after their current iteration, and so does this.

    A stop signal that killed a worker still starting up (sent to the whole process group, before
    its handler) is such a stop too, before the first step: one line says so.

    Returns 0 on success (also after such a stop), 1 when a worker crashed (after printing which
    rank, its exit code or signal, and the tail of what it wrote to its log in this run) or its
    watchdog ended a hang (after printing the watchdog's line, which went to the log alone), 130 on
    interrupt. Raises MeshlmError carrying a worker's own one-line error written in this run (a
    data or config problem found inside the worker).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    t = cfg.training
    forwarded = t.exit_signal if t.exit_signal_handler else None
    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                              role="meshlm", rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                              max_restarts=0, monitor_interval=0.1, start_method="forkserver",
                              logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
                              signals_to_handle=",".join(s for s in AGENT_SIGNALS if s != forwarded))
    log_dir = os.path.dirname(worker_log_path(cfg, 0))
    defaults = {"OMP_NUM_THREADS": str(worker_threads(nproc)), "NCCL_NVLS_ENABLE": "0"}
    forced = {WORKER_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid())}
    log_start = {rank: _log_size(worker_log_path(cfg, rank)) for rank in range(nproc)}  # logs append
    received = []
    try:
        with _environ(defaults, forced), _agent_log(os.path.join(log_dir, "launcher.log")), \
                _forward_signal(forwarded) as received:
            _forkserver_preload()
            elastic_launch(launch_cfg, entry)(config_path, {k: os.environ[k] for k in (*defaults, *forced)})
    except ChildFailedError as e:
        killed = sorted(r for r, f in e.failures.items() if received and f.exitcode == -signal.Signals[forwarded])
        if killed:  # the stop signal reached them (sent to the process group, say) before their handler
            print(f"meshlm: stopped on {forwarded} (--exit-signal-handler) during start-up, before the first "
                  f"step: worker rank(s) {', '.join(map(str, killed))} got it before setting up the handler; "
                  f"nothing trained, nothing to save", flush=True)
            return 0
        # the first rank that failed by itself, not one the agent then stopped with SIGTERM, nor one that
        # only lost its connection to it (watchdog.lost_peer)
        from .parallel.watchdog import LOST_PEER_LINE
        said = {r: _last_error_line(_written_since(worker_log_path(cfg, r), log_start.get(r, 0)))
                for r in e.failures}
        rank, failure = min(e.failures.items(), key=lambda kv: (
            kv[1].exitcode == -signal.SIGTERM, (said[kv[0]] or "").startswith(LOST_PEER_LINE), kv[1].timestamp,
            kv[0]))
        log = worker_log_path(cfg, rank)
        lines = _written_since(log, log_start.get(rank, 0))
        message = said[rank]
        if message is not None and failure.exitcode == 2:  # run_worker's status for a MeshlmError
            raise MeshlmError(f"rank {rank}: {message}") from None
        if message is not None and failure.exitcode > 0:  # a hang the watchdog ended (status 1; names the rank)
            print(f"{ERROR_PREFIX}{message}", file=sys.stderr)
            return failure.exitcode
        how = (f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        print(f"{ERROR_PREFIX}worker rank {rank} {how}; the end of what it wrote to {log} in this run:\n"
              f"{_tail(lines)}", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"meshlm: interrupted ({e.sigval.name}); workers stopped", file=sys.stderr)
        return 130
    if received:
        saved = ", saved a checkpoint" if cfg.checkpoint.save else ""
        print(f"meshlm: stopped on {t.exit_signal} (--exit-signal-handler): every worker finished its "
              f"iteration{saved} and exited", flush=True)
    return 0
