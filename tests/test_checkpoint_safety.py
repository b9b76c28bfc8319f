"""Crash safety and tooling of checkpoints: the manifest's file list, fallback to the previous
intact checkpoint, --keep-checkpoints, `meshlm checkpoint inspect/verify`, planted pickle payloads."""

import builtins
import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil

import pytest
import torch

from distributed import run_distributed
from meshlm import cli
from meshlm.checkpoint import dist as ckpt
from meshlm.errors import CheckpointError, ConfigError
from test_checkpoint import plant
from test_trainer import tiny_config


def _state(it, rank=0):
    return {"model": {"w": torch.full((32, 16), float(it))}, f"rank{rank}": {"x": torch.arange(5) + rank}}


def _save_two(rank, world, root):
    ckpt.save(root, 4, _state(4, rank), layout={"dp": world})
    return sorted(os.listdir(os.path.join(root, "iter_0000004")))


def test_the_manifest_lists_every_file_of_every_rank_with_size_and_sha256(tmp_path):
    names = run_distributed(_save_two, 2, str(tmp_path))[0]
    folder = tmp_path / "iter_0000004"
    files = json.loads((folder / "checkpoint.json").read_text())["files"]
    assert sorted(files) == [n for n in names if n != "checkpoint.json"]
    assert {"__0_0.distcp", "__1_0.distcp", "rank_00000.json", "rank_00001.json", ".metadata"} <= set(files)
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def _three(tmp_path):
    root = str(tmp_path / "save")
    for it in (1, 2, 3):
        ckpt.save(root, it, _state(it))
    return root


def test_a_damaged_latest_falls_back_to_the_previous_one_with_one_line(tmp_path, capsys):
    root = _three(tmp_path)
    data = tmp_path / "save" / "iter_0000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    it, state = ckpt.load(root)
    assert it == 2 and torch.equal(state["model"]["w"], _state(2)["model"]["w"])
    note = capsys.readouterr().out.strip()
    assert "\n" not in note and note == (
        f"note: --load {root}: the latest checkpoint iter_0000003 is damaged or incomplete (__0_0.distcp is "
        f"truncated (100 bytes, checkpoint.json says {ckpt.read_manifest(root + '/iter_0000003')['files']['__0_0.distcp']['bytes']})); "
        f"loading iter_0000002 instead")
    assert ckpt.check_loadable(root) == []
    with pytest.raises(CheckpointError, match="iter_0000003 is damaged or incomplete"):
        ckpt.load(root, iteration=3)  # an explicit iteration never falls back


def test_a_renamed_checkpoint_folder_falls_back_naming_the_iteration_its_manifest_says(tmp_path, capsys):
    """A folder renamed by hand (iter_0000003 → iter_0000009, the tracker set to 9) was loaded through
    its manifest's iteration: "the tracker names iteration 3 but iter_0000003 does not exist"."""
    root = _three(tmp_path)
    os.rename(os.path.join(root, "iter_0000003"), os.path.join(root, "iter_0000009"))
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("9")
    it, state = ckpt.load(root)
    assert it == 2 and torch.equal(state["model"]["w"], _state(2)["model"]["w"])
    assert capsys.readouterr().out.strip().endswith(
        "the latest checkpoint iter_0000009 is damaged or incomplete (checkpoint.json says iteration 3, not 9: "
        "was the folder renamed?); loading iter_0000002 instead")


def test_a_flipped_byte_is_found_by_the_checksum_only(tmp_path, capsys):
    root = _three(tmp_path)
    data = tmp_path / "save" / "iter_0000003" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF  # inside the tensor bytes, same size
    data.write_bytes(bytes(raw))
    assert ckpt.checkpoint_dir(root).endswith("iter_0000003")  # sizes alone: intact
    assert ckpt.checkpoint_dir(root, checksums=True).endswith("iter_0000002")
    assert "__0_0.distcp does not match its SHA-256 in checkpoint.json" in capsys.readouterr().out


def test_no_intact_checkpoint_raises_the_latest_problem(tmp_path):
    root = _three(tmp_path)
    for it in (1, 2, 3):
        os.remove(tmp_path / "save" / f"iter_000000{it}" / "rank_00000.json")
    with pytest.raises(CheckpointError) as err:
        ckpt.load(root)
    assert str(err.value) == (f"--load {root}: checkpoint iter_0000003 is damaged or incomplete "
                              f"(rank_00000.json is missing); load an earlier iteration or re-save")
    assert ckpt.check_loadable(root) == [str(err.value)]


