"""Bad inputs a newcomer's launch script produced (found by trying meshlm from its README): each is
refused before any worker starts, in one line naming the flag, never a traceback or another run."""

import os

import pytest

from meshlm.cli import main
from full_disk import FullDiskFile

SHAPE = ["pretrain", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"]


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "embedded default" not in out.out
    return out.err.strip()


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"])
def test_a_data_flag_without_a_prefix_is_refused_not_replaced_by_the_embedded_default(tmp_path, capsys, flag):
    """`--data-path $DATA_PATH` with DATA_PATH unset used to train the embedded default corpus."""
    err = _refused(capsys, SHAPE + ["--run-dir", str(tmp_path / "run"), flag, "--dry-run"])
    assert f"{flag} is given without a prefix" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_empty_data_args_file_is_refused_before_any_worker(tmp_path, capsys):
    args = tmp_path / "args.txt"
    args.write_text("\n")
    err = _refused(capsys, SHAPE + ["--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                                    "--data-args-path", str(args), "--dry-run"])
    assert f"--data-args-path {args}: the file holds no dataset prefix" in err


def _dataset(prefix):
    """A valid indexed dataset of one document at ``prefix`` (the launch checks its .idx and .bin)."""
    from meshlm.data.indexed import IndexedDatasetWriter
    writer = IndexedDatasetWriter(str(prefix))
    writer.add_document([0, 1])
    writer.finalize()


def test_dry_run_names_a_tokenizer_file_of_the_wrong_kind(tmp_path, capsys):
    _dataset(tmp_path / "d_text_document")
    bad = tmp_path / "sp.model"
    bad.write_bytes(b"\xff\xfe not a tokenizer.json")
    err = _refused(capsys, SHAPE + ["--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type",
                                    "HuggingFaceTokenizer", "--tokenizer-model", str(bad), "--dry-run"])
    assert f"--tokenizer-model {bad}" in err and len(err.splitlines()) == 1


def test_a_converted_checkpoint_of_a_null_vocabulary_loads_with_a_tokenizer_of_that_size(tmp_path):
    """`convert --from-hf` saves --vocab-size 512 (no tokenizer.json beside the weights); a run that
    leaves the vocabulary to its tokenizer was refused with `--vocab-size saved=512 now=None`."""
    import json

    from meshlm.checkpoint.state import check_model_config
    from meshlm.config import Config
    from meshlm.errors import CheckpointError
    saved = Config()
    saved.model.vocab_size = 512
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    now = Config().model
    check_model_config(str(tmp_path), now, vocab_size=512)
    with pytest.raises(CheckpointError, match="--vocab-size saved=512 now=500"):
        check_model_config(str(tmp_path), now, vocab_size=500)


def test_help_shows_a_disable_switch_as_off_by_default(capsys):
    import re
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--disable-bias-linear [^\[]*\[default: off\]", text)
    assert re.search(r"--swiglu [^\[]*\[default: off\]", text)


def test_a_data_prefix_given_with_its_bin_extension_is_named_with_the_fix(tmp_path, capsys):
    for name in ("d_text_document.bin", "d_text_document.idx"):
        (tmp_path / name).write_bytes(b"x")
    given = str(tmp_path / "d_text_document.bin")
    err = _refused(capsys, SHAPE + ["--data-path", given, "--vocab-size", "64", "--tokenizer-type",
                                    "NullTokenizer", "--dry-run"])
    assert f"give the prefix without .bin: {tmp_path / 'd_text_document'}" in err
    assert ".bin.bin" in err and ".bin.idx" not in err  # one line per prefix


def test_rotary_percent_without_rotary_positions_is_refused(capsys):
    err = _refused(capsys, SHAPE + ["--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                                    "--rotary-percent", "0.5", "--dry-run"])
    assert "--rotary-percent 0.5 applies to rotary positions only" in err


def test_checkpoint_switches_without_their_folder_are_noted(capsys):
    assert main(SHAPE + ["--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                         "--async-save", "--verify-integrity", "--keep-checkpoints", "5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: --verify-integrity ignored without --load" in out
    assert "note: --async-save ignored without --save" in out
    assert "note: --keep-checkpoints 5 ignored without --save" in out  # silently before


def test_an_exit_signal_without_its_handler_is_noted(capsys):
    """--exit-signal SIGUSR1 alone was dropped silently: the run a user meant to stop and save by
    SIGUSR1 was killed by it (its default action) with nothing saved."""
    assert main(SHAPE + ["--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                         "--exit-signal", "SIGUSR1", "--dry-run"]) == 0
    assert "note: --exit-signal SIGUSR1 ignored without --exit-signal-handler" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["inspect", "verify"])
def test_checkpoint_commands_name_their_argument_not_load(tmp_path, capsys, action):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, what in ((afile, "a file, not a folder"), (tmp_path / "absent", "no such folder"),
                       (tmp_path, "not a checkpoint")):
        err = _refused(capsys, ["checkpoint", action, str(path)])
        assert f"{path}: {what}" in err and "--load" not in err


@pytest.mark.parametrize("action", ["inspect", "verify"])
def test_checkpoint_commands_name_another_frameworks_folder_and_its_conversion(tmp_path, capsys, action):
    """A Hugging Face folder or a Megatron-LM iteration folder was 'not a checkpoint', with no word of
    what it is or of `meshlm convert`."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"")
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000010").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    (megatron / "iter_0000010" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    for path, what, fix in ((hf, "a Hugging Face model folder", f"meshlm convert --from-hf {hf}"),
                            (megatron / "iter_0000010", "a Megatron-LM checkpoint",
                             f"meshlm convert --from-megatron {megatron} ")):
        err = _refused(capsys, ["checkpoint", action, str(path)])
        assert f"{path} is {what}" in err and fix in err and len(err.splitlines()) == 1


def test_a_file_given_as_load_is_named_a_file(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _refused(capsys, SHAPE + ["--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                                    "--load", str(afile), "--dry-run"])
    assert f"--load {afile}: a file, not a directory; point --load at a run's --save directory" in err
    assert "a fresh run starts there" not in err  # it cannot: --save must be a directory too


# ------------------------------------------------------------------ meshlm analyze / report / plan

def _run_dir(tmp_path, *, tail: str = "", config: str = "parallel: {}\n"):
    """A run directory with three training records (and ``tail`` appended to metrics.jsonl)."""
    import json
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    lines = [json.dumps({"iteration": i, "iter_ms": 100.0, "tokens_per_sec": 1000.0, "lm_loss": 5.0 - 0.1 * i,
                         "nan_iters": 0, "skipped_iters": 0, "mem_max_allocated_gb": None,
                         "mem_total_gb": None, "consumed_samples": 8 * i, "lr": 1e-3}) for i in (1, 2, 3)]
    (run / "logs" / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    if config is not None:
        (run / "config.yaml").write_text(config)
    return run


@pytest.mark.parametrize("flag", ["--output", "--trace"])
@pytest.mark.parametrize("where", ["a directory", "below a file"])
def test_report_output_paths_it_cannot_write_are_refused_before_anything_is_written(tmp_path, capsys, flag, where):
    """`meshlm report RUN --output DIR` (or --trace) ended in an IsADirectoryError traceback."""
    run = _run_dir(tmp_path)
    target = str(tmp_path) if where == "a directory" else str(run / "config.yaml" / "x.json")
    err = _refused(capsys, ["report", str(run), flag, target])
    assert err.startswith(f"meshlm: error: {flag} {target}") and len(err.splitlines()) == 1
    assert not (run / "report.html").exists()


def test_report_output_in_a_missing_folder_creates_it(tmp_path, capsys):
    run = _run_dir(tmp_path)
    out = tmp_path / "new" / "folder" / "r.html"
    assert main(["report", str(run), "--output", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html") or "<html" in out.read_text()


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_cut_off_last_metrics_line_is_left_out_with_a_note(tmp_path, capsys, command):
    """A run killed mid-write (or still writing) left `{"iteration": 4, "iter_` as the last line:
    analyze and report refused the whole run."""
    run = _run_dir(tmp_path, tail='{"iteration": 4, "iter_')
    assert main([command, str(run)]) == 0
    err = capsys.readouterr().err
    assert "line 4 is cut off" in err and "Traceback" not in err
    if command == "analyze":
        assert main(["analyze", str(run), "--json", "--no-predict"]) == 0
        import json
        assert json.loads(capsys.readouterr().out)["iterations"] == [1, 3]


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_bad_line_in_the_middle_is_still_refused(tmp_path, capsys, command):
    run = _run_dir(tmp_path, tail='not json\n{"iteration": 5, "iter_ms": 1}\n')
    err = _refused(capsys, [command, str(run)])
    assert "metrics.jsonl line 4: not JSON" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command, tail, named", [
    ("report", '{"iteration": 4, "iter_ms": 1, "lm_loss": 2}\n', "record 4 (a training record) has no integer "
                                                                   "consumed_samples"),
    ("report", '{"iteration": 4, "consumed_samples": "x", "val_loss": 2}\n', "record 4 (a validation record)"),
    ("analyze", '{"iter_ms": 1, "lm_loss": 2}\n', "training record 4 has no integer \"iteration\""),
    ("report", '{"iter_ms": 1, "lm_loss": 2}\n', "has no integer iteration or consumed_samples")])
def test_a_record_without_its_iteration_or_samples_is_one_line(tmp_path, capsys, command, tail, named):
    """A hand-edited (or foreign) metrics.jsonl whose record lacked consumed_samples or iteration ended
    in a KeyError traceback from the charts' x axes or the iteration sort."""
    err = _refused(capsys, [command, str(_run_dir(tmp_path, tail=tail))])
    assert named in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, flag", [
    (["report", "{run}", "--output", "{out}"], "--output"),
    (["report", "{run}", "--trace", "{out}"], "--trace"),
    (["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300", "--output", "{out}"], "--output"),
    (["plan", "--model", "tiny", "--calibrate", "--quick", "--gpu-profile", "{out}"], "--gpu-profile")])
def test_an_output_that_is_a_device_or_pipe_is_refused_not_replaced_by_a_file(tmp_path, capsys, argv, flag):
    """`meshlm report RUN --output /dev/null` replaced /dev/null with a regular file (the output is
    written beside its path and moved over it); a pipe stands in for the device here."""
    import os
    out = tmp_path / "pipe"
    os.mkfifo(out)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello world"}\n')
    run = _run_dir(tmp_path)
    err = _refused(capsys, [a.format(run=run, out=out, corpus=corpus) for a in argv])
    assert f"{out} is not a regular file (a device, pipe or socket)" in err and flag in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1 and out.is_fifo()


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_run_with_its_logs_in_another_log_dir_is_found_from_its_run_dir(tmp_path, capsys, command):
    """`pretrain --run-dir R --log-dir L`: report R found L/metrics.jsonl through R/config.yaml,
    analyze R said "no metrics.jsonl there" and to give the --run-dir it was given."""
    import shutil
    run = _run_dir(tmp_path)
    (run / "config.yaml").write_text(f"logging: {{log_dir: {tmp_path / 'elsewhere'}}}\n")
    shutil.move(str(run / "logs"), str(tmp_path / "elsewhere"))
    assert main([command, str(run), "--no-predict"]) == 0
    assert "iterations 1–3" in capsys.readouterr().out or command == "report"


def test_config_yaml_records_a_relative_log_dir_as_absolute(tmp_path, monkeypatch):
    """A relative --log-dir went into config.yaml as given, so analyze and report found the run's
    metrics only from the launch's working directory."""
    from meshlm.cli import _with_absolute_log_dir
    from meshlm.config import Config
    monkeypatch.chdir(tmp_path)
    cfg = Config()
    cfg.logging.log_dir = "logs-elsewhere"
    written = _with_absolute_log_dir(cfg)
    assert written.logging.log_dir == str(tmp_path / "logs-elsewhere") and cfg.logging.log_dir == "logs-elsewhere"


@pytest.mark.parametrize("given", ["logs", "logs/metrics.jsonl", "."])
def test_analyze_reads_the_runs_config_from_each_documented_form_of_the_run(tmp_path, capsys, given):
    """`meshlm analyze RUN/logs` (the README's "its logs/ folder") looked for config.yaml in logs/:
    no predictions, and fixes without the run's numbers."""
    run = _run_dir(tmp_path, config="training: {micro_batch_size: 2, global_batch_size: 8}\n")
    assert main(["analyze", str(run / given)]) == 0
    assert "config (config.yaml) was not found" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_another_programs_jsonl_is_named_as_such_not_as_a_run_that_has_not_logged_yet(tmp_path, capsys, command):
    """analyze said "no training record yet; analyze a run after its first --log-interval iterations"
    of a file no meshlm run wrote (report named it as foreign)."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
    err = _refused(capsys, [command, str(run)])
    assert "metrics.jsonl: not a meshlm metrics file" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["analyze", "report"])
@pytest.mark.parametrize("text", ["a: [1,\n b: :\n", "- just\n- a list\n"])
def test_a_damaged_config_yaml_is_one_line_naming_the_file(tmp_path, capsys, command, text):
    run = _run_dir(tmp_path, config=text)
    err = _refused(capsys, [command, str(run)])
    assert f"{run / 'config.yaml'}" in err and len(err.splitlines()) == 1


PLAN = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "512"]


@pytest.mark.parametrize("flags, named", [
    (["--num-gpus", "0"], "--num-gpus 0"), (["--num-gpus", "-4"], "--num-gpus -4"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0"), (["--top", "-1"], "--top -1"),
    (["--num-gpus", "12"], "--num-gpus 12 is not whole nodes"),
    (["--gpu-tflops", "0"], "--gpu-tflops 0"), (["--gpu-memory-gib", "-5"], "--gpu-memory-gib -5"),
    (["--gpu-gemm-efficiency", "2"], "--gpu-gemm-efficiency 2"),
    (["--gpu-hbm-gbps", "inf"], "--gpu-hbm-gbps inf: give a finite number above 0"),
    (["--gpu-mtbf-hours", "inf"], "--gpu-mtbf-hours inf: give finite hours"),
    (["--ckpt-write-gbps", "inf"], "--ckpt-write-gbps inf: give finite GB/s"),
    (["--restart-minutes", "inf"], "--restart-minutes inf: give a finite number of minutes"),
    (["--train-tokens", "inf"], "--train-tokens inf: give a finite number"),
])
def test_plan_refuses_impossible_cluster_flags(capsys, flags, named):
    """--gpu-tflops 0 ended in ZeroDivisionError; --num-gpus 0 planned the default world, -4 printed
    empty tables, --gpu-memory-gib -5 excluded every layout with exit 0; --gpu-mtbf-hours inf ended in
    a traceback, --gpu-hbm-gbps, --ckpt-write-gbps and --restart-minutes inf planned on with inf/0 figures."""
    err = _refused(capsys, PLAN + flags)
    assert named in err


def test_plan_says_when_it_assumes_the_vocabulary(capsys):
    """`meshlm plan` with neither a tokenizer nor --vocab-size planned a 32000-token vocabulary silently
    (the README promises one note whenever the vocabulary is assumed)."""
    argv = PLAN[:PLAN.index("--mock-data")] + ["--num-gpus", "1", "--top", "1"]
    assert main(argv) == 0
    assert "meshlm plan: note: no tokenizer and no --vocab-size given; planning with vocabulary 32000" in \
        capsys.readouterr().err
    assert main(argv + ["--vocab-size", "512"]) == 0 and "note: no tokenizer" not in capsys.readouterr().err


def test_plan_of_a_context_parallel_layout_names_cp_and_splits_the_activations(capsys):
    """`plan --context-parallel-size 2` printed `your layout TP 1 × PP 1 × DP 1` (CP dropped) with
    the activations of CP 1, and said context parallelism does not train yet."""
    import json
    argv = ["plan", "--model", "gpt2-125m", "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--micro-batch-size", "1",
            "--global-batch-size", "8", "--mock-data", "--vocab-size", "50304", "--attention-dropout", "0",
            "--num-gpus", "8"]
    mem = {}
    for cp in (1, 2, 4):
        assert main(argv + ["--context-parallel-size", str(cp), "--json"]) == 0
        mem[cp] = json.loads(capsys.readouterr().out)["current"]["memory"]
    for cp in (2, 4):
        assert mem[cp]["activations_per_layer"] == pytest.approx(mem[1]["activations_per_layer"] / cp)
        assert mem[cp]["loss"] == pytest.approx(mem[1]["loss"] / cp)
    assert main(argv + ["--context-parallel-size", "2", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "your layout TP 1 × CP 2 × PP 1 × DP 4" in out and "does not train yet" not in out


def _pretrain_config(argv):
    import argparse

    from meshlm.config import add_config_args, config_from_args
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(argv))


def _built_params(rank, world, argv):
    import torch

    from meshlm.training.trainer import build
    run = build(_pretrain_config(argv), torch.float32)
    return sum(b.param_data.numel() for b in run.ddp.buffers)


def test_dry_run_and_plan_count_moe_parameters_as_the_built_model(capsys):
    """The planner counted an MoE model as its dense twin (136,960 instead of 203,648 on each rank),
    and without --nproc-per-node a CPU run with --expert-model-parallel-size 2 was refused
    ("must divide DP × CP = 1") instead of starting the 2 workers the layout needs."""
    import torch
    from distributed import run_distributed

    from meshlm.config import default_nproc
    from meshlm.planner.params import stage_params
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
            "--vocab-size", "512", "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size",
            "2", "--swiglu", "--moe-shared-expert-intermediate-size", "96", "--moe-layer-freq", "[1,0]"]
    cfg = _pretrain_config(argv)
    assert torch.cuda.is_available() or default_nproc(cfg) == 2
    built = run_distributed(_built_params, 2, argv)
    assert stage_params(cfg, 512) == [built[0]] and built[0] == built[1]


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_a_run_stopped_by_an_error_says_so(tmp_path, capsys, command):
    """A run stopped by a NaN at iteration 3 was analyzed as healthy iterations 1–2: the error line is
    only in the worker logs, never in metrics.jsonl."""
    import os
    run = _run_dir(tmp_path)
    log = run / "logs" / "rank1.log"
    log.write_text("meshlm: error: iteration 4: lm loss is nan (local loss non-finite on rank(s) 1)\n")
    assert main([command, str(run), "--no-predict"]) == 0
    text = capsys.readouterr().out if command == "analyze" else (run / "report.html").read_text()
    assert "the run stopped with an error: iteration 4: lm loss is nan" in text
    old = os.path.getmtime(run / "logs" / "metrics.jsonl") - 60  # an earlier attempt's error: the job went on
    os.utime(log, (old, old))
    assert main([command, str(run), "--no-predict"]) == 0
    text = capsys.readouterr().out if command == "analyze" else (run / "report.html").read_text()
    assert "the run stopped" not in text


def test_an_earlier_attempts_error_in_an_appended_log_is_not_the_runs_end(tmp_path):
    """A resume refused for its LR schedule, then resumed with --override-opt_param-scheduler to the
    end, was analyzed as `the run stopped with an error: --load …`: rank logs append across attempts."""
    from meshlm.planner.analyze import stop_finding
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    log = tmp_path / "rank0.log"
    refused = "meshlm: error: --load ck: the checkpoint's LR schedule differs from this run's\n"
    world = "meshlm: world=1 TP=1 CP=1 DP=1 PP=1 | 8 iterations\n"
    log.write_text(world + refused + world + "loaded checkpoint ck/iter_0000005 (iteration 5)\n"
                   " iteration        6/       8 | lm loss: 5.3\n")
    assert stop_finding(str(tmp_path)) is None
    log.write_text(log.read_text() + "meshlm: error: iteration 7: lm loss is nan\n")
    assert "the run stopped with an error: iteration 7: lm loss is nan" in stop_finding(str(tmp_path))["message"]
    log.write_text(world + refused)  # the last attempt itself refused: still the run's end
    assert "LR schedule differs" in stop_finding(str(tmp_path))["message"]


def test_the_example_launch_script_without_arguments_prints_its_usage(tmp_path):
    """`DRY_RUN=1 examples/train_llama3_8b_distributed.sh` (as the README names it) ended in
    `line 21: $1: unbound variable`."""
    import os
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "examples" / "train_llama3_8b_distributed.sh"
    done = subprocess.run(["bash", str(script)], env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("usage: ") and "unbound" not in done.stderr


def test_the_slurm_script_gives_the_node_s_cpus_to_its_one_task():
    """Without sbatch --cpus-per-task the srun step got Slurm's default 1 CPU per task: torchrun
    and every worker of the node bound to one core."""
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.sbatch").read_text()
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-$CORES}"' in text and "CORES=${SLURM_CPUS_ON_NODE" in text


def test_a_profile_range_beyond_the_run_is_noted(capsys):
    """`--profile` (default iterations 11–12) on a 4-iteration run profiled nothing, silently."""
    argv = SHAPE[:-1] + ["4", "--mock-data", "--vocab-size", "64", "--profile", "--dry-run"]
    assert main(argv) == 0
    assert "iterations 11–12 (--profile-step-start 10, --profile-step-end 12) are beyond the run's 4 iterations: " \
           "nothing is profiled" in capsys.readouterr().out
    assert main(argv + ["--profile-step-start", "2", "--profile-step-end", "6"]) == 0
    assert "only iterations 3–4 of 3–6 are profiled" in capsys.readouterr().out
    assert main(argv + ["--profile-step-start", "1", "--profile-step-end", "3"]) == 0
    assert "--profile:" not in capsys.readouterr().out


def test_moe_flags_without_num_experts_are_noted(capsys):
    assert main(SHAPE + ["--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                         "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.01", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: --moe-router-topk --moe-aux-loss-coeff ignored without --num-experts" in out


def test_generate_on_a_hugging_face_folder_says_to_convert_it_not_to_give_save(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"")  # only its name matters before conversion
    err = _refused(capsys, ["generate", "--load", str(tmp_path), "--prompt", "x"])
    assert f"is a Hugging Face folder, not a meshlm checkpoint; convert it first: meshlm convert --from-hf " \
           f"{tmp_path} --save CKPT_DIR" in err and "--save " + str(tmp_path) not in err


def test_generate_on_a_folder_that_is_no_checkpoint_suggests_no_save(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    err = _refused(capsys, ["generate", "--load", str(tmp_path), "--prompt", "x"])
    assert "is not a meshlm checkpoint directory" in err and "--save" in err and "give --save" not in err


def test_plan_turns_sequence_parallel_off_at_tp_1_as_a_launch_does(capsys):
    assert main(["plan", "--model", "llama-1b", "--seq-length", "2048", "--micro-batch-size", "1",
                 "--global-batch-size", "64", "--bf16", "--mock-data", "--vocab-size", "32000", "--num-gpus", "8",
                 "--gpus-per-node", "8", "--gpu", "H100-80GB", "--sequence-parallel", "--top", "1"]) == 0
    assert "your layout TP 1 × PP 1 × DP 8," in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [(["--world-size", "0"], "--world-size 0 is out of range"),
                                          (["--world-size", "-4"], "--world-size -4 is out of range"),
                                          (["--nnodes", "0"], "--nnodes 0 is out of range"),
                                          (["--nnodes", "-1"], "--nnodes -1 is out of range")])
def test_dry_run_refuses_a_job_of_no_processes(capsys, flags, named):
    """`--dry-run --world-size 0` checked the --nproc-per-node job instead, `-4` passed every
    check, and `--nnodes 0` ended in a ZeroDivisionError traceback."""
    err = _refused(capsys, SHAPE + ["--mock-data", "--vocab-size", "64", "--dry-run"] + flags)
    assert named in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags", [["--nnodes", "2"], ["--world-size", "4"], ["--nnodes", "1", "--world-size", "2"]])
def test_job_size_flags_without_dry_run_are_refused_not_ignored(tmp_path, capsys, flags):
    """`meshlm pretrain … --nnodes 2` (or --world-size 4) trained a world of 1 on this node alone."""
    err = _refused(capsys, SHAPE + ["--mock-data", "--vocab-size", "64", "--run-dir", str(tmp_path / "run")] + flags)
    verb = "sizes" if len(flags) == 2 else "size"
    assert f"{' '.join(flags)} only {verb} the job that --dry-run checks" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_report_onto_a_full_disk_keeps_the_earlier_report_whole(tmp_path, monkeypatch):
    """write_text_file wrote in place: a full disk left a cut-off report.html and a traceback."""
    from meshlm import folders
    from meshlm.errors import ConfigError
    path = tmp_path / "report.html"
    path.write_text("the earlier report")

    monkeypatch.setattr(folders, "open", FullDiskFile, raising=False)
    with pytest.raises(ConfigError, match=rf"^--output {path}: no space left in {tmp_path}"):
        folders.write_text_file(str(path), "<html>new</html>")
    monkeypatch.undo()
    assert path.read_text() == "the earlier report" and os.listdir(tmp_path) == ["report.html"]


@pytest.mark.parametrize("argv, flag", [
    (["convert", "--to-hf", "--load", "ck", "--output", "{bad}"], "--output"),
    (["convert", "--to-megatron", "--load", "ck", "--output", "{bad}"], "--output"),
    (["plan", "--model", "tiny", "--vocab-size", "256", "--calibrate", "--quick", "--gpu-profile", "{bad}/p.json"],
     "--gpu-profile"),
])
@pytest.mark.parametrize("bad", ["file", "proc"])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys, argv, flag, bad):
    """convert's exports raised makedirs' FileNotFoundError after reading the whole checkpoint, and
    plan --calibrate wrote its profile only after measuring (a traceback then)."""
    path = tmp_path / "f" if bad == "file" else "/proc/meshlm-out"
    if bad == "file":
        path.write_text("x")
    err = _refused(capsys, [a.replace("{bad}", str(path)) for a in argv])
    assert err.startswith(f"meshlm: error: {flag} {path}") and len(err.splitlines()) == 1


@pytest.mark.parametrize("way, flag", [("--from-hf", "--save"), ("--from-hf", "--output"),
                                       ("--from-megatron", "--output")])
def test_an_import_into_its_own_source_folder_is_refused(tmp_path, capsys, way, flag):
    """convert --from-hf hf --save hf raised shutil.SameFileError copying tokenizer.json onto itself."""
    src = tmp_path / "src"
    src.mkdir()
    err = _refused(capsys, ["convert", way, str(src), flag, str(src) + "/"])
    assert err == (f"meshlm: error: {flag} {src}/ is the {way} folder itself; the meshlm checkpoint goes to a new "
                   f"folder: give another path")


@pytest.mark.parametrize("argv, what", [
    (["tokenizer", "train", "--input", "{corpus}", "--vocab-size", "300", "--output", "{other}"], "tokenizer.json"),
    (["plan", "--model", "tiny", "--vocab-size", "256", "--calibrate", "--quick", "--gpu-profile", "{other}"],
     "GPU profile"),
])
def test_an_output_file_that_holds_something_else_is_not_replaced(tmp_path, capsys, argv, what):
    """tokenizer train --output and plan --calibrate --gpu-profile replaced any file given (a corpus,
    a config); an earlier tokenizer.json or profile is still replaced."""
    corpus, other = tmp_path / "c.jsonl", tmp_path / "other.json"
    corpus.write_text('{"text": "a b c d"}\n')
    other.write_text('{"text": "keep me"}\n')
    argv = [a.replace("{corpus}", str(corpus)).replace("{other}", str(other)) for a in argv]
    err = _refused(capsys, argv)
    assert err == (f"meshlm: error: --{argv[-2][2:]} {other} exists and is not an earlier {what}: refusing to "
                   f"overwrite it; give another file, or remove it first")
    assert other.read_text() == '{"text": "keep me"}\n'
    if what == "tokenizer.json":
        other.unlink()
        assert main(argv) == 0 and main(argv) == 0  # written, then its own earlier output replaced


DRY = ["pretrain", "--mock-data", "--vocab-size", "64", "--num-layers", "8", "--hidden-size", "64",
       "--num-attention-heads", "8", "--seq-length", "16", "--micro-batch-size", "1", "--sequence-parallel", "--dry-run"]


def test_a_dry_runs_nodes_size_its_node(capsys):
    """--world-size 16 --nnodes 4: the lint took a node to be this machine's process count (here the
    layout's 8), so TP 8 across 4-GPU nodes passed without a word; 15 processes on 2 nodes and a
    --world-size that is not --nnodes × --nproc-per-node passed too."""
    assert main(DRY + ["--world-size", "16", "--nnodes", "4", "--tensor-model-parallel-size", "8"]) == 0
    assert "warning: TP group of 8 spans nodes (4 GPUs per node)" in capsys.readouterr().out
    assert "not whole nodes of --nnodes 2" in _refused(capsys, DRY + ["--world-size", "15", "--nnodes", "2"])
    err = _refused(capsys, DRY + ["--world-size", "16", "--nnodes", "2", "--nproc-per-node", "4"])
    assert "--world-size 16 is not --nnodes 2 × --nproc-per-node 4 = 8" in err


@pytest.mark.parametrize("argv", [["--to-megatron", "--load", "ck", "--output", "out", "--max-shard-size", "1KB"],
                                  ["--from-hf", "hf", "--save", "out", "--hf-architecture", "mistral"]])
def test_a_to_hf_flag_with_another_direction_is_refused(capsys, argv):
    """--max-shard-size / --hf-architecture were silently ignored by the other directions."""
    err = _refused(capsys, ["convert", *argv])
    assert f"{argv[-2]} shapes the Hugging Face folder --to-hf writes; {argv[0]} writes none: drop {argv[-2]}" in err


def _gpt2_files(tmp_path):
    """A byte-level GPT-2 vocab.json (256 bytes + <|endoftext|>: 257 ids), merges.txt, and a data prefix."""
    import json

    import numpy as np

    from meshlm.data.indexed import IndexedDatasetWriter
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    vocab = {chr(c): i for i, c in enumerate(chars)}
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    prefix = str(tmp_path / "d_text_document")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2, 256])
    w.finalize()
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), prefix


def test_tokenizer_files_without_a_type_are_checked_as_the_type_they_imply(tmp_path, capsys):
    """Megatron's GPT-3 example passes --vocab-file/--merge-file without --tokenizer-type. The workers
    build the type the files imply (GPT2BPETokenizer, HuggingFaceTokenizer for --tokenizer-model),
    but the checks before them read --tokenizer-type alone: refused ('needs --tokenizer-type')
    unless a --vocab-size was added, which then skipped the files' existence check and planned the
    memory for an assumed 32000-token vocabulary."""
    vocab, merges, prefix = _gpt2_files(tmp_path)
    dry = SHAPE + ["--data-path", prefix, "--dry-run", "--world-size", "1"]
    assert main(dry + ["--vocab-file", vocab, "--merge-file", merges]) == 0
    assert "(vocabulary 257, " in capsys.readouterr().out
    missing = str(tmp_path / "gone.txt")
    err = _refused(capsys, dry + ["--vocab-file", vocab, "--merge-file", missing, "--vocab-size", "300"])
    assert err.endswith(f"--merge-file {missing}: no such file")
    err = _refused(capsys, dry + ["--tokenizer-model", missing, "--vocab-size", "300"])
    assert err.endswith(f"--tokenizer-model {missing}: no such file")


def test_a_cpu_model_larger_than_the_host_is_one_line_before_any_worker(tmp_path, capsys, monkeypatch):
    """--hidden-size 10**9 on CPU failed in the model's constructor with a 'DefaultCPUAllocator: can't
    allocate memory' traceback (and --num-layers 10**8 built layers for minutes)."""
    from meshlm.validate import host_model_problems
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = ["pretrain", "--mock-data", "--num-layers", "1", "--hidden-size", "1000000000", "--num-attention-heads", "2",
            "--seq-length", "16", "--vocab-size", "50", "--train-iters", "2", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshlm: error: the model does not fit this host's memory: a rank "
                                                   "at TP 1 × PP 1 × DP 1 holds 12,000,000,"), err
    assert "shrink the model (--num-layers, --hidden-size, --ffn-hidden-size, --vocab-size)" in err
    from test_trainer import tiny_config
    cfg = tiny_config(str(tmp_path))  # 16 bytes a parameter with Adam: ~27k parameters, 0.4 MB
    assert host_model_problems(cfg, 1, cuda=False, available=1e6) == []
    assert host_model_problems(cfg, 1, cuda=False, available=1e5)[0].startswith("the model does not fit")
    assert host_model_problems(cfg, 1, cuda=True, available=1e5) == []  # a GPU run's state is on the GPU
    # --micro-batch-size 10**9 on mock data collated samples for minutes: the logits alone bound it
    cfg.training.micro_batch_size = cfg.training.global_batch_size = 1000  # 1000 × 16 × 112 × 4 B = 7.2 MB
    assert host_model_problems(cfg, 1, cuda=False, available=1e7) == []
    (line,) = host_model_problems(cfg, 1, cuda=False, available=7e6)
    assert line.startswith("a micro-batch does not fit this host's memory: its fp32 logits alone, --micro-batch-size "
                           "1000 × --seq-length 16 × 112 vocabulary rows × 4 bytes = 0.0 GiB") and \
        line.endswith("lower --micro-batch-size or --seq-length")


@pytest.mark.parametrize("action", ["inspect", "verify"])
def test_checkpoint_commands_name_dir_not_load_for_a_bad_tracker_or_a_damaged_latest(tmp_path, capsys, action):
    """The loading code's messages named '--load DIR' and told to 'load an earlier iteration'."""
    import torch
    from meshlm.checkpoint import dist as ckpt
    root = str(tmp_path / "save")
    ckpt.save(root, 1, {"model": {"w": torch.zeros(2)}})
    os.remove(os.path.join(root, "iter_0000001", "__0_0.distcp"))
    err = _refused(capsys, ["checkpoint", action, root])
    assert err == (f"meshlm: error: {root}: checkpoint iter_0000001 is damaged or incomplete (__0_0.distcp is missing); "
                   f"give one of its earlier iter_XXXXXXX folders, or re-save")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("9\n")
    err = _refused(capsys, ["checkpoint", action, root])
    assert err.startswith(f"meshlm: error: {root}: latest_checkpointed_iteration.txt names iteration 9") and \
        "--load" not in err


@pytest.mark.parametrize("damage", ["bin_short", "bin_long", "idx_short", "idx_magic"])
def test_a_damaged_indexed_dataset_is_refused_before_any_worker_naming_the_flag(tmp_path, capsys, damage):
    """A .bin cut short (a copy interrupted), a .bin of another .idx or a .idx that is no index passed the
    dry run ("all checks passed") and the launch's checks, and stopped the workers after the run
    directory was made."""
    prefix = tmp_path / "d_text_document"
    _dataset(prefix)
    path = tmp_path / ("d_text_document.bin" if damage.startswith("bin") else "d_text_document.idx")
    data = path.read_bytes()
    path.write_bytes({"bin_short": data[:-2], "bin_long": data * 2, "idx_short": data[:-8],
                      "idx_magic": b"not an index" + data}[damage])
    data_flags = ["--data-path", "0.5", str(prefix), "0.5", str(prefix), "--vocab-size", "64",
                  "--tokenizer-type", "NullTokenizer"]
    for launch in (["--dry-run"], ["--run-dir", str(tmp_path / "run")]):
        err = _refused(capsys, SHAPE + data_flags + launch)
        assert err.startswith(f"meshlm: error: --data-path: {path}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("files, message", [
    (["--vocab-file", "v.json", "--vocab-size", "64"], "meshlm: error: --vocab-file v.json without --merge-file: "
                                                       "GPT2BPETokenizer reads both; give --merge-file too"),
    (["--merge-file", "m.txt", "--vocab-size", "64"], "meshlm: error: --merge-file m.txt without --vocab-file"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--tokenizer-model", "typo.json"],
     "meshlm: note: --tokenizer-model typo.json ignored with NullTokenizer, which does not read it"),
])
def test_a_tokenizer_file_the_tokenizer_does_not_read_is_named(tmp_path, monkeypatch, capsys, files, message):
    """`--vocab-file v.json --vocab-size N` without --merge-file trained NullTokenizer ids and dropped
    the vocabulary without a word (GPT2BPETokenizer is implied by the two files together)."""
    monkeypatch.chdir(tmp_path)
    _dataset(tmp_path / "d_text_document")
    (tmp_path / "v.json").write_text('{"<|endoftext|>": 0}')
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    code = main(SHAPE + ["--data-path", "d_text_document", *files, "--dry-run"])
    out = capsys.readouterr()
    assert code == (2 if "error" in message else 0) and message in out.err + out.out, out.err


@pytest.mark.parametrize("size, problem", [("infGB", "give a finite size of at least 1 byte"),
                                           ("1e400", "give a finite size of at least 1 byte"),
                                           ("0.5B", "give a finite size of at least 1 byte")])
def test_a_max_shard_size_that_is_no_size_is_one_line(capsys, size, problem):
    """`--max-shard-size infGB` was an OverflowError traceback and `0.5B` 0 bytes, which wrote one
    unsharded file; TB and TiB, refused as "not a size", are sizes."""
    from meshlm.checkpoint.convert import _size
    err = _refused(capsys, ["convert", "--to-hf", "--load", "ck", "--output", "out", "--max-shard-size", size])
    assert f"--max-shard-size: {size!r}: {problem}" in err and len(err.splitlines()) == 1
    assert (_size("2TB"), _size("1TiB")) == (2 * 10**12, 2**40)


def test_a_model_sized_by_its_vocabulary_padding_names_the_padding_flag(tmp_path, capsys, monkeypatch):
    """--make-vocab-size-divisible-by 10**9 padded 128 ids to 10**9 rows (64 billion parameters): the
    error's fixes named --vocab-size, which changes nothing there."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    err = _refused(capsys, ["pretrain", "--model", "tiny", "--mock-data", "--vocab-size", "128",
                            "--make-vocab-size-divisible-by", "1000000000", "--nproc-per-node", "1",
                            "--run-dir", str(tmp_path / "run")])
    assert "--make-vocab-size-divisible-by 1000000000: it pads the 128 ids to 1,000,000,000 rows" in err, err


def test_a_resume_whose_checkpoint_consumed_more_a_step_than_this_global_batch_is_one_line():
    """Saved at DP=2 (default global batch 8), resumed at DP=1 (default 4): the training data, sized
    --train-iters × 4 from sample 0, ran out at the first step past it (a StopIteration traceback)."""
    from types import SimpleNamespace

    from meshlm.batches import BatchSchedule
    from meshlm.errors import CheckpointError
    from meshlm.training.checkpointing import TrainState, check_data_lasts

    def run(global_batch):
        return SimpleNamespace(train_ds=[None] * 4 * global_batch, train_iters=4, cfg=SimpleNamespace(
            checkpoint=SimpleNamespace(load="ck")), batches=BatchSchedule(global_batch, 4))
    saved = TrainState(iteration=2, consumed_samples=16)
    check_data_lasts(run(8), saved)  # the checkpoint's own batch: the data lasts
    with pytest.raises(CheckpointError) as e:
        check_data_lasts(run(4), saved)
    assert str(e.value).startswith("--load ck: the checkpoint is at iteration 2 with 16 samples consumed") and \
        "give --global-batch-size 8 or more" in str(e.value) and "\n" not in str(e.value)
    # under a step schedule its first steps take less than its last batch: that sum is named, not G × steps
    stepped = run(8)
    stepped.batches, stepped.train_ds = BatchSchedule(8, 4, steps=((0, 4), (4, 8))), [None] * 20
    with pytest.raises(CheckpointError) as e:
        check_data_lasts(stepped, saved)
    assert "16 samples consumed, more than the 12 of this run's first 2 steps by its --step-batch-size-schedule; " \
           "its training data, sized from sample 0 by that schedule, holds 20 samples" in str(e.value)


@pytest.mark.parametrize("flags, kind", [(dict(tokenizer_model="tok.json"), "HuggingFaceTokenizer"),
                                         (dict(vocab_file="v.json", merge_file="m.txt"), "GPT2BPETokenizer")])
def test_to_megatron_writes_the_tokenizer_type_its_files_implied(flags, kind):
    """A run given only --tokenizer-model tok.json (HuggingFaceTokenizer implied) was exported with
    tokenizer_type None in common.pt's args, so `convert --from-megatron` of it took NullTokenizer:
    `generate` then wanted token ids, not text."""
    from meshlm.checkpoint.megatron import data_from_args
    from meshlm.checkpoint.megatron_convert import megatron_args
    from meshlm.config import Config
    cfg = Config()
    for name, value in flags.items():
        setattr(cfg.data, name, value)
    assert data_from_args(megatron_args(cfg, 300, 384)) == dict(tokenizer_type=kind, **flags)


def test_dry_run_warns_of_a_rank_larger_than_any_gpu(capsys):
    """--micro-batch-size 10**8 dry-ran to "all checks passed" with ~1.9 million GiB a rank, no word of it."""
    assert main(["pretrain", "--mock-data", "--vocab-size", "256", "--micro-batch-size", str(10 ** 8),
                 "--global-batch-size", str(10 ** 8), "--dry-run", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "GiB a rank is more than any GPU preset holds (H200-141GB" in out
    assert main(["pretrain", "--mock-data", "--vocab-size", "256", "--dry-run", "--world-size", "1"]) == 0
    assert "more than any GPU" not in capsys.readouterr().out


def test_fewer_layers_than_pipeline_stages_is_not_told_to_split_them_unevenly(capsys):
    """--num-layers 1 --pipeline-model-parallel-size 2 was told to set --decoder-first/last-pipeline-num-layers,
    which cannot give two stages a layer each."""
    assert main(["pretrain", "--mock-data", "--vocab-size", "256", "--num-layers", "1",
                 "--pipeline-model-parallel-size", "2", "--dry-run", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fewer than --pipeline-model-parallel-size 2 stages" in err and "decoder-first" not in err


@pytest.mark.parametrize("flags,line", [
    (["--lr-warmup-fraction", "-0.1"], "--lr-warmup-fraction -0.1 is out of range: give a number ≥ 0"),
    (["--tokenizer-type", "NullTokenizer", "--null-tokenizer-eod-id", "-3"],
     "--null-tokenizer-eod-id -3 is out of range: give an integer ≥ 0"),
    (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "nan"],
     "--optimizer-offload-fraction nan is out of range: give a number ≥ 0")])
def test_a_value_out_of_range_is_one_line_not_one_per_rule(capsys, flags, line):
    """Each gave "2 config errors": the numeric rule's and the flag's own rule's about the same value."""
    assert main(["pretrain", "--mock-data", "--vocab-size", "256", *flags, "--dry-run", "--world-size", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"meshlm: error: {line}"]


@pytest.mark.parametrize("flags,given", [
    (["--tokenizer-model", "tok.json"], "--tokenizer-model tok.json"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], "--tokenizer-type NullTokenizer, --vocab-size 1000")])
def test_a_tokenizer_flag_without_a_data_flag_is_refused_not_dropped(tmp_path, monkeypatch, capsys, flags, given):
    """The embedded default's launch replaced --tokenizer-model / --vocab-size by its own BPE tokenizer
    without a word (a model of 4096 ids, not the user's), while its dry run reported the user's vocabulary."""
    import meshlm.data.corpus as corpus
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(corpus, "prepare_default_corpus", lambda run_dir: pytest.fail("the corpus was prepared"))
    for extra in (["--dry-run"], ["--run-dir", "run"]):
        err = _refused(capsys, ["pretrain", *flags, *extra])
        assert err.splitlines() == [f"meshlm: error: {given}: given without a data flag, where the embedded default "
                                    f"trains on its own corpus with its own BPE tokenizer of 4096 ids; give the "
                                    f"--data-path preprocessed with it (meshlm preprocess), or drop "
                                    f"{' and '.join(f for f in flags if f.startswith('--'))}"]
    assert not (tmp_path / "run").exists()


def test_the_embedded_defaults_dry_run_counts_its_own_tokenizers_vocabulary(tmp_path, monkeypatch, capsys):
    """It counted parameters and memory with a 32000-id vocabulary "assumed: the tokenizer is not known yet"
    (2.3M parameters a rank, five times the launch's), though `meshlm plan` of the same run says 4096."""
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(vocabulary 4096, the embedded default's BPE tokenizer)" in out and "assumed" not in out


@pytest.mark.parametrize("kind,line", [
    ("GPT2BPETokenizer", "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    ("HuggingFaceTokenizer", "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json)"),
    ("TikTokenizer", "--tokenizer-type TikTokenizer needs --tokenizer-model (Megatron's tiktoken vocabulary .json)")])
def test_preprocess_without_the_tokenizers_file_says_what_pretrain_says(tmp_path, capsys, kind, line):
    """preprocess said "--vocab-file is required by this --tokenizer-type" (which type, and that --merge-file
    is needed too, unsaid), where pretrain's check names both: one rule, data/tokenizer_base.missing_files."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    assert main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
                 "--tokenizer-type", kind]) == 2
    assert capsys.readouterr().err.splitlines() == [f"meshlm: error: {line}"]
    assert line in _refused(capsys, SHAPE + ["--tokenizer-type", kind, "--data-path", str(tmp_path / "c"), "--dry-run"])
    assert not list(tmp_path.glob("c_*"))
