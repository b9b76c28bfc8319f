"""--async-save (checkpoint/async_save.py): the files of a background save equal a synchronous save's
of the same step although the optimizer steps while they are written; the loop is blocked for far
less than the write; one save in flight; an exact resume; a writer's failure is one line on every
rank, never a hang.

The writer is made slow or held back by patching DCP's FileSystemWriter.write_data in the workers,
so that training steps provably run while the files are written. Tiny GPT on --mock-data over gloo,
float64 (tests/test_trainer.py's config).
"""

import json
import os
import threading
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from distributed import run_distributed
from meshlm.checkpoint import dist as ckpt
from meshlm.checkpoint.safe_read import SafeReader
from test_trainer import F64, _rel, tiny_config

SLOW = 1.5  # seconds a slowed write_data takes


def _config(tmp, name, *, background, zero=False, save_interval=None, **training):
    cfg = tiny_config(os.path.join(tmp, "run"), **training)
    cfg.parallel.use_distributed_optimizer = zero
    cfg.checkpoint.save, cfg.checkpoint.save_interval = os.path.join(tmp, name), save_interval
    cfg.checkpoint.async_save = background
    return cfg


def _patched(owner, name, replacement):
    """Set ``owner.name`` to ``replacement(original)``; return a function that puts it back."""
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    return lambda: setattr(owner, name, original)


def _patch_write_data(before):
    """Make every DCP file write call ``before()`` first (in this process)."""
    return _patched(FileSystemWriter, "write_data",
                    lambda write_data: lambda self, plan, planner: (before(), write_data(self, plan, planner))[1])


def _steps(run, state, n):
    from meshlm.training import trainer
    return [trainer.train_step(run, state) for _ in range(n)]


def _blocked_ms(log_dir):
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return {(r["iteration"], r["async_save"]): r["save_blocked_ms"] for r in rows if "save_blocked_ms" in r}


# ----------------------------------------------------------------------------- same files, pre-step values

def _sync_then_async_racing_the_optimizer(rank, world, tmp):
    """Two identical ZeRO-1 runs save at step 2, synchronously and in the background; the second's
    writer is held back until two more optimizer steps have changed every saved tensor in place."""
    from meshlm.training import trainer
    run = trainer.build(_config(tmp, "sync", background=False, zero=True), F64)
    state = trainer.TrainState()
    _steps(run, state, 2)
    trainer.save_checkpoint(run, state)

    run = trainer.build(_config(tmp, "async", background=True, zero=True), F64)
    state = trainer.TrainState()
    _steps(run, state, 2)
    gate = threading.Event()
    restore = _patch_write_data(lambda: gate.wait(60))
    try:
        trainer.save_checkpoint(run, state)
        before = [p.detach().clone() for c in run.chunks for p in c.parameters()]
        _steps(run, state, 2)  # the optimizer changes the live model and state while the write waits
        changed = all(not torch.equal(a, p) for a, p in zip(before, (p for c in run.chunks for p in c.parameters())))
        pending = not os.path.exists(ckpt.iteration_dir(run.cfg.checkpoint.save, 2))
        gate.set()
        done = run.saver.wait()
    finally:
        restore()
    return {"changed": changed, "pending_while_stepping": pending, "done": done}


def test_async_save_writes_the_sync_save_s_files_though_the_optimizer_steps_during_the_write(tmp_path):
    results = run_distributed(_sync_then_async_racing_the_optimizer, 2, str(tmp_path))
    for r in results:
        assert r["changed"] and r["pending_while_stepping"]
        assert r["done"] == ckpt.iteration_dir(str(tmp_path / "async"), 2)
    sync, background = (ckpt.checkpoint_dir(str(tmp_path / name)) for name in ("sync", "async"))
    keys = sorted(SafeReader(sync).read_metadata().state_dict_metadata)
    assert keys == sorted(SafeReader(background).read_metadata().state_dict_metadata)
    assert any("exp_avg_sq" in k for k in keys) and any(k.startswith("model/") for k in keys)
    a, b = ckpt.read_tensors(sync, keys), ckpt.read_tensors(background, keys)
    differ = [k for k in keys if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]
    names = sorted(os.listdir(sync))
    assert names == sorted(os.listdir(background))
    for name in (n for n in names if n.endswith(".json")):
        x, y = (json.load(open(os.path.join(folder, name))) for folder in (sync, background))
        if name == ckpt.CONFIG:  # the flags that differ between the two runs
            for c in (x, y):
                del c["checkpoint"]["save"], c["checkpoint"]["async_save"]
        if name == ckpt.MANIFEST:  # hashes of config.json (those flags) and .metadata (its own paths)
            assert sorted(x.pop("files")) == sorted(y.pop("files"))
        assert x == y, name