def test_keep_prunes_older_checkpoints_and_leftovers_of_crashed_saves(tmp_path, monkeypatch):
    root = str(tmp_path / "save")
    for it in range(1, 6):
        ckpt.save(root, it, _state(it), keep=3)
    assert ckpt.complete_iterations(root) == [3, 4, 5]
    os.makedirs(os.path.join(root, "iter_0000009.tmp"))  # a crashed save's folder
    real = shutil.rmtree

    def crash_on_prune(path, *a, **k):
        if str(path).endswith("iter_0000003.tmp"):
            raise KeyboardInterrupt("killed mid-prune")
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", crash_on_prune)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(root, 6, _state(6), keep=3)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(root, "iter_0000009.tmp"))  # removed at the save's start
    assert ckpt.complete_iterations(root) == [4, 5, 6] and ckpt.read_tracker(root) == 6
    assert os.path.isdir(os.path.join(root, "iter_0000003.tmp"))  # a leftover, never a half checkpoint
    ckpt.save(root, 7, _state(7), keep=2)
    assert sorted(os.listdir(root)) == ["iter_0000006", "iter_0000007", ckpt.TRACKER]


def test_keep_checkpoints_below_2_is_refused_naming_the_flag():
    from meshlm.config import Config
    from meshlm.megatron_flags import MEGATRON_FLAGS, MESHLM_ONLY
    from meshlm.validate import validate
    cfg = Config()
    assert cfg.checkpoint.keep_checkpoints == 2 and cfg.checkpoint.verify_integrity is False
    for n in (1, 0):
        cfg.checkpoint.keep_checkpoints = n
        with pytest.raises(ConfigError, match=f"--keep-checkpoints {n} "):
            validate(cfg, world=1, check_files=False)
    assert "--keep-checkpoints" in MESHLM_ONLY and "--verify-integrity" in MEGATRON_FLAGS


# ----------------------------------------------------------------------------- meshlm checkpoint inspect / verify

