"""pretrain(cfg): exact resume, invariance to DP size and micro-batch size, metrics, NaN handling.

Every run is a tiny GPT on --mock-data over gloo; runs compared with each other train in float64
(rounding near 1e-15, so 1e-10 tells a fault from rounding). Training parity of the layouts:
tests/test_parity_matrix.py.
"""

import json
import math
import os

import pytest
import torch

from distributed import run_distributed
from meshlm.config import Config
from meshlm.training import trainer


F64 = torch.float64


def tiny_config(tmp, *, tp=1, pp=1, micro=2, global_batch=4, iters=6, dropout=0.0, **training) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, 16, 100
    m.hidden_dropout = m.attention_dropout = dropout
    m.make_vocab_size_divisible_by = 16
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.train_iters = micro, global_batch, iters
    t.log_interval, t.eval_interval, t.eval_iters = 1, 3, 2
    for key, value in training.items():
        setattr(t, key, value)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 1e-2, 1
    cfg.data.mock_data = True
    cfg.logging.log_dir = os.path.join(tmp, "logs")
    return cfg


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------- exact resume

def _layout_config(tmp, layout, **kw):
    cfg = tiny_config(tmp, tp=layout.get("tp", 1), dropout=layout.get("dropout", 0.0), **kw)
    cfg.parallel.use_distributed_optimizer = layout.get("zero", False)
    cfg.optimizer.decoupled_lr = layout.get("decoupled_lr")
    return cfg


def _uninterrupted_then_interrupted(rank, world, tmp, layout):
    full = trainer.pretrain(_layout_config(os.path.join(tmp, "full"), layout, iters=4), F64)
    cfg = _layout_config(os.path.join(tmp, "part"), layout, iters=4, exit_interval=2)
    cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    first = trainer.pretrain(cfg, F64)
    return full, first


def _resumed(rank, world, tmp, layout):
    cfg = _layout_config(os.path.join(tmp, "resumed"), layout, iters=4)
    cfg.checkpoint.load = cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    return trainer.pretrain(cfg, F64)


@pytest.mark.parametrize("layout", [{"tp": 2, "dropout": 0.1}, {"zero": True, "decoupled_lr": 3e-2}],
                         ids=["tp2-dropout", "zero1-dp2-decoupled-lr"])
@pytest.mark.slow
def test_interrupted_and_resumed_run_repeats_the_uninterrupted_one(tmp_path, layout):
    """Save at iteration 2, resume in a new process group, same losses: TP=2 with dropout (RNG
    restored), and ZeRO-1 over DP=2 (sharded optimizer state saved and restored) with
    --decoupled-lr (the embedding's and output layer's LR where the schedule left it)."""
    (full, first), _ = run_distributed(_uninterrupted_then_interrupted, 2, str(tmp_path), layout)
    assert first["iterations"] == 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run_distributed(_resumed, 2, str(tmp_path), layout)[0]
    assert resumed["iterations"] == 4
    assert len(resumed["train_losses"]) == 2
    for a, b in zip(first["train_losses"] + resumed["train_losses"], full["train_losses"]):
        assert _rel(a, b) < 1e-12, (a, b)
    assert _rel(resumed["last_val_loss"], full["last_val_loss"]) < 1e-12
    # the losses move: a resume that silently restarted from scratch would not match
    assert full["train_losses"][0] != full["train_losses"][-1]


# ----------------------------------------------------------------------------- DP / micro-batch invariance

def _dp_micro_runs(rank, world, tmp):
    if world == 1:
        return [trainer.pretrain(tiny_config(os.path.join(tmp, "dp1"), micro=4), F64)]
    return [trainer.pretrain(tiny_config(os.path.join(tmp, "dp2m2"), micro=2), F64),
            trainer.pretrain(tiny_config(os.path.join(tmp, "dp2m1"), micro=1), F64)]  # 2 micro-batches each


def test_loss_curve_is_invariant_to_dp_and_micro_batch_for_a_fixed_global_batch(tmp_path):
    """Global batch 4: DP=1 × micro 4, DP=2 × micro 2, DP=2 × micro 1 with accumulation (float64)."""
    ref = run_distributed(_dp_micro_runs, 1, str(tmp_path))[0][0]
    dp2_m2, dp2_m1 = run_distributed(_dp_micro_runs, 2, str(tmp_path))[0]
    for other in (dp2_m2, dp2_m1):
        for a, b in zip(other["train_losses"], ref["train_losses"]):
            assert _rel(a, b) < 1e-10, (a, b)
        assert _rel(other["last_val_loss"], ref["last_val_loss"]) < 1e-10
    assert ref["train_losses"][0] != ref["train_losses"][-1]


