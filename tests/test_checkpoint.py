"""checkpoint.dist, .boxes, .safe_read, .state: layout, round trip, resharding of boxes, atomicity,
refusal to unpickle, clear errors (the training-level resharding: test_checkpoint_reshard.py)."""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from distributed import run_distributed
from meshlm.checkpoint import dist as ckpt
from meshlm.checkpoint.boxes import Boxes, flat_boxes
from meshlm.checkpoint.state import check_model_config, full_model_state, rng_state, set_rng_state
from meshlm.errors import CheckpointError


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "model": {"layers.0.weight": torch.arange(6.0).view(2, 3), "layers.1.bias": torch.ones(4)},
        ckpt.rank_key("optimizer", rank): {"state": {0: {"exp_avg": torch.randn(3, generator=g), "step": 7}},
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
    iteration, loaded = ckpt.load(str(tmp_path))
    assert iteration == 100
    own = state.pop(ckpt.rank_key("optimizer", 0))
    _assert_same({**state, "optimizer": own}, loaded)  # int dict keys and tuples survive as keys/lists
    assert loaded["optimizer"]["state"][0]["step"] == 7


def test_load_reads_only_the_targets_tensors(tmp_path, monkeypatch):
    """--no-load-optim: the optimizer is left out of the targets and none of its tensors is read."""
    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {"exp_avg": torch.ones(3)}, "train": {"it": 1}}
    ckpt.save(str(tmp_path), 1, state)
    asked, read_into, read_tensors = [], ckpt.read_into, ckpt.read_tensors
    monkeypatch.setattr(ckpt, "read_into", lambda path, t: (asked.extend(t), read_into(path, t))[1])
    monkeypatch.setattr(ckpt, "read_tensors", lambda path, keys: (asked.extend(keys), read_tensors(path, keys))[1])
    target = {"model": {"w": torch.zeros(2, 3)}}
    _, loaded = ckpt.load(str(tmp_path), target)
    assert asked == ["model/w"] and loaded["optimizer"]["exp_avg"] is None and loaded["train"] == {"it": 1}
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def _save_then_load(rank, world, root):
    ckpt.save(root, 5, _state(rank), layout={"dp": world}, coords={"dp": rank})
    return ckpt.load(root), ckpt.load(root, coords={"dp": 1 - rank}), ckpt.load(root, coords={"dp": 2})


def test_per_rank_subtrees_come_from_the_matching_rank_and_the_rest_from_rank_0(tmp_path):
    results = run_distributed(_save_then_load, 2, str(tmp_path))
    for rank, ((it, own), (_, other), (_, nowhere)) in enumerate(results):
        assert it == 5
        _assert_same(own["optimizer"], _state(rank)[ckpt.rank_key("optimizer", rank)])
        _assert_same(other["optimizer"], _state(1 - rank)[ckpt.rank_key("optimizer", 1 - rank)])
        assert nowhere["optimizer"] is None
        assert own["train"] == other["train"] == {"consumed_samples": 96}  # shared values: rank 0's


FULL = torch.arange(30.0).view(10, 3)


def _save_pieces(rank, world, root):
    """Rank 0 holds rows 0-3 and 7-9 of FULL, rank 1 rows 4-6; both hold all of a replicated [4]."""
    pieces = [((0, 0), FULL[0:4]), ((7, 0), FULL[7:10])] if rank == 0 else [((4, 0), FULL[4:7].clone())]
    ckpt.save(root, 1, {"t": Boxes((10, 3), pieces), "r": Boxes((4,), [((0,), torch.ones(4))])})


