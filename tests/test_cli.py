"""The `meshlm` command: help texts, and user errors as one line on stderr with exit status 2."""

import os
import subprocess
import sys

import pytest
import yaml

from meshlm.cli import build_parser, main, resolve_config
from meshlm.config import query_groups

TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--nproc-per-node", "2"]


def meshlm(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    return subprocess.run([sys.executable, "-m", "meshlm", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_lists_every_command(tmp_path):
    out = meshlm("--help", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == ""
    for command in ("pretrain", "preprocess", "tokenizer", "generate", "convert", "plan", "analyze", "report"):
        assert command in out.stdout


@pytest.mark.parametrize("argv,expect", [(["pretrain"], "--tensor-model-parallel-size"),
                                         (["preprocess"], "--output-prefix"),
                                         (["tokenizer", "train"], "--vocab-size"),
                                         (["generate"], "--"), (["report"], "--trace")])
def test_subcommand_help_is_clean(argv, expect, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    out = capsys.readouterr()
    assert info.value.code == 0 and out.err == "" and expect in out.out


@pytest.mark.slow
def test_bad_global_batch_exits_2_with_one_line(tmp_path):
    out = meshlm("pretrain", "--global-batch-size", "7", "--micro-batch-size", "2", *TINY, cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshlm: error: --global-batch-size 7")
    assert "--micro-batch-size 2" in lines[0] and "4 or 8" in lines[0]
    assert "Traceback" not in out.stdout
    assert not os.path.exists(tmp_path / "runs")  # nothing written for a config that fails


def test_several_problems_are_listed_together(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["pretrain", *TINY, "--global-batch-size", "7", "--micro-batch-size", "2",
                 "--tensor-model-parallel-size", "3", "--save-interval", "5"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("meshlm: error: ") and "config errors" in err
    for flag in ("--global-batch-size", "--tensor-model-parallel-size 3", "--save-interval"):
        assert flag in err


def test_unknown_yaml_key_exits_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("hiden_size: 64\n")
    assert main(["pretrain", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"meshlm: error: {path}: unknown key 'hiden_size'\n"


def test_argparse_errors_also_exit_2(capsys):
    assert main(["pretrain", "--num-layers", "two"]) == 2
    assert capsys.readouterr().err == ("meshlm: error: argument --num-layers: 'two' is not an integer; "
                                       "see `meshlm pretrain --help`\n")


def test_errors_of_delegated_commands_are_one_line(tmp_path, capsys):
    code = main(["tokenizer", "train", "--input", str(tmp_path / "absent.jsonl"),
                 "--output", str(tmp_path / "tok.json")])
    assert code == 2
    assert capsys.readouterr().err.startswith("meshlm: error: --input")


def test_resolve_writes_the_config_workers_read_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser("pretrain").parse_args(["pretrain", *TINY, "--lr", "0.002"])
    cfg = resolve_config(args)
    assert cfg.logging.run_dir.startswith("runs" + os.sep)
    path = os.path.join(cfg.logging.run_dir, "config.yaml")
    saved = yaml.safe_load(open(path))
    assert saved["optimizer"]["lr"] == 0.002 and saved["logging"]["run_dir"] == cfg.logging.run_dir
    again = resolve_config(build_parser("pretrain").parse_args(["pretrain", "--config", path]))
    assert again == cfg


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser("pretrain").parse_args(["pretrain", *TINY])
    first, second = resolve_config(args).logging.run_dir, resolve_config(args).logging.run_dir
    assert first != second


def test_python_dash_m_meshlm_runs_the_cli(tmp_path):
    out = meshlm("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("meshlm ")


def test_abbreviated_flags_are_errors_as_in_megatron(capsys):
    """--lr-warmup is not silently taken as --lr-warmup-iters (Megatron sets allow_abbrev=False)."""
    from meshlm.cli import main
    assert main(["pretrain", "--mock-data", "--vocab-size", "100", "--lr-warmup", "5"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--lr-warmup" in line


def test_a_bad_flag_value_names_its_kind_in_words_on_one_line(capsys):
    assert main(["pretrain", "--global-batch-size", "1e3"]) == 2
    assert main(["pretrain", "--use-cpu-initialization", "maybe"]) == 2
    assert main(["pretrain", "--lr", "fast"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshlm: error: argument --global-batch-size: '1e3' is not an integer (write 1000); "
        "see `meshlm pretrain --help`",
        "meshlm: error: unexpected argument(s) maybe; see `meshlm pretrain --help`",
        "meshlm: error: argument --lr: 'fast' is not a number; see `meshlm pretrain --help`"]


@pytest.mark.parametrize("argv, line", [
    (["pretrain", "--split", "-1,2,3", "--dry-run"], "--split '-1,2,3' has a negative or non-finite weight"),
    (["pretrain", "--lr", "-1e-3", "--dry-run"], "--lr -0.001 is out of range"),
    (["plan", "--init-method-std", "-.02"], "--init-method-std -0.02 is out of range"),
    (["sweep", "--sweep-dir", "s", "--lr", "-1e-3,1e-2"], "--lr -1e-3,1e-2: '-1e-3' is not a finite positive value"),
])
def test_a_value_starting_with_a_dash_reaches_its_flags_check(argv, line, capsys):
    """argparse takes `-1,2,3` or `-1e-3` (not its idea of a negative number) for a flag and said only
    "argument --split: expected one argument"; the value now reaches the flag's own range check."""
    assert main(argv) == 2
    [err] = [x for x in capsys.readouterr().err.splitlines()]
    assert line in err


@pytest.mark.parametrize("argv", [
    ["pretrain", "--mock-data", "--vocab-size", "64", "--dry-run", "--save", "", "--load="],
    ["tokenizer", "train", "--input", "c.jsonl", "--output", ""],
    ["preprocess", "--input", "c.jsonl", "--output-prefix", "", "--tokenizer-type", "NullTokenizer"],
    ["plan", "--gpu-profile", ""],
    ["report", "run", "--output="],
])
def test_an_empty_flag_value_is_refused_naming_the_flag(argv, capsys):
    """`--save $CKPT` with CKPT unset trained without saving, `--load ''` started afresh, `--config ''`
    ran the defaults, tokenizer train --output '' trained, then raised FileNotFoundError."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    flags = [a.rstrip("=") for i, a in enumerate(argv) if a.endswith("=") or (i + 1 < len(argv) and argv[i + 1] == "")]
    assert all(f"{flag} is given an empty value" in err for flag in flags) and "Traceback" not in err


@pytest.mark.parametrize("argv, hint", [(["tokenizer", "train", "--input", "c", "--output", "t", "--foo"],
                                        "meshlm tokenizer train --help"),
                                       (["checkpoint", "inspect", "ck", "--foo"], "meshlm checkpoint inspect --help")])
def test_an_unknown_flag_of_an_action_names_the_actions_help(argv, hint, capsys):
    """It said `meshlm tokenizer --help`, which lists the actions, not the flag's neighbours."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(f"see `{hint}`")


def test_an_empty_prompt_is_still_a_prompt():
    from meshlm.cli import empty_values
    assert empty_values(build_parser("generate"), ["generate", "--load", "ck", "--prompt", ""]) == []


def test_a_dash_value_is_joined_to_its_flag_but_a_flag_is_not():
    from meshlm.cli import attach_dash_values
    parser = build_parser("generate")
    assert attach_dash_values(parser, ["generate", "--prompt", "-x", "--top-k", "-h", "--", "--seed", "-1"]) == [
        "generate", "--prompt=-x", "--top-k", "-h", "--", "--seed", "-1"]


@pytest.mark.parametrize("argv, line", [
    (["generate", "--load", "ck", "--max-new-tokens", "1e3"], "argument --max-new-tokens: '1e3' is not an integer "
                                                             "(write 1000); see `meshlm generate --help`"),
    (["generate", "--load", "ck", "--temperature", "hot"], "argument --temperature: 'hot' is not a number"),
    (["plan", "--num-gpus", "8x"], "argument --num-gpus: '8x' is not an integer; see `meshlm plan --help`"),
])
def test_a_subcommands_own_number_flag_says_its_kind_in_words(argv, line, capsys):
    """argparse's "invalid int value: '1e3'" there, while pretrain's flags said "(write 1000)"."""
    assert main(argv) == 2
    assert line in capsys.readouterr().err


def test_the_embedded_defaults_own_save_folder_counts_for_the_notes(tmp_path, monkeypatch, capsys):
    """`meshlm pretrain --async-save` (no --save) was told "--async-save ignored without --save" and
    then saved in the background into <run dir>/checkpoints."""
    import meshlm.data.corpus as corpus
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "--async-save", "--dry-run"]) == 0
    assert "--async-save ignored" not in capsys.readouterr().out

    def stop(run_dir):
        raise KeyboardInterrupt  # the notes are out by now; preparing the corpus takes a while
    monkeypatch.setattr(corpus, "prepare_default_corpus", stop)
    assert main(["pretrain", "--async-save", "--run-dir", "run"]) == 130
    assert "--async-save ignored" not in capsys.readouterr().out


def test_the_embedded_defaults_dry_run_checks_load(tmp_path, monkeypatch, capsys):
    """Its dry run passed a --load with no checkpoint in it (the launch refused it after preparing
    the corpus): --load was among the data files its first check leaves out."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("x")
    assert main(["pretrain", "--load", "run", "--dry-run"]) == 2
    assert "--load run is not a meshlm checkpoint directory" in capsys.readouterr().err


def test_num_query_groups_without_gqa_is_a_note_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = build_parser("pretrain").parse_args(
        ["pretrain", "--mock-data", "--vocab-size", "128", "--num-query-groups", "2", "--run-dir", "run"])
    cfg = resolve_config(args)
    assert query_groups(cfg.model) == cfg.model.num_attention_heads
    notes = [line for line in capsys.readouterr().out.splitlines() if "note: --num-query" in line]
    assert notes == ["meshlm: note: --num-query-groups 2 is ignored without --group-query-attention (as in "
                     "Megatron): every attention head keeps its own key/value head; add "
                     "--group-query-attention to use 2 groups"]


def _embedded(*flags):
    from meshlm.config import config_from_args, explicit_fields
    from meshlm.cli import _fit_embedded, embedded_default
    args = build_parser("pretrain").parse_args(["pretrain", *flags])
    cfg = config_from_args(args, base=embedded_default())
    _fit_embedded(cfg, explicit_fields(args))
    return cfg


@pytest.mark.parametrize("gpus, micro, batch", [(1, 4, 16), (2, 4, 16), (3, 3, 18), (8, 2, 16), (32, 1, 32)])
def test_the_embedded_default_fits_its_batch_to_every_gpu_count(monkeypatch, gpus, micro, batch):
    """On 8 GPUs `meshlm pretrain` with no flags was refused: "--global-batch-size 16 is not divisible
    by --micro-batch-size 4 × DP 8" (the README: it trains as DP over every local GPU)."""
    import torch
    from meshlm.validate import validate
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _embedded()
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (micro, batch)
    validate(cfg, gpus, check_files=False, cuda=True)
    cfg = _embedded("--global-batch-size", "16")  # a batch flag of the user's: left to the checks
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (4, 16)


@pytest.mark.parametrize("flags, tp, pp", [([], 2, 2), (["--nproc-per-node", "1"], 1, 1),
                                           (["--nproc-per-node", "2"], 2, 1), (["--nproc-per-node", "6"], 2, 1),
                                           (["--nproc-per-node", "8"], 2, 2), (["--num-layers", "1"], 2, 1),
                                           (["--num-attention-heads", "1", "--hidden-size", "64"], 1, 2)])
def test_the_embedded_cpu_layout_gives_way_to_the_users_flags(monkeypatch, flags, tp, pp):
    """`meshlm pretrain --nproc-per-node 1` on CPU was refused: 'world size 1 is not divisible by
    TP×CP×PP = 2×1×2; set --nproc-per-node to a multiple of 4' (a layout the user never gave)."""
    import torch
    from meshlm.validate import validate
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _embedded(*flags)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (tp, pp)
    validate(cfg, check_files=False, cuda=False)
    cfg = _embedded("--nproc-per-node", "1", "--pipeline-model-parallel-size", "1")  # a layout flag: the user's
    assert cfg.parallel.tensor_model_parallel_size == 2


@pytest.mark.parametrize("extra, warmup", [([], 0), (["--lr-warmup-iters", "3"], 3)])
def test_a_short_embedded_default_run_scales_its_warmup(extra, warmup):
    from meshlm.validate import validate
    cfg = _embedded("--train-iters", "5", *extra)
    assert cfg.optimizer.lr_warmup_iters == warmup
    validate(cfg, check_files=False)
    assert _embedded("--train-iters", "100").optimizer.lr_warmup_iters == 10  # the README's shorter run keeps the full warm-up


@pytest.mark.parametrize("extra, iters, samples", [([], 0, 160), (["--lr-warmup-samples", "7"], 0, 7),
                                                   (["--lr-warmup-fraction", "0.2"], 0, 0)])
def test_the_embedded_default_takes_train_samples_and_a_users_warmup(extra, iters, samples):
    """--train-samples replaces the default's 500 iterations; its warm-up of 10 iterations becomes
    10 global batches (16 samples each) of samples, unless the user gives a warm-up flag."""
    from meshlm.validate import validate
    cfg = _embedded("--train-samples", "4000", *extra)
    o = cfg.optimizer
    assert cfg.training.train_iters is None and (o.lr_warmup_iters, o.lr_warmup_samples) == (iters, samples)
    validate(cfg, check_files=False)
    assert _embedded("--train-samples", "320").optimizer.lr_warmup_samples == 32  # a tenth of the run
    fraction = _embedded("--lr-warmup-fraction", "0.1")  # formerly refused: the default's iterations stayed
    assert fraction.optimizer.lr_warmup_iters == 0
    validate(fraction, check_files=False)


@pytest.mark.parametrize("extra", [["--train-iters", "20"], ["--train-samples", "400"]])
def test_the_embedded_default_takes_a_users_step_schedule(monkeypatch, extra):
    """`meshlm pretrain --step-batch-size-schedule "0:8 1K:32"` was refused: "--global-batch-size 16
    disagrees with the last ... entry's batch 32; drop --global-batch-size" (the default's 16)."""
    import torch
    from meshlm.validate import validate
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _embedded("--step-batch-size-schedule", "0:8 1K:32", *extra)
    assert cfg.training.global_batch_size is None
    validate(cfg, check_files=False, cuda=False)


def test_a_fresh_run_sets_an_earlier_runs_logs_aside_and_a_resume_keeps_them(tmp_path, monkeypatch, capsys):
    """--run-dir re-used without --load: the earlier run's logs and config.yaml are renamed (one note
    names where), never overwritten; with --load (a resume) they stay for the trainer to trim."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"

    def resolve(*extra):
        resolve_config(build_parser("pretrain").parse_args(["pretrain", *TINY, "--run-dir", "run", *extra]))
        return [x for x in capsys.readouterr().out.splitlines() if "earlier run" in x]

    assert resolve() == []  # an empty run directory: nothing to move
    (run / "logs").mkdir()
    (run / "logs" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (run / "logs" / "rank0.log").write_text("first run\n")
    [note] = resolve()
    [old_logs] = [p for p in run.iterdir() if p.name.startswith("logs.")]
    [old_config] = [p for p in run.iterdir() if p.name.startswith("config.") and p.name != "config.yaml"]
    assert f"run/{old_logs.name} " in note and f"run/{old_config.name} " in note and "--load" in note
    assert (old_logs / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    assert (old_logs / "rank0.log").read_text() == "first run\n" and not (run / "logs").exists()
    assert (run / "config.yaml").exists() and old_config.read_text()
    (run / "logs").mkdir()
    (run / "logs" / "metrics.jsonl").write_text('{"iteration": 2}\n')
    assert resolve("--load", "ckpt", "--save", "ckpt") == []  # a resume keeps its logs
    assert (run / "logs" / "metrics.jsonl").read_text() == '{"iteration": 2}\n'
    (run / "metrics.jsonl").write_text('{"iteration": 3}\n')  # --log-dir = the run dir: its files move
    [note] = resolve("--log-dir", "run")
    [inner] = [p for p in run.glob("logs.*/metrics.jsonl") if p.read_text() == '{"iteration": 3}\n']
    assert f"run/{inner.parent.name} " in note and not (run / "metrics.jsonl").exists()


def test_a_reader_that_closes_the_pipe_ends_a_command_quietly(tmp_path):
    """`meshlm checkpoint inspect CK | head` (and plan, analyze, …) ended in a BrokenPipeError
    traceback: main() now stops every command as a pipe's writer does (141, nothing on stderr)."""
    import json
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "metrics.jsonl").write_text("".join(json.dumps(
        {"iteration": i, "consumed_samples": i, "iter_ms": 100.0, "lm_loss": 5.0, "lr": 1e-3}) + "\n" for i in (1, 2)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    proc = subprocess.Popen([sys.executable, "-m", "meshlm", "analyze", "run", "--no-predict"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line (as `| head` after its lines)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err
