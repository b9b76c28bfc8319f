"""checkpoint.dist: layout, round trip, atomicity, refusal to unpickle, clear errors."""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from distributed import run_distributed
from meshlm.checkpoint import dist as ckpt
from meshlm.errors import CheckpointError


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "model": {"layers.0.weight": torch.arange(6.0).view(2, 3), "layers.1.bias": torch.ones(4)},
        f"optimizer/rank{rank}": {"state": {0: {"exp_avg": torch.randn(3, generator=g), "step": 7}},
                                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "name": None}]},
        "train": {"consumed_samples": 96 + rank},
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_layout_and_round_trip_single_process(tmp_path):
    state = _state(0)
    path = ckpt.save(str(tmp_path), 100, state, layout={"tp": 1}, config={"model": {"hidden_size": 8}})
    assert path == str(tmp_path / "iter_0000100")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "100"
    assert {"checkpoint.json", "config.json", ".metadata", "rank_00000.json"} <= set(os.listdir(path))
    iteration, loaded = ckpt.load(str(tmp_path), layout={"tp": 1})
    assert iteration == 100
    _assert_same(state, {k: loaded[k] for k in state})  # int dict keys and tuples survive as keys/lists
    assert loaded[f"optimizer/rank0"]["state"][0]["step"] == 7


def _save_then_load(rank, world, root):
    ckpt.save(root, 5, _state(rank), layout={"dp": world})
    it, loaded = ckpt.load(root, layout={"dp": world})
    return it, loaded


def test_each_rank_gets_its_own_state_back_over_gloo(tmp_path):
    results = run_distributed(_save_then_load, 2, str(tmp_path))
    for rank, (it, loaded) in enumerate(results):
        assert it == 5
        _assert_same(_state(rank), loaded)


def test_crash_before_tracker_moves_keeps_previous_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    ckpt.save(root, 10, {"w": torch.zeros(3)})
    real_replace = os.replace

    def crash_on_tracker(src, dst):
        if str(dst).endswith(ckpt.TRACKER):
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_tracker)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, 20, {"w": torch.ones(3)})
    monkeypatch.undo()
    it, loaded = ckpt.load(root)
    assert it == 10 and torch.equal(loaded["w"], torch.zeros(3))


def test_crash_mid_write_leaves_only_a_tmp_folder(tmp_path, monkeypatch):
    root = str(tmp_path)
    ckpt.save(root, 10, {"w": torch.zeros(3)})

    def killed(*a, **k):
        raise KeyboardInterrupt("killed during write")

    monkeypatch.setattr(ckpt.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, 20, {"w": torch.ones(3)})
    monkeypatch.undo()
    assert not os.path.exists(ckpt.iteration_dir(root, 20))
    assert ckpt.load(root)[0] == 10
    ckpt.save(root, 20, {"w": torch.ones(3)})  # the stale .tmp folder does not block a new save
    assert ckpt.load(root)[0] == 20


def test_loading_never_unpickles(tmp_path, monkeypatch):
    ckpt.save(str(tmp_path), 3, {"w": torch.randn(4, 2), "meta": {"note": "x"}})

    def forbidden(*a, **k):
        raise AssertionError("pickle.load called while loading a checkpoint")

    real_torch_load = torch.load

    def weights_only_load(*a, **k):
        assert k.get("weights_only") is True, "torch.load without weights_only=True"
        return real_torch_load(*a, **k)

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", weights_only_load)
    it, loaded = ckpt.load(str(tmp_path))
    assert it == 3 and loaded["meta"] == {"note": "x"} and loaded["w"].shape == (4, 2)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_with_a_foreign_class_is_refused(tmp_path):
    ckpt.save(str(tmp_path), 1, {"w": torch.zeros(2)})
    with open(tmp_path / "iter_0000001" / ".metadata", "wb") as fh:
        pickle.dump(Evil(), fh)
    with pytest.raises(CheckpointError, match="posix.system|os.system|not allowed"):
        ckpt.load(str(tmp_path))


def test_missing_or_incomplete_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        ckpt.load(str(tmp_path))
    ckpt.save(str(tmp_path), 7, {"w": torch.zeros(2)})
    os.remove(tmp_path / "iter_0000007" / ".metadata")
    with pytest.raises(CheckpointError, match="iter_0000007"):
        ckpt.load(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        ckpt.load(str(tmp_path))


def test_other_layout_is_refused_with_a_clear_error(tmp_path):
    ckpt.save(str(tmp_path), 2, {"w": torch.zeros(2)}, layout={"tp": 2, "pp": 1})
    with pytest.raises(CheckpointError, match="resharding"):
        ckpt.load(str(tmp_path), layout={"tp": 1, "pp": 1})


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    ckpt.save(str(tmp_path), 1, {"rng": ckpt.rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1))
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    ckpt.set_rng_state(ckpt.load(str(tmp_path))[1]["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1)) == expected