def test_boxes_saved_by_some_ranks_load_into_any_other_boxes(tmp_path):
    run_distributed(_save_pieces, 2, str(tmp_path))
    buf = torch.zeros(5, 4)  # a target view that is not contiguous: columns 1..3
    targets = {"t": Boxes((10, 3), [((2, 0), buf[:, 1:]), ((0, 1), torch.zeros(2, 2)), ((7, 0), torch.zeros(3, 3))])}
    it, loaded = ckpt.load(str(tmp_path), targets)
    assert torch.equal(buf[:, 1:], FULL[2:7]) and torch.equal(buf[:, 0], torch.zeros(5))
    assert torch.equal(targets["t"].pieces[1][1], FULL[0:2, 1:3])
    assert torch.equal(targets["t"].pieces[2][1], FULL[7:10])
    assert loaded["t"] is targets["t"] and loaded["r"] is None  # "r" was not asked for
    assert torch.equal(ckpt.read_tensors(ckpt.iteration_dir(str(tmp_path), 1), ["t"])["t"], FULL)


def test_a_tensor_loads_into_a_target_of_another_dtype(tmp_path):
    """Adam moments saved in fp32 resume into bf16 ones (--exp-avg-dtype bf16, rounded to nearest)
    and bf16 into fp32 (exactly)."""
    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    ckpt.save(str(tmp_path), 1, {"a": x, "b": x.bfloat16()}, layout={}, config={})
    a, b = torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10)
    ckpt.load(str(tmp_path), {"a": a, "b": b})
    assert torch.equal(a, x.bfloat16()) and torch.equal(b, x.bfloat16().float())


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_flat_boxes_cover_a_flat_range_exactly_in_order(shape):
    n = int(np.prod(shape))
    full = torch.arange(n).view(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * (len(shape) - 1) + 1
            got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                             for off, size in boxes])
            assert torch.equal(got, torch.arange(lo, hi))


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


def plant(folder, name: str, data: bytes) -> None:
    """Write ``data`` as ``folder/name`` and fix the manifest's size and SHA-256 for it, as an
    attacker would, so that only the reader's own refusal can stop it."""
    import hashlib
    import json
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "checkpoint.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "checkpoint.json").write_text(json.dumps(manifest))


def test_metadata_with_a_foreign_class_is_refused(tmp_path):
    ckpt.save(str(tmp_path), 1, {"w": torch.zeros(2)})
    plant(tmp_path / "iter_0000001", ".metadata", pickle.dumps(Evil()))
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


def test_a_load_holding_only_an_unfinished_save_says_so(tmp_path):
    """A run killed during its first save leaves iter_XXXXXXX.tmp alone: --load named the folder
    "not a meshlm checkpoint directory", as if it were some other folder."""
    ckpt.save(str(tmp_path), 3, {"w": torch.zeros(2)})  # then as kill -9 before the rename leaves it
    os.rename(tmp_path / "iter_0000003", tmp_path / "iter_0000003.tmp")
    os.remove(tmp_path / "latest_checkpointed_iteration.txt")
    problems = ckpt.check_loadable(str(tmp_path))
    assert problems == [f"--load {tmp_path} holds only the unfinished save iter_0000003.tmp (its run stopped while "
                        f"writing it) (no latest_checkpointed_iteration.txt); point --load at a run's --save "
                        f"directory, or give --save {tmp_path} too to start fresh there"]


def test_a_checkpoint_of_the_older_format_is_refused_naming_it(tmp_path):
    path = ckpt.save(str(tmp_path), 2, {"w": torch.zeros(2)})
    manifest = ckpt.read_manifest(path)
    (tmp_path / "iter_0000002" / "checkpoint.json").write_text(
        __import__("json").dumps({**manifest, "format_version": 1}))
    for read in (lambda: ckpt.load(str(tmp_path)), lambda: full_model_state(path)):
        with pytest.raises(CheckpointError, match="has format 1, this meshlm reads format 2"):
            read()


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    ckpt.save(str(tmp_path), 1, {"rng": rng_state()})
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1))
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    set_rng_state(ckpt.load(str(tmp_path))[1]["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1)) == expected


# ----------------------------------------------------------------------------- damaged files: one line

def _truncate(file):
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])


def _same_size(file, text: str):
    """Overwrite ``file`` with ``text`` padded with spaces to its size (passes the manifest's size check)."""
    file.write_text(text.ljust(os.path.getsize(file)))


