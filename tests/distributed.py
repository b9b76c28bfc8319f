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
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# torch._dynamo: torch.utils.checkpoint (meshlm's recompute) imports it on its first call (~2-4 s of CPU
# in every rank of every recompute case); imported here once, each forked worker has it for nothing
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshlm.training.trainer", "meshlm.checkpoint.convert",
           "meshlm.training.generate", "distributed", "parity"]


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


def run_distributed(fn, world_size: int, *args, backend: str = "gloo"):
    """Spawn world_size processes running fn(rank, world_size, *args); return their results.

    backend "nccl": rank r uses GPU r (the GPU tests)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    with tempfile.TemporaryDirectory() as outdir:
        ctx = _context(backend)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, outdir, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        results, errors = [], []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
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