# ----------------------------------------------------------------------------- metrics.jsonl

def _single_run(rank, world, tmp):
    cfg = tiny_config(tmp, iters=4)
    cfg.training.log_interval = 2
    return trainer.pretrain(cfg)


def test_metrics_jsonl_has_one_record_per_log_and_eval_line(tmp_path):
    summary = run_distributed(_single_run, 1, str(tmp_path))[0]
    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "lm_loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["iteration"] for r in train] == [2, 4]
    required = {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "iter_ms", "tokens_per_sec",
                "tflops_per_gpu", "mfu", "mem_allocated_gb"}
    for r in train:
        assert required <= set(r)
        assert r["mfu"] is None and r["mem_allocated_gb"] is None  # CPU: unknown, never invented
        assert r["tokens_per_sec"] > 0 and r["grad_norm"] > 0
    assert train[1]["consumed_samples"] == 16
    # the logged loss is the mean over the interval's iterations, as in Megatron
    assert _rel(train[1]["lm_loss"], sum(summary["train_losses"][2:4]) / 2) < 1e-9
    assert [r["iteration"] for r in evals] == [3, 4]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"])) for r in evals)


# ----------------------------------------------------------------------------- NaN handling

def _nan_at_iteration_2(rank, world, tmp, skip):
    real = trainer.reduce_losses
    calls = {"n": 0}

    def poisoned(outputs, ps, per_token=False):
        calls["n"] += 1
        loss = real(outputs, ps, per_token)
        return loss * float("nan") if calls["n"] == 2 else loss  # 2nd call = iteration 2's loss

    trainer.reduce_losses = poisoned
    cfg = tiny_config(tmp, iters=3, skip_nan_steps=skip)
    cfg.training.eval_interval = 100
    cfg.checkpoint.save, cfg.checkpoint.save_interval = os.path.join(tmp, "ckpt"), 1
    try:
        return trainer.pretrain(cfg)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_nan_loss_stops_naming_the_iteration_and_the_last_checkpoint(tmp_path):
    out = run_distributed(_nan_at_iteration_2, 1, str(tmp_path), False)[0]
    assert out.startswith("TrainingError: iteration 2:") and "iter_0000001" in out


def test_skip_nan_steps_skips_the_update_and_counts_it(tmp_path):
    out = run_distributed(_nan_at_iteration_2, 1, str(tmp_path), True)[0]
    assert out["iterations"] == 3 and out["train_losses"][1] is None
    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nan_iters"] for r in lines if "lm_loss" in r] == [0, 1, 1]
    assert {r["layout"]["nodes"] for r in lines if "lm_loss" in r} == {1}  # hosts, for analyze's node advice


# ----------------------------------------------------------------------------- out of memory

def _oom_in_the_first_step(rank, world, tmp, host=False, where="forward_backward"):
    def out_of_memory(*args, **kwargs):
        if host:  # torch's CPU allocator, word for word
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    setattr(trainer, where, out_of_memory)  # this spawned process only: a step's, or the model's build
    try:
        trainer.pretrain(tiny_config(tmp, iters=2))
    except Exception as e:
        return type(e).__name__, str(e), type(e.__cause__).__name__
    return None


def test_an_out_of_memory_step_is_one_training_error_with_the_planners_prediction_and_fitting_flags(tmp_path):
    kind, message, cause = run_distributed(_oom_in_the_first_step, 1, str(tmp_path))[0]
    assert (kind, cause) == ("TrainingError", "OutOfMemoryError")
    first, *facts = message.splitlines()
    assert first.startswith("out of memory on a ") and "TP 1 × PP 1 × DP 1, micro-batch 2" in first
    assert "Tried to allocate 2.00 GiB" in first
    predicted = next(line for line in facts if line.startswith("planner's prediction per GPU: "))
    for category in ("weights", "grads", "optimizer", "activations", "logits/loss", "peak"):
        assert category in predicted, category
    assert "allocated when it failed: n/a (no CUDA device)" in facts
    fits = next(line for line in facts if line.startswith("layouts that fit (planner): "))
    assert "--micro-batch-size" in fits and " GiB)" in fits