DAMAGE = {
    "missing .distcp": (lambda p: os.remove(p / "__0_0.distcp"), "__0_0.distcp is missing"),
    "truncated .distcp": (lambda p: _truncate(p / "__0_0.distcp"), "__0_0.distcp is truncated"),
    "rank JSON is '{'": (lambda p: _same_size(p / "rank_00000.json", "{"), "rank_00000.json is not valid JSON"),
    "rank JSON without state": (lambda p: _same_size(p / "rank_00000.json", "{}"), "'state'"),
    "shorter rank JSON": (lambda p: (p / "rank_00000.json").write_text("{}"), "rank_00000.json is truncated"),
    "manifest is '{'": (lambda p: (p / "checkpoint.json").write_text("{"), "checkpoint.json is not valid JSON"),
    "truncated .metadata": (lambda p: _truncate(p / ".metadata"), ".metadata is truncated"),
    "unreadable .distcp": (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * os.path.getsize(p / "__0_0.distcp")),
                           "a .distcp file is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_checkpoint_error_naming_load_and_iteration(tmp_path, damage):
    ckpt.save(str(tmp_path), 10, {"model": {"w": torch.randn(64, 64)}, "meta": {"note": "x"}}, config={"model": {}})
    damage_fn, reason = DAMAGE[damage]
    damage_fn(tmp_path / "iter_0000010")
    with pytest.raises(CheckpointError) as err:
        ckpt.load(str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and reason in msg
    assert msg.startswith(f"--load {tmp_path}: checkpoint iter_0000010 is damaged or incomplete (")
    assert msg.endswith("load an earlier iteration or re-save")
    if damage != "rank JSON without state":  # full_model_state (generate's path) reads the same files
        with pytest.raises(CheckpointError, match="iter_0000010 is damaged or incomplete"):
            full_model_state(str(tmp_path / "iter_0000010"))


def test_a_forbidden_class_in_metadata_is_still_refused_not_called_damage(tmp_path):
    ckpt.save(str(tmp_path), 1, {"w": torch.zeros(2)})
    plant(tmp_path / "iter_0000001", ".metadata", pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not allowed") as err:
        ckpt.load(str(tmp_path))
    assert "damaged" not in str(err.value)


# ----------------------------------------------------------------------------- --load before workers start

def test_check_loadable_names_what_is_wrong_with_load(tmp_path):
    save = tmp_path / "save"
    ckpt.save(str(save), 3, {"w": torch.zeros(2)})
    assert ckpt.check_loadable(str(save), None) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hi")
    assert ckpt.check_loadable(str(other), None) == [
        f"--load {other} is not a meshlm checkpoint directory (no latest_checkpointed_iteration.txt); "
        f"point --load at a run's --save directory, or give --save {other} too to start fresh there"]
    assert ckpt.check_loadable(str(other), str(other)) == []  # --load == --save: fresh start
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is empty" in ckpt.check_loadable(str(empty), str(save))[0]
    [problem] = ckpt.check_loadable(str(save / "iter_0000003"), None)
    assert "one checkpoint's folder" in problem and str(save) in problem
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert ckpt.check_loadable(str(save), None) == []  # iter_0000003 is loaded instead
    os.remove(save / "iter_0000003" / "checkpoint.json")
    [problem] = ckpt.check_loadable(str(save), None)
    assert "iteration 7" in problem and "iter_0000007 does not exist" in problem
    (save / "latest_checkpointed_iteration.txt").write_text("{")
    assert "expected an iteration number" in ckpt.check_loadable(str(save), None)[0]
    assert ckpt.check_loadable(str(tmp_path / "missing"), None) == []  # left to meshlm.validate


@pytest.mark.parametrize("command", [["checkpoint", "inspect", "{mg}"], ["generate", "--load", "{mg}"],
                                     ["convert", "--to-hf", "--load", "{mg}", "--output", "{out}"],
                                     ["convert", "--to-megatron", "--load", "{mg}", "--output", "{out}"]])
def test_a_megatron_save_folder_outside_pretrain_is_named_with_its_conversion(tmp_path, capsys, command):
    """Its tracker names an iter_ folder without meshlm's manifest: generate, inspect and the exports
    called it "damaged or incomplete (checkpoint.json is missing)" (pretrain named the conversion)."""
    from meshlm.cli import main
    mg = tmp_path / "mg"
    (mg / "iter_0000008").mkdir(parents=True)
    (mg / "iter_0000008" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (mg / "iter_0000008" / "common.pt").write_bytes(b"")
    (mg / "latest_checkpointed_iteration.txt").write_text("8")
    argv = [a.replace("{mg}", str(mg)).replace("{out}", str(tmp_path / "out")) for a in command]
    assert main(argv) == 2
    named = f"--load {mg}" if "--load" in command else str(mg)  # `checkpoint inspect DIR` has no --load
    assert capsys.readouterr().err.strip() == (
        f"meshlm: error: {named} is a Megatron-LM checkpoint, not a meshlm one; convert it first: meshlm "
        f"convert --from-megatron {mg} --output CKPT_DIR, then --load CKPT_DIR")


def test_a_run_directory_given_for_its_checkpoints_names_the_folder_that_holds_them(tmp_path, capsys):
    """The embedded default saves into <run dir>/checkpoints; `--load <run dir>` was told only that it
    is no checkpoint directory (pretrain, generate) or not a checkpoint (inspect)."""
    from meshlm.cli import main
    run = tmp_path / "run"
    ckpt.save(str(run / "checkpoints"), 3, {"w": torch.zeros(2)})
    (run / "config.yaml").write_text("x: 1\n")
    inner = run / "checkpoints"
    assert ckpt.check_loadable(str(run), None) == [
        f"--load {run} is not a checkpoint directory, but {inner} is: give --load {inner}"]
    assert main(["checkpoint", "inspect", str(run)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{inner} is: give that")


def test_a_lost_tracker_beside_complete_checkpoints_is_refused_naming_the_iteration(tmp_path):
    """A run whose tracker was lost must not restart from scratch over its own checkpoints."""
    save = tmp_path / "save"
    for it in (3, 6):
        ckpt.save(str(save), it, {"w": torch.zeros(2)})
    (save / "latest_checkpointed_iteration.txt").unlink()
    assert ckpt.complete_iterations(str(save)) == [3, 6]
    for load_problems in (ckpt.check_loadable(str(save), str(save)), ckpt.check_loadable(str(save), None)):
        [problem] = load_problems
        assert "iter_0000006" in problem and "write 6 into" in problem
    with pytest.raises(CheckpointError, match="write 6 into"):
        ckpt.checkpoint_dir(str(save))
    with pytest.raises(CheckpointError, match="no such directory"):
        ckpt.checkpoint_dir(str(tmp_path / "missing"))


# ----------------------------------------------------------------------------- another model

def _model(**kw):
    from meshlm.config import ModelConfig
    m = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_a_resume_of_another_model_is_refused_before_any_worker_starts(tmp_path):
    """`pretrain --dry-run --load CKPT --num-layers 2` of a 4-layer checkpoint passed: the model was
    compared with config.json only by the workers; validate (the launch and the dry run) names it."""
    from meshlm.config import Config
    from meshlm.errors import ConfigError
    from meshlm.validate import validate
    saved = Config()
    saved.model = _model()
    ckpt.save(str(tmp_path), 10, {"w": torch.zeros(2)}, config=saved.to_dict())
    cfg = Config()
    cfg.model = _model(num_layers=2)
    cfg.data.mock_data, cfg.checkpoint.load = True, str(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world=1)
    assert any("is of another model: --num-layers saved=4 now=2" in p for p in err.value.problems), err.value
    cfg.model = _model()  # the same model: no problem
    validate(cfg, world=1)
    cfg.model, cfg.checkpoint.finetune = _model(num_layers=2), True  # --finetune: the workers compare tensors
    validate(cfg, world=1)


def test_a_resume_with_another_lr_schedule_is_refused_before_any_worker_starts(tmp_path):
    """`pretrain --dry-run --load CKPT --lr 1e-3` of a checkpoint trained at --lr 6e-4 passed: only the
    workers compared the schedule, after building the model; validate (the launch and the dry run) names it."""
    from meshlm.config import Config
    from meshlm.errors import ConfigError
    from meshlm.optim.schedule import scheduler_for
    from meshlm.validate import validate
    saved = Config()
    saved.model, saved.data.mock_data, saved.training.train_iters = _model(), True, 4
    ckpt.save(str(tmp_path), 4, {"w": torch.zeros(2), "scheduler": scheduler_for(saved, 1).state_dict()},
              config=saved.to_dict())
    cfg = Config.from_dict(saved.to_dict())
    cfg.checkpoint.load = str(tmp_path)
    validate(cfg, world=1)  # the same schedule: no problem
    cfg.optimizer.lr = 1e-3
    with pytest.raises(ConfigError) as err:
        validate(cfg, world=1)
    assert err.value.problems == [f"--load {tmp_path}: the checkpoint's LR schedule differs from this run's: --lr "
                                  f"saved=0.0006 now=0.001; pass --override-opt_param-scheduler to use this run's "
                                  f"settings from here on, or --use-checkpoint-opt_param-scheduler to keep the "
                                  f"checkpoint's (as Megatron-LM)"]
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "no_load_optim", "finetune"):
        setattr(cfg.checkpoint, flag, True)  # the schedule is not compared (or not loaded): the run's own
        validate(cfg, world=1)
        setattr(cfg.checkpoint, flag, False)


def test_model_config_differences_are_listed_as_flags_in_one_line(tmp_path):
    from meshlm.config import Config
    cfg = Config()
    cfg.model = _model()
    ckpt.save(str(tmp_path), 10, {"w": torch.zeros(2)}, config=cfg.to_dict())
    path = str(tmp_path / "iter_0000010")
    # what may change on resume is not compared; an explicit value equal to the default is the same model
    check_model_config(path, _model(hidden_dropout=0.0, attention_dropout=0.3, init_method_std=0.1,
                                    ffn_hidden_size=128, kv_channels=8))
    with pytest.raises(CheckpointError) as err:
        check_model_config(path, _model(num_layers=2, num_attention_heads=8, normalization="RMSNorm",
                                        add_bias_linear=False), load=str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--load {tmp_path}: checkpoint iter_0000010")
    for diff in ("--num-layers saved=4 now=2", "--num-attention-heads saved=4 now=8",
                 "--normalization saved=LayerNorm now=RMSNorm", "--disable-bias-linear saved=False now=True",
                 "--kv-channels saved=8 now=4", "--num-query-groups saved=4 now=8"):
        assert diff in msg, diff
    with pytest.raises(CheckpointError, match="--position-embedding-type saved=learned_absolute now=rope"):
        check_model_config(path, _model(position_embedding_type="rope"))
    with pytest.raises(CheckpointError, match="--max-position-embeddings saved=16 now=32"):
        check_model_config(path, _model(seq_length=32))
    with pytest.raises(CheckpointError, match="--norm-epsilon saved=1e-05 now=1e-06"):  # was not compared
        check_model_config(path, _model(norm_epsilon=1e-6))
    cfg.model = _model(position_embedding_type="rope")  # partial rotary: same shapes, another function
    ckpt.save(str(tmp_path), 11, {"w": torch.zeros(2)}, config=cfg.to_dict())
    with pytest.raises(CheckpointError, match="--rotary-percent saved=1.0 now=0.5"):
        check_model_config(str(tmp_path / "iter_0000011"),
                           _model(position_embedding_type="rope", rotary_percent=0.5))


def test_model_config_check_without_config_json_is_damage(tmp_path):
    ckpt.save(str(tmp_path), 10, {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="iter_0000010 is damaged or incomplete \\(config.json is missing\\)"):
        check_model_config(str(tmp_path / "iter_0000010"), _model())


def test_targets_the_checkpoint_lacks_or_holds_at_another_shape_are_refused_before_copying(tmp_path):
    path = ckpt.save(str(tmp_path), 1, {"model": {"a": torch.ones(2, 3), "b": torch.ones(4)}})
    a, b = torch.zeros(2, 3), torch.zeros(5)
    with pytest.raises(CheckpointError) as err:
        ckpt.read_into(path, {"model/a": a, "model/b": b, "model/c": torch.zeros(1)})
    assert str(err.value) == (f"checkpoint {path} does not fit this run (has no tensor 1: model/c; has another "
                              f"shape (saved vs now) 1: model/b (4,) vs (5,)): was it saved with another model config?")
    assert not a.any()  # nothing copied by a refused load
    ckpt.read_into(path, {"model/a": a})
    assert torch.equal(a, torch.ones(2, 3))


def test_load_of_an_older_checkpoints_folder_says_its_parent_resumes_from_the_latest(tmp_path):
    """--load save/iter_0000003 was told to point at save, which resumes from iter_0000005 instead
    (Megatron's --ckpt-step, which picks one, is not supported): the hint says so and how to load 3."""
    save = tmp_path / "save"
    ckpt.save(str(save), 3, {"w": torch.zeros(2)})
    [latest] = ckpt.check_loadable(str(save / "iter_0000003"), None)
    assert "resumes from" not in latest  # the parent's latest is this one
    ckpt.save(str(save), 5, {"w": torch.ones(2)})
    [older] = ckpt.check_loadable(str(save / "iter_0000003"), None)
    assert "which resumes from its latest, iter_0000005, not this one" in older and "--ckpt-step" in older
    assert "write its iteration into latest_checkpointed_iteration.txt" in older and "\n" not in older


def test_a_swiglu_difference_is_named_once_not_as_a_gelu_form_of_none(tmp_path):
    """--swiglu against a GeLU checkpoint also printed 'GeLU saved=tanh now=None'."""
    from meshlm.config import Config
    cfg = Config()
    cfg.model = _model()
    ckpt.save(str(tmp_path), 10, {"w": torch.zeros(2)}, config=cfg.to_dict())
    with pytest.raises(CheckpointError) as err:
        check_model_config(str(tmp_path / "iter_0000010"), _model(swiglu=True))
    assert "--swiglu saved=False now=True" in str(err.value) and "GeLU" not in str(err.value)
    with pytest.raises(CheckpointError, match=r"GeLU saved=tanh now=exact"):  # a GeLU form against another stays
        check_model_config(str(tmp_path / "iter_0000010"), _model(bias_gelu_fusion=False))


def test_a_vocabulary_the_saved_config_left_to_its_tokenizer_is_compared_by_its_embedding(tmp_path):
    """A run whose config left the vocabulary to its tokenizer (vocab_size None), loaded by a run
    with another vocabulary, failed at the tensor read with 'has another shape (saved vs now) 4: …
    was it saved with another model config?', naming no flag."""
    from meshlm.config import Config
    cfg = Config()
    cfg.model = _model(vocab_size=None)
    ckpt.save(str(tmp_path), 10, {"model": {"embedding.word_embeddings.weight": torch.zeros(300, 32)}},
              config=cfg.to_dict())
    path = str(tmp_path / "iter_0000010")
    check_model_config(path, _model(vocab_size=None), vocab_size=300)
    with pytest.raises(CheckpointError, match="--vocab-size saved=300 now=400"):
        check_model_config(path, _model(vocab_size=None), vocab_size=400)
    with pytest.raises(CheckpointError, match="--vocab-size saved=300 now=400"):
        check_model_config(path, _model(vocab_size=400))