# ----------------------------------------------------------------------------- the loop is not blocked

def _timed_saves(rank, world, tmp):
    from meshlm.training import trainer
    restore = _patch_write_data(lambda: time.sleep(SLOW))
    try:
        out = {}
        for background in (False, True):
            cfg = _config(tmp, f"ckpt-{background}", background=background)
            cfg.logging.log_dir = os.path.join(tmp, f"logs-{background}")
            run = trainer.build(cfg, F64)
            state = trainer.TrainState()
            _steps(run, state, 1)
            start = time.perf_counter()
            trainer.save_checkpoint(run, state)
            _steps(run, state, 2)
            stepped = time.perf_counter() - start
            if run.saver:
                run.saver.wait()
            out[background] = {"stepped_s": stepped, "written_s": time.perf_counter() - start,
                               "blocked_ms": _blocked_ms(cfg.logging.log_dir)[(1, background)]}
        return out
    finally:
        restore()


@pytest.mark.slow
def test_the_loop_trains_while_a_slow_write_goes_on_and_is_blocked_far_less_than_a_sync_save(tmp_path):
    (out,) = run_distributed(_timed_saves, 1, str(tmp_path))
    sync, background = out[False], out[True]
    assert sync["blocked_ms"] >= 1000 * SLOW
    assert background["blocked_ms"] < 1000 * SLOW / 5, background
    assert background["stepped_s"] < SLOW <= background["written_s"]  # two steps done during the write


# ----------------------------------------------------------------------------- one save in flight

def _every_iteration_saved_slowly(rank, world, tmp):
    from meshlm.training import trainer
    events, active, most = [], [0], [0]

    def slow():
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.3)
        active[0] -= 1

    restores = [_patched(ckpt, "finalize", lambda finalize: lambda root, iteration, *a, **kw:
                         (events.append(iteration), finalize(root, iteration, *a, **kw))[1]), _patch_write_data(slow)]
    try:
        cfg = _config(tmp, "ckpt", background=True, iters=4, save_interval=1, eval_interval=100)
        summary = trainer.pretrain(cfg, F64)
    finally:
        for restore in restores:
            restore()
    return {"most": most[0], "finalized": events, "last": summary["last_checkpoint"]}


def test_at_most_one_save_is_in_flight_and_each_is_finalised_in_order(tmp_path):
    (r,) = run_distributed(_every_iteration_saved_slowly, 1, str(tmp_path))
    root = tmp_path / "ckpt"
    assert r["most"] == 1 and r["finalized"] == [1, 2, 3, 4]
    assert r["last"] == ckpt.iteration_dir(str(root), 4)
    assert ckpt.read_tracker(str(root)) == 4 and ckpt.complete_iterations(str(root)) == [3, 4]  # --keep-checkpoints 2
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")]


# ----------------------------------------------------------------------------- exact resume

def _full_interrupted_resumed(rank, world, tmp):
    from meshlm.training import trainer
    cfg = _config(tmp, "unused", background=False, zero=True, iters=4)
    cfg.checkpoint.save = None
    full = trainer.pretrain(cfg, F64)
    first = trainer.pretrain(_config(tmp, "ckpt", background=True, zero=True, iters=4, save_interval=1,
                                     exit_interval=2), F64)
    cfg = _config(tmp, "ckpt", background=True, zero=True, iters=4, save_interval=1)
    cfg.checkpoint.load = cfg.checkpoint.save
    resumed = trainer.pretrain(cfg, F64)
    return full, first, resumed, _blocked_ms(cfg.logging.log_dir)