def test_out_of_memory_while_building_the_model_is_the_same_one_training_error(tmp_path):
    """A model too large for the GPU ran out of memory in build_model_chunks, before the step's handler:
    a worker traceback."""
    kind, message, cause = run_distributed(_oom_in_the_first_step, 1, str(tmp_path), False, "build_model_chunks")[0]
    assert (kind, cause) == ("TrainingError", "OutOfMemoryError")
    first, *facts = message.splitlines()
    assert first.startswith("out of memory on a ") and "Tried to allocate 2.00 GiB" in first
    assert any(line.startswith("planner's prediction per GPU: ") for line in facts)
    assert any(line.startswith("layouts that fit (planner): ") for line in facts)


def test_a_cpu_run_out_of_host_memory_is_one_training_error_not_a_traceback(tmp_path):
    """`--seq-length 100000` on CPU ended in a worker traceback of torch's DefaultCPUAllocator."""
    kind, message, cause = run_distributed(_oom_in_the_first_step, 1, str(tmp_path), True)[0]
    assert (kind, cause) == ("TrainingError", "RuntimeError")
    first, available, fix = message.splitlines()
    assert first.startswith("out of host memory at TP 1 × PP 1 × DP 1, micro-batch 2, --seq-length ")
    assert first.endswith("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000 bytes")
    assert available.startswith("host memory available now: ") and "--micro-batch-size" in fix


# ----------------------------------------------------------------------------- --load == --save, fresh

def _fresh_with_load_equal_save(rank, world, tmp):
    cfg = tiny_config(tmp, iters=2)
    cfg.checkpoint.load = cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    return trainer.pretrain(cfg, F64)


def test_load_equal_to_save_without_checkpoint_starts_fresh(tmp_path):
    out = run_distributed(_fresh_with_load_equal_save, 1, str(tmp_path))[0]
    assert out["iterations"] == 2
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()


def test_load_of_a_folder_without_checkpoint_is_an_error(tmp_path):
    def_dir = tmp_path / "empty"
    def_dir.mkdir()
    with pytest.raises(AssertionError, match="CheckpointError.*empty"):
        run_distributed(_load_only, 1, str(tmp_path), str(def_dir))


def _load_only(rank, world, tmp, load):
    cfg = tiny_config(tmp, iters=1)
    cfg.checkpoint.load = load
    return trainer.pretrain(cfg)


# ----------------------------------------------------------------------------- token ids vs vocabulary

def _train_on(rank, world, tmp, prefix):
    cfg = tiny_config(tmp, iters=1)
    cfg.data.mock_data = False
    cfg.data.data_path = [prefix]
    cfg.data.tokenizer_type = "NullTokenizer"
    return trainer.pretrain(cfg)


def test_token_id_beyond_the_vocabulary_stops_before_training_naming_file_and_id(tmp_path):
    """A corpus preprocessed with a larger vocabulary: every rank raises one DataError naming the
    .bin file and its largest id, before any step."""
    import numpy as np
    from meshlm.data.indexed import IndexedDatasetWriter
    prefix = str(tmp_path / "big_vocab_text_document")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        writer.add_document(rng.integers(0, 90, size=40))
    writer.add_document([5, 6, 345, 7])  # 345 ≥ --vocab-size 100
    writer.finalize()
    with pytest.raises(AssertionError) as err:
        run_distributed(_train_on, 2, str(tmp_path / "run"), prefix)
    msg = str(err.value)
    assert "rank 0:" in msg and "rank 1:" in msg  # both ranks raised; none was left waiting
    assert msg.count("meshlm.errors.DataError: ") == 2
    assert f"{prefix}.bin holds token id 345" in msg and "100" in msg
    assert not os.path.exists(tmp_path / "run" / "logs" / "metrics.jsonl")  # no step was taken


