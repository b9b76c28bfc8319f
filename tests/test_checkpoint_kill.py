"""kill -9 of a worker at 20 random moments during saves never leaves an incomplete checkpoint as
the latest, and the run resumes from the previous complete one.

Each trial forks two gloo workers (from a forkserver that has torch imported, so a trial costs
milliseconds) that resume from the save folder and then save every iteration with
``--keep-checkpoints 2``. One worker, chosen at random, SIGKILLs itself at the N-th call (N random)
of the operations a save is made of: DCP's data and metadata writes, fsync, makedirs, rename,
rmtree, the gather of the file hashes and the barriers. The test then kills the survivor (as
torchrun tears a job down), and checks that the tracker names a checkpoint whose every file
matches its manifest's SHA-256; the next trial must resume from exactly that one.
"""

import multiprocessing as mp
import os
import random
import shutil
import signal

import pytest
import torch

from meshlm.checkpoint import dist as ckpt
from meshlm.checkpoint import manifest

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

TRIALS = 20
SAVES_PER_TRIAL = 3


def _state(iteration: int, rank: int) -> dict:
    return {"model": {"w": torch.full((8, 4), float(iteration))},
            ckpt.rank_key("optimizer", rank): {"m": torch.full((16,), iteration + rank / 10)},
            "train": {"iteration": iteration}}


def _kill_at(n: int, marker: str) -> None:
    """Make this process SIGKILL itself at the n-th call of a save's building blocks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    calls = [0]

    def counted(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[0] += 1
            if calls[0] == n:
                with open(marker, "w") as fh:
                    fh.write(name)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(owner, name, wrapper)

    for owner, name in ((os, "fsync"), (os, "makedirs"), (os, "replace"), (shutil, "rmtree"),
                        (dist, "barrier"), (dist, "gather_object"), (FileSystemWriter, "write_data"),
                        (FileSystemWriter, "finish")):
        counted(owner, name)


def _worker(rank: int, init_file: str, root: str, kill: tuple, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        it, loaded = ckpt.load(root) if ckpt.read_tracker(root) is not None else (0, None)
    except Exception as e:  # noqa: BLE001 — reported to the parent as a failed resume
        with open(f"{out}.{rank}", "w") as fh:
            fh.write(f"resume failed: {e}")
        raise
    resumed_ok = loaded is None or (torch.equal(loaded["model"]["w"], _state(it, rank)["model"]["w"])
                                    and torch.equal(loaded["optimizer"]["m"],  # this rank's own subtree
                                                    _state(it, rank)[ckpt.rank_key("optimizer", rank)]["m"]))
    with open(f"{out}.{rank}", "w") as fh:
        fh.write(f"{it} {int(resumed_ok)}")
    dist.barrier()  # both have resumed before any kill
    victim, n = kill
    if rank == victim:
        _kill_at(n, f"{out}.killed")
    for step in range(it + 1, it + 1 + SAVES_PER_TRIAL):
        ckpt.save(root, step, _state(step, rank), keep=2)
    dist.destroy_process_group()


def _latest_is_complete(root: str):
    """The tracker's iteration, after checking every file of its folder against the manifest."""
    it = ckpt.read_tracker(root)
    if it is None:
        return None
    path = ckpt.checkpoint_dir(root, it)  # raises unless manifest, .metadata and sizes are right
    assert manifest.problems(path, ckpt.read_manifest(path)["files"], checksums=True) == []
    return it


def test_kill_9_during_saves_never_leaves_an_incomplete_latest(tmp_path):
    rng = random.Random(1234)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "meshlm.checkpoint.dist"])
    root = str(tmp_path / "save")
    latest, phases, resumed_from = None, set(), []
    for trial in range(TRIALS + 1):  # the last trial is not killed: the run goes on to the end
        kill = (rng.randrange(2), rng.randint(1, 12 * SAVES_PER_TRIAL)) if trial < TRIALS else (-1, 0)
        out = str(tmp_path / f"trial{trial}")
        procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / f"init{trial}"), root, kill, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        if trial < TRIALS:
            procs[kill[0]].join(timeout=60)
            assert procs[kill[0]].exitcode in (-signal.SIGKILL, 0), procs[kill[0]].exitcode
            for p in procs:  # the job dies with its worker (torchrun's teardown)
                p.kill()
        for p in procs:
            p.join(timeout=60)
        for r in range(2):
            started = open(f"{out}.{r}").read()
            assert started == f"{latest or 0} 1", (trial, r, started, latest)  # resumed the latest, intact
        resumed_from.append(latest or 0)
        if os.path.exists(f"{out}.killed"):
            phases.add(open(f"{out}.killed").read())
        now = _latest_is_complete(root)
        assert now is None and latest is None or now >= (latest or 0)
        latest = now
        assert len(ckpt.complete_iterations(root)) <= 3  # keep=2, plus at most one renamed before its prune
    assert procs[0].exitcode == 0 and procs[1].exitcode == 0
    assert latest == resumed_from[-1] + SAVES_PER_TRIAL
    assert len(phases) >= 5, phases  # the kills hit many different parts of a save
    assert len(set(resumed_from)) >= 5, resumed_from  # some kills landed after a tracker moved