def _pretrain_one(rank, world, tmp):
    from meshlm.training import trainer
    cfg = tiny_config(tmp, iters=2)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = os.path.join(tmp, "ckpt"), 1
    trainer.pretrain(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    run_distributed(_pretrain_one, 1, str(tmp))
    return tmp / "ckpt"


def _cli(capsys, *argv):
    rc = cli.main(["checkpoint", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_shows_iteration_layout_and_tensors(trained, capsys):
    rc, out, err = _cli(capsys, "inspect", str(trained))
    assert rc == 0 and err == ""
    assert out.startswith(f"checkpoint {trained}/iter_0000002\niteration 2 | layout tp=1 pp=1 ")
    assert "world size 1" in out
    # model space: the vocabulary unpadded (100, not 112); 100 × 32 × 4 bytes
    assert re.search(r"\n  model/embedding\.word_embeddings\.weight +\[100, 32\] +float32 +12,800\n", out)
    rc, out, _ = _cli(capsys, "inspect", str(trained / "iter_0000001"))
    assert rc == 0 and "iteration 1 |" in out


def test_verify_checks_checksums_tensors_and_the_trainers_load(trained, tmp_path, capsys):
    rc, out, _ = _cli(capsys, "verify", str(trained))
    assert rc == 0 and out.startswith(f"ok: {trained}/iter_0000002: 4 files match their SHA-256") and \
        "loads at TP=1 PP=1 DP=1 through the trainer" in out
    rc, out, _ = _cli(capsys, "verify", str(trained), "--layout", "2,1,2")
    assert rc == 0 and "not loaded: that layout needs 4 processes" in out
    rc, _, err = _cli(capsys, "verify", str(trained), "--layout", "3,1,1")
    assert rc == 2 and "--num-attention-heads 4 is not divisible by TP 3" in err
    bad = tmp_path / "bad"
    shutil.copytree(trained, bad)
    for name in ("__0_0.distcp", "rank_00000.json"):
        raw = bytearray((bad / "iter_0000002" / name).read_bytes())
        raw[len(raw) // 2] ^= 1
        (bad / "iter_0000002" / name).write_bytes(bytes(raw))
    rc, _, err = _cli(capsys, "verify", str(bad))
    assert rc == 2 and err.splitlines() == [
        f"meshlm: error: {bad}/iter_0000002: {name} does not match its SHA-256 in checkpoint.json"
        for name in ("__0_0.distcp", "rank_00000.json")]


def test_verify_at_a_layout_the_model_does_not_fit_names_the_layouts_it_fits(trained, capsys):
    """The fix is another --layout: validate's own fix (e.g. 'set --ffn-hidden-size to 126 or 129')
    would change the saved model, which verify cannot."""
    rc, _, err = _cli(capsys, "verify", str(trained), "--layout", "3,3,1")
    where = f"meshlm: error: {trained}/iter_0000002 at TP=3 PP=3 DP=1: "
    assert rc == 2 and err.splitlines() == [
        where + "--num-attention-heads 4 is not divisible by TP 3",
        where + "--ffn-hidden-size 128 (the default MLP width from --hidden-size) is not divisible by TP 3",
        where + "--num-layers 2 is fewer than PP 3 stages (each needs a layer)",
        where + "verify keeps the flags the checkpoint was saved with, so give another --layout TP,PP,DP: it fits "
                "TP 1, 2 or 4 (with PP=1 DP=1); PP 1 or 2 (with TP=1 DP=1); DP 1 or 2 (with TP=1 PP=1)"]
    rc, _, err = _cli(capsys, "verify", str(trained), "--layout", "1,1,3")
    assert rc == 2 and err.splitlines()[-1].endswith("it fits DP 1 or 2 (with TP=1 PP=1)")


def test_verify_leaves_ep_and_moe_sequence_parallelism_to_the_resumed_run(tmp_path):
    """--layout has no EP: an MoE model saved at EP 2 fits TP=PP=DP=1 (it said '--expert-model-parallel-size 2
    must divide DP × CP = 1'), and at TP 2 MoE's sequence parallelism is the resumed run's to turn on."""
    from meshlm.inspect_checkpoint import _rule_problems
    cfg = tiny_config(str(tmp_path))
    cfg.model.num_experts, cfg.parallel.expert_model_parallel_size = 4, 2
    assert _rule_problems(cfg, (1, 1, 1)) == [] and _rule_problems(cfg, (2, 1, 1)) == []
    assert cfg.parallel.expert_model_parallel_size == 2  # the saved config is left as it was


def _resume(root, **checkpoint):
    """trainer.load_checkpoint of --load ``root`` at TP=PP=DP=1 in this process: (iteration, stdout)."""
    from meshlm.data.tokenizer import build_tokenizer
    from meshlm.inspect_checkpoint import _config_at, _world_of_one
    from meshlm.model.chunks import build_model_chunks
    from meshlm.optim.distributed import build_optimizer
    from meshlm.optim.schedule import scheduler_for
    from meshlm.parallel.data import DistributedDataParallel
    from meshlm.parallel.mesh import ParallelState
    from meshlm.training import trainer
    cfg = _config_at(str(root / "iter_0000001"), (1, 1, 1))
    cfg.checkpoint.load, cfg.checkpoint.save = str(root), None
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    out = io.StringIO()
    with _world_of_one(), contextlib.redirect_stdout(out):
        ps = ParallelState.build(1, 1, 1)
        chunks = build_model_chunks(cfg, ps, build_tokenizer(cfg.data, cfg.model.vocab_size).vocab_size, torch.float32)
        ddp = DistributedDataParallel(chunks, ps, cfg)
        run = trainer.Run(cfg, ps, build_tokenizer(cfg.data, cfg.model.vocab_size), None, None, chunks, ddp,
                          build_optimizer(cfg, ps, chunks, ddp), scheduler_for(cfg, 1), None, None, None, None, None)
        state = trainer.load_checkpoint(run)
    return state.iteration, out.getvalue()


@pytest.mark.parametrize("verify", [False, True])
def test_a_distcp_file_damaged_at_its_size_falls_back_on_resume_with_or_without_verify_integrity(
        trained, tmp_path, verify):
    """Bytes flipped in a .distcp file's header keep its size: the size check passed, the read failed
    and the resume stopped ("load an earlier iteration or re-save", with no flag for that) although
    --verify-integrity fell back to the older checkpoint; now the failed read falls back too."""
    bad = tmp_path / "bad"
    shutil.copytree(trained, bad)
    data = bad / "iter_0000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    for i in range(0, len(raw), 997):  # every zip record's header of the file
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    iteration, out = _resume(bad, verify_integrity=verify)
    assert iteration == 1
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    fallback = (f"note: --load {bad}: the latest checkpoint iter_0000002 is damaged or incomplete (__0_0.distcp does "
                f"not match its SHA-256 in checkpoint.json); loading iter_0000001 instead")
    assert notes[-1] == fallback and len(notes) == (1 if verify else 2)
    if not verify:
        assert notes[0].startswith(f"note: --load {bad}: checkpoint iter_0000002 is damaged or incomplete (a .distcp "
                                   f"file is unreadable") and "(as --verify-integrity)" in notes[0]


# ----------------------------------------------------------------------------- planted pickle payloads

class Payload:
    """Unpickling it creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def _plant_metadata(folder, marker):
    plant(folder, ".metadata", pickle.dumps(Payload(marker)))


def _plant_distcp(folder, marker):
    """The .distcp file becomes a torch.save of the payload, and .metadata (pickled with DCP's own
    classes) points every tensor of it there, with the manifest fixed too."""
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    data = buf.getvalue()
    with open(folder / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    for index, info in metadata.storage_data.items():
        if info.relative_path == "__0_0.distcp":
            info.offset, info.length = 0, len(data)
    plant(folder, "__0_0.distcp", data)
    plant(folder, ".metadata", pickle.dumps(metadata))


def _plant_rank_json(folder, marker):
    plant(folder, "rank_00000.json", pickle.dumps(Payload(marker)))


@pytest.mark.parametrize("where", ["metadata", "distcp", "rank_json"])
def test_a_planted_pickle_payload_never_runs(trained, tmp_path, capsys, where):
    plant_fn = {"metadata": _plant_metadata, "distcp": _plant_distcp, "rank_json": _plant_rank_json}[where]
    live = tmp_path / "live"  # the payload is real: plain unpickling would create the file
    probe = tmp_path / "probe"
    (probe).mkdir()
    shutil.copy(trained / "iter_0000002" / "checkpoint.json", probe / "checkpoint.json")
    shutil.copy(trained / "iter_0000002" / ".metadata", probe / ".metadata")
    plant_fn(probe, live)
    reader = torch.load if where == "distcp" else pickle.load
    with open(probe / ("__0_0.distcp" if where == "distcp" else ".metadata" if where == "metadata"
                       else "rank_00000.json"), "rb") as fh:
        reader(fh, weights_only=False) if where == "distcp" else reader(fh)
    assert live.exists()

    save = tmp_path / "save"
    shutil.copytree(trained, save)
    marker = tmp_path / "pwned"
    plant_fn(save / "iter_0000002", marker)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(str(save), iteration=2)
    assert "\n" not in str(err.value)
    rc_inspect, _, err_inspect = _cli(capsys, "inspect", str(save / "iter_0000002"))
    rc_verify, _, err_verify = _cli(capsys, "verify", str(save / "iter_0000002"))
    assert not marker.exists()
    assert rc_verify == 2 and len(err_verify.strip().splitlines()) == 1
    if where == "metadata":  # inspect reads .metadata and the manifest, not tensor data or rank JSONs
        assert rc_inspect == 2 and len(err_inspect.strip().splitlines()) == 1
    else:
        assert rc_inspect == 0


def _verify_in_two(rank, world, root):
    from meshlm.checkpoint import manifest
    hashed = []
    real = manifest.sha256_file
    manifest.sha256_file = lambda path: hashed.append(os.path.basename(path)) or real(path)
    chosen = ckpt.checkpoint_dir(root, checksums=True)
    return os.path.basename(chosen), hashed


def test_verify_integrity_shares_the_hashing_out_and_every_rank_sees_every_finding(tmp_path, capsys):
    root = _three(tmp_path)
    data = tmp_path / "save" / "iter_0000003" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF
    data.write_bytes(bytes(raw))
    (chosen0, hashed0), (chosen1, hashed1) = run_distributed(_verify_in_two, 2, root)
    assert chosen0 == chosen1 == "iter_0000002"  # rank 1 learns of the flip rank 0 found, or the reverse
    listed = sorted(ckpt.read_manifest(root + "/iter_0000003")["files"]) + \
        sorted(ckpt.read_manifest(root + "/iter_0000002")["files"])
    assert sorted(hashed0 + hashed1) == sorted(listed) and hashed0 and hashed1  # each file once in all


def test_a_flipped_byte_in_the_metadata_falls_back_to_the_older_checkpoint_and_says_so_once(tmp_path, capsys):
    """.metadata keeps its size when a byte flips, so the size check passes; reading it fails, and
    the load falls back as for any damaged file (a newcomer's case: the run stopped instead)."""
    from meshlm.checkpoint import convert
    root = _three(tmp_path)
    meta = tmp_path / "save" / "iter_0000003" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[0] ^= 0xFF  # the pickle's protocol opcode
    meta.write_bytes(bytes(raw))
    assert not convert.is_weights_only(root)  # the weights-only probe looks quietly
    assert capsys.readouterr().out == ""
    it, state = ckpt.load(root)
    assert it == 2 and torch.equal(state["model"]["w"], _state(2)["model"]["w"])
    [note] = capsys.readouterr().out.strip().splitlines()
    assert "iter_0000003 is damaged or incomplete (.metadata is truncated or corrupt" in note
    assert note.endswith("loading iter_0000002 instead")


class _ByNamePickler(pickle.Pickler):
    """Pickles enum members as getattr(Enum, "NAME"), as Debian bookworm's Python 3.11.2 does."""

    def __init__(self, fh, target=None):
        super().__init__(fh)
        self.target = target

    def reducer_override(self, obj):
        import enum
        if isinstance(obj, enum.Enum):
            return getattr, (self.target or type(obj), obj.name)
        return NotImplemented


def _repickle(folder, target=None):
    with open(folder / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    buf = io.BytesIO()
    _ByNamePickler(buf, target).dump(metadata)
    assert b"getattr" in buf.getvalue()
    plant(folder, ".metadata", buf.getvalue())


def test_enum_members_pickled_by_name_load_and_getattr_on_anything_else_is_refused(trained, tmp_path):
    """A checkpoint saved in the container (Python 3.11.2) was refused: 'builtins.getattr is not allowed'."""
    by_name = tmp_path / "by_name"
    shutil.copytree(trained, by_name)
    _repickle(by_name / "iter_0000002")
    iteration, tree = ckpt.load(str(by_name), iteration=2)
    _, want = ckpt.load(str(trained), iteration=2)
    def leaves(t, key=""):
        if isinstance(t, dict):
            return [x for k, v in sorted(t.items()) for x in leaves(v, f"{key}/{k}")]
        return [(key, t)] if isinstance(t, torch.Tensor) else []
    got, expected = leaves(tree), leaves(want)
    assert iteration == 2 and expected and [k for k, _ in got] == [k for k, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
    planted = tmp_path / "planted"
    shutil.copytree(trained, planted)
    import pathlib
    _repickle(planted / "iter_0000002", target=pathlib.PosixPath)  # getattr(PosixPath, "NAME"): not an enum
    with pytest.raises(CheckpointError, match=r"getattr\(PosixPath, .*is not allowed"):
        ckpt.load(str(planted), iteration=2)


def test_a_save_that_cannot_write_is_one_line_and_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    """A full --save disk ended the run in DCP's traceback ("unexpected pos 704 vs 598") and left
    its partial iter_XXXXXXX.tmp taking the space."""
    root = str(tmp_path / "ck")
    ckpt.save(root, 1, _state(1))
    real = ckpt._write_json

    def full_disk(path, obj):
        if os.path.basename(path).startswith("rank_"):
            raise OSError(28, "No space left on device", path)
        real(path, obj)
    monkeypatch.setattr(ckpt, "_write_json", full_disk)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(root, 2, _state(2))
    assert len(str(e.value).splitlines()) == 1
    assert re.match(rf"--save {root}: the checkpoint of iteration 2 was not saved \(rank 0: OSError: .*No space "
                    rf"left on device.*; [\d,]+ bytes free there", str(e.value))
    assert ckpt.read_tracker(root) == 1 and sorted(os.listdir(root)) == ["iter_0000001",
                                                                         "latest_checkpointed_iteration.txt"]


def test_a_library_message_quoted_in_a_damaged_checkpoint_line_is_cut_at_a_word():
    """torch's unpickling text was cut mid-word at 120 characters ('… could not be loa')."""
    from meshlm.checkpoint.safe_read import damaged
    from meshlm.errors import clipped

    words = "the file is not a zip archive and its central directory could not be located in any of the bytes read"
    line = str(damaged("save/iter_0000003", RuntimeError(words + " " + words)))
    quoted = line.split("(RuntimeError: ", 1)[1].rsplit("); load", 1)[0]
    assert quoted.endswith(" …") and (words + " " + words).startswith(quoted[:-2]) and len(quoted) <= 122
    assert clipped("short text", 120) == "short text" and clipped("a " * 100, 9) == "a a a a …"


def test_verify_loads_a_checkpoint_of_a_larger_dp_at_its_own_global_batch(tmp_path):
    """A checkpoint saved at DP=2 under the default global batch (micro × DP = 8) failed verify at
    --layout 1,1,1: rebuilt at DP=1 the batch was 4, so its LR schedule's decay samples "differed"."""
    from meshlm.config import Config
    from meshlm.inspect_checkpoint import _config_at
    cfg = Config()
    cfg.training.micro_batch_size = 4
    ckpt.save(str(tmp_path / "ck"), 3, {"w": torch.zeros(2)}, config=cfg.to_dict())
    manifest = tmp_path / "ck" / "iter_0000003" / ckpt.MANIFEST
    saved = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(saved, world_size=2)))
    assert _config_at(str(tmp_path / "ck" / "iter_0000003"), (1, 1, 1)).training.global_batch_size == 8
