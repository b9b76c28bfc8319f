"""Run a function in N CPU processes over gloo: the harness of every multi-process test.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises gloo (or NCCL)
through a TCPStore the caller serves, calls ``fn(rank, world_size, *args)`` in each and returns the list of their return
values (rank order). An exception in any worker fails the caller with that worker's traceback.
Return values must be picklable (move tensors to CPU; prefer plain floats/lists/tensors).

gloo workers are forked from one forkserver per test session that has already imported torch and
meshlm (``PRELOAD``): a worker starts in milliseconds instead of paying the ~2 s of imports a fresh
interpreter costs, and each test still gets processes of its own (nothing leaks between tests: the
server itself never runs a torch op, initialises a process group or touches CUDA). NCCL workers
are spawned, so that CUDA starts in a clean process.

The store is bound by the caller on a port the OS picks (port 0) before any worker starts and every
rank is its client: a port chosen free and bound later by rank 0 could be taken in between by another
test of the parallel suite (EADDRINUSE), and ranks then reached another test's store.

A hang fails the test at once with every worker's stacks (one held CI for ten minutes and showed
nothing): a worker still running ``timeout_s`` seconds after the start (default ``DEFAULT_TIMEOUT_S``
of the backend, or the environment's MESHLM_TEST_TIMEOUT_S) and each of its data-loader processes,
which inherit the handler, are sent ``STACKS_SIGNAL``, on which faulthandler writes the Python stack
of each of their threads to a file; then they are killed, and the AssertionError holds the stacks.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# torch._dynamo: torch.utils.checkpoint (meshlm's recompute) imports it on its first call (~2-4 s of CPU
# in every rank of every recompute case); imported here once, each forked worker has it for nothing
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshlm.training.trainer", "meshlm.checkpoint.convert",
           "meshlm.training.generate", "distributed", "parity"]
# how long one run_distributed call may take: the longest CPU one (compiled, a cold Inductor cache) takes
# under a minute on 2 busy cores; GPU tests compile larger graphs
DEFAULT_TIMEOUT_S = {"gloo": 240.0, "nccl": 600.0}
TIMEOUT_ENV = "MESHLM_TEST_TIMEOUT_S"
STACKS_SIGNAL = signal.SIGRTMIN + 4  # faulthandler's dump; SIGUSR1/2 are --exit-signal choices tests send
STACKS_CHARS = 12000  # of each worker's dumps in the failure message (the end: its own, after its children's)


def _context(backend: str):
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _free_port() -> int:
    """A port free now, for a launcher or cluster the test starts (it may be taken before they bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, outdir, backend):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result_path = os.path.join(outdir, f"{rank}.pt")
    stacks = open(os.path.join(outdir, f"{rank}.stacks"), "a")  # its data-loader processes inherit both
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(minutes=10))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        torch.save({"ok": out}, result_path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, result_path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _descendants(pid: int) -> list:
    """pid's child processes, each followed by its own (Linux /proc); [] once pid has gone."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                children = [int(c) for c in fh.read().split()]
        except OSError:
            continue
        for c in children:
            found += [c] + _descendants(c)
    return found


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _dump(pid: int, path: str, what: str, wait_s: float = 2.0) -> None:
    """Have process pid write its threads' stacks into path (faulthandler, ``STACKS_SIGNAL``) under a
    header line, and wait until the file stops growing (wait_s at most: a process that does not run)."""
    with open(path, "a") as fh:
        fh.write(f"--- pid {pid} ({what}):\n")
    start = last = os.path.getsize(path)
    _signal([pid], STACKS_SIGNAL)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        time.sleep(0.05)
        now = os.path.getsize(path)
        if start < now == last:
            break
        last = now


def _hung(procs: list, outdir: str, timeout_s: float) -> dict:
    """{rank: failure line} of the workers still running after ``timeout_s``: the Python stacks of
    each one's threads, and of its data-loader processes before them, written one process at a time
    on ``STACKS_SIGNAL``; then all of them killed (none before every dump is in: a peer's death would
    move a waiting rank on)."""
    trees = {r: [p.pid] + _descendants(p.pid) for r, p in enumerate(procs) if p.is_alive()}
    saved = {r for r in trees if os.path.exists(os.path.join(outdir, f"{r}.pt"))}
    dumps = {}
    for r, (pid, *children) in trees.items():
        path = os.path.join(outdir, f"{r}.stacks")
        if not os.path.exists(path):  # it had not started ``_worker``: nothing handles the signal
            dumps[r] = "(none: it had not started)"
            continue
        for child in children:
            _dump(child, path, f"a child process of rank {r}")
        _dump(pid, path, f"rank {r}")
        with open(path) as fh:
            dumps[r] = fh.read()[-STACKS_CHARS:]
    for pids in trees.values():
        _signal(pids, signal.SIGKILL)
    lines = {}
    for r, pids in trees.items():
        procs[r].join()
        after = " (its result was saved: it hung on the way out)" if r in saved else ""
        lines[r] = f"rank {r}: still running after {timeout_s:g} s{after}, killed; its stacks:\n{dumps[r]}"
    return lines


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float | None = None):
    """Spawn world_size processes running fn(rank, world_size, *args); return their results.

    backend "nccl": rank r uses GPU r (the GPU tests). timeout_s: how long the workers may run
    (default the environment's MESHLM_TEST_TIMEOUT_S, else ``DEFAULT_TIMEOUT_S``); past it the call
    fails with their stacks (module doc)."""
    timeout_s = float(timeout_s or os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S[backend])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    with tempfile.TemporaryDirectory() as outdir:
        ctx = _context(backend)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, outdir, backend))
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = _hung(procs, outdir, timeout_s)
        results, errors = [], list(hung.values())
        for r, p in enumerate(procs):
            if r in hung:
                continue
            path = os.path.join(outdir, f"{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited with code {p.exitcode} and no result")
                continue
            res = torch.load(path, weights_only=False)
            if "error" in res:
                errors.append(f"rank {r}:\n{res['error']}")
            else:
                results.append(res["ok"])
        if errors:
            raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
        return results