def _twice_then_resumed(rank, world, tmp):
    cfg = tiny_config(tmp, iters=4)
    trainer.pretrain(cfg)
    cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    cfg.checkpoint.save_interval = 2
    trainer.pretrain(cfg)  # a fresh run in the same log dir: the old records go
    resumed = tiny_config(tmp, iters=4)
    resumed.checkpoint.load = os.path.join(tmp, "ckpt")
    with open(os.path.join(tmp, "ckpt", "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")  # as if the run had crashed after iteration 2's checkpoint
    trainer.pretrain(resumed)


def test_metrics_jsonl_holds_each_iteration_once_across_fresh_and_resumed_runs(tmp_path):
    run_distributed(_twice_then_resumed, 1, str(tmp_path))
    rows = [json.loads(x) for x in open(tmp_path / "logs" / "metrics.jsonl")]
    train_iters = [r["iteration"] for r in rows if "lm_loss" in r]
    assert train_iters == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- --load refusals, every rank alike

def _save_two_ranks(rank, world, tmp):
    cfg = tiny_config(tmp, iters=1)
    cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    return trainer.pretrain(cfg)


def _resume_catching(rank, world, tmp, load, model_changes, schedule="override"):
    """Resume the 1-iteration checkpoint for 2 iterations (a longer LR decay: ``schedule`` "check"
    refuses it, "override" takes this run's, as --override-opt_param-scheduler)."""
    cfg = tiny_config(os.path.join(tmp, f"resume{rank}"), iters=2)
    cfg.checkpoint.load = load
    cfg.checkpoint.override_opt_param_scheduler = schedule == "override"
    for key, value in model_changes.items():
        setattr(cfg.model, key, value)
    try:
        trainer.pretrain(cfg)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "resumed"


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_ranks")
    run_distributed(_save_two_ranks, 2, str(tmp))
    return tmp / "ckpt"


@pytest.mark.slow
def test_load_of_another_model_is_refused_on_every_rank_listing_each_flag(two_rank_checkpoint, tmp_path):
    changes = {"num_layers": 1, "num_attention_heads": 8, "normalization": "RMSNorm", "add_bias_linear": False}
    outs = run_distributed(_resume_catching, 2, str(tmp_path), str(two_rank_checkpoint), changes)
    assert outs[0] == outs[1]  # both ranks raised, the same line
    assert outs[0].startswith(f"CheckpointError: --load {two_rank_checkpoint}: checkpoint iter_0000001")
    for diff in ("--num-layers saved=2 now=1", "--num-attention-heads saved=4 now=8",
                 "--normalization saved=LayerNorm now=RMSNorm", "--disable-bias-linear saved=False now=True"):
        assert diff in outs[0], diff
    # dropout may change on resume
    assert run_distributed(_resume_catching, 2, str(tmp_path), str(two_rank_checkpoint),
                           {"hidden_dropout": 0.2}) == ["resumed", "resumed"]


@pytest.mark.slow
def test_a_resume_with_another_lr_schedule_is_refused_on_every_rank(two_rank_checkpoint, tmp_path):
    """The run saved at --train-iters 1 resumed at 2 used to decay over 2 iterations silently."""
    outs = run_distributed(_resume_catching, 2, str(tmp_path), str(two_rank_checkpoint), {}, "check")
    assert outs[0] == outs[1] and outs[0].startswith(f"CheckpointError: --load {two_rank_checkpoint}: "
                                                     f"the checkpoint's LR schedule differs")


def test_a_file_only_rank_1_reads_damaged_stops_both_ranks_with_one_line(two_rank_checkpoint, tmp_path):
    import shutil
    load = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, load)
    os.remove(load / "iter_0000001" / "__1_0.distcp")  # rank 1's own RNG state lives there
    outs = run_distributed(_resume_catching, 2, str(tmp_path), str(load), {})
    assert outs[0] == outs[1] == (f"CheckpointError: --load {load}: checkpoint iter_0000001 is damaged or "
                                  f"incomplete (__1_0.distcp is missing); load an earlier iteration or re-save")


def test_generate_on_a_damaged_checkpoint_is_one_line(two_rank_checkpoint, tmp_path):
    import shutil
    from meshlm.errors import CheckpointError
    from meshlm.training import generate
    load = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, load)
    for name in os.listdir(load / "iter_0000001"):
        if name.endswith(".distcp"):
            data = (load / "iter_0000001" / name).read_bytes()
            (load / "iter_0000001" / name).write_bytes(data[:100])
    with pytest.raises(CheckpointError) as err:
        generate.load_model(str(load))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"--load {load}: checkpoint iter_0000001 is damaged or incomplete (__")
    shutil.rmtree(load)
    shutil.copytree(two_rank_checkpoint, load)
    config = load / "iter_0000001" / "config.json"
    config.write_text("{".ljust(os.path.getsize(config)))  # the size the manifest lists
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        generate.load_model(str(load))