def test_a_run_saved_in_the_background_resumes_exactly(tmp_path):
    """ZeRO-1 over DP=2, saved in the background at every iteration, stopped after 2 (--exit-interval:
    the last save is waited for), resumed to 4: the losses of the uninterrupted run (float64)."""
    full, first, resumed, blocked = run_distributed(_full_interrupted_resumed, 2, str(tmp_path))[0]
    assert first["iterations"] == 2 and first["last_checkpoint"] == ckpt.iteration_dir(str(tmp_path / "ckpt"), 2)
    assert len(resumed["train_losses"]) == 2
    for a, b in zip(first["train_losses"] + resumed["train_losses"], full["train_losses"]):
        assert _rel(a, b) < 1e-12, (a, b)
    assert full["train_losses"][0] != full["train_losses"][-1]
    assert sorted(blocked) == [(i, True) for i in (1, 2, 3, 4)]  # metrics.jsonl: one record per save
    assert ckpt.read_tracker(str(tmp_path / "ckpt")) == 4


# ----------------------------------------------------------------------------- failures: one line, no hang

def _failing_writers(rank, world, tmp):
    from meshlm.checkpoint.async_save import Staging
    from meshlm.errors import CheckpointError
    from meshlm.training import trainer

    def disk_full(write_data):
        def write(self, plan, planner):
            if rank == 1:
                raise OSError(28, "No space left on device")
            return write_data(self, plan, planner)
        return write

    def refused(finalize):
        def final(root, iteration, *a, **kw):
            if rank == 0:
                raise PermissionError(13, "Permission denied", root)
            return finalize(root, iteration, *a, **kw)
        return final

    def no_memory(copy):
        def copied(self, state):
            if rank == 1:
                raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
            return copy(self, state)
        return copied

    import shutil
    real_usage = shutil.disk_usage  # each rank reads its own free space: the message must still be one line
    shutil.disk_usage = lambda path: real_usage(path)._replace(free=10 ** 9 + rank)
    messages = []
    for name, iters, owner, attr, failing in (("write", 4, FileSystemWriter, "write_data", disk_full),
                                              ("finalize", 2, ckpt, "finalize", refused),
                                              ("copy", 2, Staging, "copy", no_memory)):
        cfg = _config(tmp, name, background=True, iters=iters, save_interval=2 if name == "write" else None)
        cfg.parallel.distributed_timeout_minutes = 1  # a hang would fail within a minute
        restore = _patched(owner, attr, failing)
        try:
            trainer.pretrain(cfg, F64)
            messages.append(None)
        except CheckpointError as e:
            messages.append(str(e))
        finally:
            restore()
    return messages


def test_a_failing_writer_stops_every_rank_with_one_line_at_the_next_save_or_the_end(tmp_path):
    """rank 1 cannot write iteration 2's files: both ranks stop at the next save (iteration 4);
    rank 0 alone cannot finalise the last save: both ranks stop at the end of training; rank 1
    cannot copy its state to host memory: both ranks stop at that save."""
    (write0, final0, copy0), (write1, final1, copy1) = run_distributed(_failing_writers, 2, str(tmp_path))
    assert write0 == write1 and final0 == final1 and copy0 == copy1
    for message in (write0, final0, copy0):
        assert message and "\n" not in message and message.startswith("--async-save: the ")
    assert "iteration 2 " in write0 and "rank 1: OSError" in write0 and "No space left on device" in write0
    assert "; 1,000,000,000 bytes free there" in write0  # rank 0's reading on both ranks
    assert "iteration 2 " in final0 and "rank 0: PermissionError" in final0
    assert "host memory (rank 1: RuntimeError: CUDA error: out of memory" in copy0
    for name in ("write", "finalize", "copy"):
        assert ckpt.read_tracker(str(tmp_path / name)) is None
        assert ckpt.complete_iterations(str(tmp_path / name)) == []
