"""Several nodes, as torchrun runs them: two "nodes" (two torchrun agents on 127.0.0.1, c10d
rendezvous, 2 workers each, node ranks assigned by the rendezvous) train as one node of 4 does, each
node building the sample indices in its own --data-cache-path; and an elastic job (--nnodes 1:2)
that loses a node goes on at 2 workers from the 4-worker checkpoint, resharded to DP=1 with the
global batch kept (gradient accumulation 2 → 4).

Every job trains the same float64 model (tests/kill_once.py FLOAT64=1) at TP=2 on real .bin/.idx
data (NullTokenizer): DP=2 on 4 workers, DP=1 on 2."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distributed import _free_port
from meshlm.checkpoint import dist as ckpt
from meshlm.checkpoint.safe_read import SafeReader
from meshlm.data.indexed import IndexedDatasetWriter
from test_launch import clean_env
from test_restart import ENTRY, NO_SHARED_STORE, attempts, torchrun, trajectory

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

ITERS, SAVE_EVERY, VOCAB = 8, 2, 128
SHAPE = ["--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--tensor-model-parallel-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0",
         "--split", "1,0,0", "--num-workers", "0", "--distributed-timeout-minutes", "2"]
FLOAT64 = {"FLOAT64": "1"}


def _argv(data, cache, **flags):
    flags = {"train_iters": ITERS, "run_dir": "run", "save": "ckpt", "load": "ckpt", "save_interval": SAVE_EVERY,
             **flags}
    return [*SHAPE, "--data-path", str(data), "--data-cache-path", str(cache),
            *[x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(str(folder / "text"), np.uint16)
    for _ in range(60):
        writer.add_document(rng.integers(0, VOCAB - 1, rng.integers(5, 40)))
    writer.finalize()
    return folder / "text"


@pytest.fixture(scope="module")
def one_node(data, tmp_path_factory):
    """The uninterrupted 4-worker run on one node (torchrun --standalone)."""
    cwd = tmp_path_factory.mktemp("one_node")
    out = torchrun(cwd, ["--standalone", "--nproc-per-node", "4"], _argv(data, cwd / "cache"), **FLOAT64)
    assert out.returncode == 0, out.stdout + out.stderr
    return cwd


def _node(cwd, port, argv, nnodes="2", conf="", restarts=0):
    """One node's torchrun agent (c10d rendezvous at 127.0.0.1:port, no --node-rank), started in a
    session of its own; a Popen."""
    launch = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "nodes-test", "--max-restarts", str(restarts), "--monitor-interval",
              "0.1", *(["--rdzv-conf", conf] if conf else [])]
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, ENTRY, "pretrain", *argv],
                            cwd=cwd, env=clean_env(OMP_NUM_THREADS="1", **NO_SHARED_STORE, **FLOAT64),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _tensors(folder) -> dict:
    keys = [k for k, v in SafeReader(str(folder)).read_metadata().state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)]
    return ckpt.read_tensors(str(folder), keys)


def test_two_nodes_of_two_train_as_one_node_of_four_each_with_its_own_index_cache(data, one_node, tmp_path):
    port = _free_port()
    nodes = [_node(tmp_path, port, _argv(data, tmp_path / f"cache{n}")) for n in range(2)]
    for proc in nodes:
        code, out = _finish(proc)
        assert code == 0, out
    assert "world=4 TP=2 CP=1 DP=2 PP=1" in open(tmp_path / "run" / "logs" / "rank0.log").read()
    reference = trajectory(one_node / "run")
    assert len(reference) == ITERS
    assert trajectory(tmp_path / "run") == reference  # exact: the same ranks compute the same sums
    final = ckpt.iteration_dir("ckpt", ITERS)
    ours, theirs = _tensors(tmp_path / final), _tensors(one_node / final)
    assert ours.keys() == theirs.keys() and any(k.startswith("model") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    index_files = sorted(n for n in os.listdir(one_node / "cache") if "GPTDataset" in n)  # not the token-id range
    assert len(index_files) == 4  # the train split's three indices and their description
    for n in range(2):  # the node of global rank 0 built its cache first, the other node its own
        assert sorted(m for m in os.listdir(tmp_path / f"cache{n}") if "GPTDataset" in m) == index_files
        for name in index_files:
            assert (tmp_path / f"cache{n}" / name).read_bytes() == (one_node / "cache" / name).read_bytes()


def _descendants(pid: int) -> list:
    """pid and every process below it (from /proc), parents first."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                children.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _kill_node(proc) -> None:
    """SIGKILL a node: its torchrun agent first (so it restarts nothing), then its workers."""
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


def _wait_for_checkpoint(root, iteration, proc, timeout=180):
    tracker, deadline = root / ckpt.TRACKER, time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if tracker.exists() and tracker.read_text().strip() and int(tracker.read_text()) >= iteration:
            return int(tracker.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of iteration ≥ {iteration} in {root}")


def test_a_node_leaving_an_elastic_job_leaves_the_other_training_on_from_the_resharded_checkpoint(
        data, one_node, tmp_path):
    port = _free_port()
    # the staying node hosts the rendezvous store (which dies with its host); the leaving node starts
    # first, so it is waiting for the store when the round opens; a dead node's keep-alive expires
    # in 3 s; a round of fewer than 2 nodes closes 5 s after the first node joined
    conf = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    argv = _argv(data, tmp_path / "cache", keep_checkpoints=ITERS)  # the resumed one stays, to copy
    leaving = _node(tmp_path, port, argv, "1:2", conf + ",is_host=0", restarts=1)
    staying = _node(tmp_path, port, argv, "1:2", conf + ",is_host=1", restarts=1)
    _wait_for_checkpoint(tmp_path / "ckpt", 4, staying)
    _kill_node(leaving)
    code, out = _finish(staying)
    assert code == 0, out
    (first, before), (resumed, after) = attempts(tmp_path / "run")
    log = open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert log.count("world=4 TP=2 CP=1 DP=2 PP=1") == 1 and log.count("world=2 TP=2 CP=1 DP=1 PP=1") == 1
    assert "global batch 8 = 4 micro-batches × 2 × DP 1" in log
    assert first == 0 and 4 <= resumed < ITERS and resumed % SAVE_EVERY == 0
    assert [int(line[0]) for line in before][:resumed] == list(range(1, resumed + 1))
    assert [int(line[0]) for line in after] == list(range(resumed + 1, ITERS + 1))  # on from the checkpoint
    reference, ours = trajectory(one_node / "run"), trajectory(tmp_path / "run")
    assert [r[:2] for r in ours] == [r[:2] for r in reference]  # every iteration, every sample position
    assert ours[:resumed] == reference[:resumed]  # the 4-worker attempt: exact
    # at DP=1 the four micro-batches' losses and gradients are summed in another order than at DP=2:
    # equal to rounding in float64, not bit for bit
    for (_, _, loss), (_, _, expected) in zip(ours[resumed:], reference[resumed:]):
        assert abs(loss - expected) <= 1e-10 * abs(expected)
    # bit for bit: a fresh 2-worker job (one node) resumed from a copy of that checkpoint
    fresh = tmp_path / "fresh"
    shutil.copytree(tmp_path / ckpt.iteration_dir("ckpt", resumed), fresh / ckpt.iteration_dir("ckpt", resumed))
    (fresh / "ckpt" / ckpt.TRACKER).write_text(f"{resumed}\n")
    again = torchrun(fresh, ["--standalone", "--nproc-per-node", "2"], _argv(data, tmp_path / "cache"), **FLOAT64)
    assert again.returncode == 0, again.stdout + again.stderr
    assert trajectory(fresh / "run") == ours[resumed:]