def test_a_run_that_only_loaded_prints_no_sample_of_the_old_checkpoint(monkeypatch, capsys, tmp_path):
    """--load without --save: the checkpoint in run.last_checkpoint is the old model."""
    import types
    import torch
    from meshlm.training import generate

    def must_not_load(*a, **k):
        raise AssertionError("sampled from the loaded checkpoint")

    monkeypatch.setattr(generate, "load_model", must_not_load)
    cfg = tiny_config(str(tmp_path))
    cfg.checkpoint.load = str(tmp_path / "old")
    run = types.SimpleNamespace(cfg=cfg, tokenizer=types.SimpleNamespace(vocab_size=100),
                                ps=types.SimpleNamespace(rank=0, device=torch.device("cpu")),
                                last_checkpoint=str(tmp_path / "old" / "iter_0000010"))
    trainer._print_sample(run)
    assert capsys.readouterr().out == ("no sample printed: this run saved no checkpoint "
                                       "(pass --save to sample the trained model)\n")


# ----------------------------------------------------------------------------- notes at start

def test_a_run_saving_where_other_checkpoints_are_says_it_replaces_them(tmp_path, capsys):
    """--finetune --load ckpt --save ckpt starts at iteration 0: its saves replaced the checkpoints it
    read (and a restart fine-tuned again from iteration 0) without a word; so did a run loading
    another folder (a model's weights, another run's checkpoint) into a --save holding checkpoints."""
    import types

    from meshlm.checkpoint import dist as ckpt
    ckpt.save(str(tmp_path), 4, {"w": torch.zeros(2)})
    cfg = tiny_config(str(tmp_path))
    cfg.checkpoint.save = cfg.checkpoint.load = str(tmp_path)
    run = types.SimpleNamespace(cfg=cfg, ps=types.SimpleNamespace(rank=0), train_iters=6)
    trainer._note_start(run, trainer.TrainState(iteration=4))
    assert capsys.readouterr().out == ""  # a resume: its own checkpoints
    cfg.checkpoint.finetune = True
    trainer._note_start(run, trainer.TrainState())
    out = capsys.readouterr().out
    assert out.startswith(f"note: --save {tmp_path} already holds iter_0000004 from an earlier run; this run "
                          f"starts at iteration 0 (--finetune) and saves into the same folder")
    assert out.strip().endswith("a restart of this command fine-tunes again from iteration 0, as Megatron's "
                                "--finetune does: give another --save to keep them, and resume from it without "
                                "--finetune")
    # the same from the weights of a converted checkpoint (or a Hugging Face folder) into another --save
    weights = tmp_path / "weights"
    ckpt.save(str(weights), 0, {"model": {"w": torch.zeros(2)}})
    cfg.checkpoint.finetune, cfg.checkpoint.load = False, str(weights)
    trainer._note_start(run, trainer.TrainState())
    assert f"this run starts at iteration 0 from the weights of --load {weights} and saves into the same " \
           f"folder" in capsys.readouterr().out
    cfg.checkpoint.save = str(weights)  # the documented restart pattern: --save = --load
    trainer._note_start(run, trainer.TrainState())
    assert capsys.readouterr().out == ""
    cfg.checkpoint.load, cfg.checkpoint.save = str(tmp_path), str(weights)  # a resume saving elsewhere
    trainer._note_start(run, trainer.TrainState(iteration=4))
    assert f"this run resumes from --load {tmp_path} and saves into the same folder" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_says_when_it_has_nothing_to_train_or_saves_beside_an_earlier_run(tmp_path):
    import subprocess
    import sys
    from test_launch import TINY, clean_env

    def pretrain(*flags):
        out = subprocess.run([sys.executable, "-m", "meshlm", "pretrain", *TINY, "--nproc-per-node", "1", *flags],
                             cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    first = pretrain("--train-iters", "2", "--save", "ckpt", "--run-dir", "a")
    assert "nothing to train" not in first and "already holds" not in first
    again = pretrain("--train-iters", "2", "--save", "ckpt", "--load", "ckpt", "--run-dir", "b")
    assert "note: the checkpoint is at iteration 2 ≥ --train-iters 2: nothing to train" in again
    fresh = pretrain("--train-iters", "1", "--save", "ckpt", "--run-dir", "c")
    assert "note: --save ckpt already holds iter_0000002 from an earlier run" in fresh
    assert "each save replaces the earlier run's checkpoint of its iteration and keeps only the newest " \
           "--keep-checkpoints 2 below it" in fresh
