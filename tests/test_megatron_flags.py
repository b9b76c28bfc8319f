"""Megatron-LM flags: the three sets, switches, --gradient-accumulation-steps and --dry-run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.megatron_flags import MEGATRON_FLAGS, NO_EFFECT

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_llama3_8b_distributed.sh"


def _dataset(prefix):
    """A valid indexed dataset of one document (ids 0, 1) at ``prefix``: a launch opens its .idx."""
    from meshlm.data.indexed import IndexedDatasetWriter
    writer = IndexedDatasetWriter(str(prefix))
    writer.add_document([0, 1])
    writer.finalize()


def _gpt3(tmp_path):
    """Megatron's examples/gpt3/train_gpt3_175b_distributed.sh flags, paths replaced."""
    _dataset(tmp_path / "d_text_document")
    (tmp_path / "vocab.json").write_text('{"<|endoftext|>": 0, "a": 1, "b": 2}')  # a GPT-2 vocabulary of 3
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return ["pretrain", "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
            "--micro-batch-size", "1", "--global-batch-size", "1536",
            "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", "--train-iters", "500000",
            "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
            "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
            "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
            "--data-path", str(tmp_path / "d_text_document"), "--vocab-file", str(tmp_path / "vocab.json"),
            "--merge-file", str(tmp_path / "merges.txt"), "--split", "949,50,1",
            "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--eval-iters", "10",
            "--tensorboard-dir", str(tmp_path / "tb"), "--dry-run", "--world-size", "1024"]


def test_gpt3_example_dry_runs_unchanged_with_its_step_batch_size_schedule(tmp_path, capsys):
    """Megatron's current GPT-3 175B example: --step-batch-size-schedule in tokens beside an agreeing
    --global-batch-size (Megatron itself refuses the two together)."""
    assert main(_gpt3(tmp_path)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TP 8 × CP 1 × PP 16 × DP 8" in out and "global 1536" in out and "12+4+2" not in out
    # 2.4B tokens are 1,171,875 samples of 2,048: the first step at or past them is 73,244 (16 × 73,243)
    assert "16 (2 micro-batches) from iteration 1 (sample 0), 320 (40 micro-batches) from iteration 73,244 " \
           "(sample 1,171,888)" in out
    assert f"(vocabulary 3, {tmp_path / 'vocab.json'})" in out  # the --vocab-file's size, not GPT-2's 50257
    assert not (tmp_path / "ckpt").exists()


def _llama3_fp8(tmp):
    """Megatron's examples/llama/train_llama3_8b_h100_fp8.sh with its mock data, as its bash passes it:
    every flag, `--split "'99,1,0'"` with the quotes (an array element word-split), paths under tmp."""
    return ("pretrain --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
            "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
            "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
            "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 "
            "--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
            "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 "
            "--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
            "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
            "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
            "--empty-unused-memory-level 1 --exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce "
            "--overlap-param-gather --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max "
            "--fp8-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path CACHE --tiktoken-pattern v2 "
            "--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 "
            "--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile "
            "--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
            "--save CKPT --load CKPT --tensorboard-dir TB --dry-run --world-size 64").replace(
        "CACHE", str(tmp / "cache")).replace("CKPT", str(tmp / "ckpt")).replace("TB", str(tmp / "tb")).split()


def test_llama3_fp8_example_dry_runs_unchanged(tmp_path, capsys):
    """Megatron-LM's Llama 3 8B FP8 example, every flag: --apply-layernorm-1p, --decoupled-lr and
    --grad-reduce-in-bf16 were refused; then the delayed recipe's amax flags (Megatron's default
    recipe, meshlm's is tensorwise) and the quoted split."""
    assert main(_llama3_fp8(tmp_path)) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert f"run: --train-samples 1953125000 = {1953125000 // 128} iterations" in captured.out
    assert "--train-iters" not in captured.out  # its meshlm default does not apply to a run given in samples
    assert "--fp8-amax-history-len 1024 / --fp8-amax-compute-algo max have no effect under --fp8-recipe " \
           "tensorwise" in captured.out
    assert not (tmp_path / "ckpt").exists()


def test_gpt3_example_with_megatrons_ramp_and_sample_schedule_dry_runs(tmp_path, capsys):
    """Megatron's train_gpt3_175b_distributed.sh as published: a batch ramp 16 → 1536 by 16 over
    5,859,375 samples and the run and LR schedule in samples."""
    argv = _gpt3(tmp_path)
    for flag, values in (("--step-batch-size-schedule", 1), ("--train-iters", 1), ("--lr-warmup-fraction", 1),
                         ("--lr-decay-iters", 1)):
        i = argv.index(flag)
        del argv[i:i + 1 + values]
    argv += ["--rampup-batch-size", "16", "16", "5859375", "--train-samples", "146484375",
             "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105", "--tokenizer-type", "GPT2BPETokenizer"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "global 16 → 1536 by 16 (95 increments, one per 61677.6 samples, 2 → 192 micro-batches)" in out
    assert "run: --train-samples 146484375 = " in out


def test_switches_and_no_effect_flags_dry_run(capsys):
    argv = ["pretrain", "--mock-data", "--vocab-size", "1000", "--use-cpu-initialization",
            "--accumulate-allreduce-grads-in-fp32", "--use-mcore-models", "--attention-backend", "auto",
            "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32", "--cross-entropy-fusion-impl", "te",
            "--dry-run", "--world-size", "4", "--micro-batch-size", "2", "--gradient-accumulation-steps", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "accepted with no effect" in out and "--use-mcore-models" in out and "--attention-softmax-in-fp32" in out
    assert "global 24 = micro 2 × 3 micro-batches × DP 4" in out


def test_common_megatron_logging_optimizer_and_legacy_flags_are_taken(capsys):
    """Flags frequent in Megatron's scripts and test configs: --optimizer adam (Megatron's Adam is
    AdamW), --dataloader-type single, the legacy --use-rotary-position-embeddings (it sets rope),
    --log-params-norm / --log-num-zeros-in-grad (logged) and the TensorBoard and timing switches
    meshlm always honours; --optimizer sgd, --dataloader-type cyclic and --ckpt-format torch (Megatron's
    legacy files, which meshlm does not write: it was accepted as having no effect) are refused
    naming the flag."""
    base = ["pretrain", "--mock-data", "--vocab-size", "1000", "--dry-run", "--world-size", "1"]
    extra = ["--optimizer", "adam", "--dataloader-type", "single", "--use-rotary-position-embeddings",
             "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
             "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--timing-log-level", "2"]
    assert main(base + extra) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "--log-memory-to-tensorboard" in out and "--timing-log-level 2" in out  # the no-effect note
    from meshlm.config import Config, apply_mapping
    from meshlm.parallel.layout_rules import adjust
    cfg = Config()
    apply_mapping(cfg, {"use_rotary_position_embeddings": True, "cp_comm_type": "allgather"}, source="test")
    adjust(cfg)
    assert cfg.model.position_embedding_type == "rope"
    assert cfg.model.cp_comm_type == "all_gather"  # Megatron's spelling (it was refused)
    for flag, value in (("--optimizer", "sgd"), ("--dataloader-type", "cyclic"), ("--ckpt-format", "torch")):
        assert main(base + [flag, value]) == 2
        assert f"{flag}: invalid choice: '{value}'" in capsys.readouterr().err


def test_accumulation_disagrees_with_global_batch(capsys):
    argv = ["pretrain", "--mock-data", "--vocab-size", "1000", "--dry-run", "--world-size", "2",
            "--micro-batch-size", "2", "--gradient-accumulation-steps", "3", "--global-batch-size", "16"]
    assert main(argv) == 2
    assert "= 12, not --global-batch-size 16" in capsys.readouterr().err


def test_typo_is_not_a_megatron_flag(capsys):
    assert main(["pretrain", "--hiden-size", "3", "--dry-run"]) == 2
    assert "unknown flag(s): --hiden-size" in capsys.readouterr().err


def test_plan_names_its_own_help_and_its_way_to_size_the_job(capsys):
    """`meshlm plan --nnodes 2` (pretrain --dry-run's flag) and a plan typo were both called misspelt
    with a pointer to `meshlm pretrain --help`, whose flags they were or where --num-gpus is not."""
    assert main(["plan", "--model", "tiny", "--nnodes", "2", "--num-gpuss", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--nnodes: `meshlm pretrain --dry-run`'s, not plan's; plan sizes the job with --num-gpus N" in err
    assert "unknown flag(s): --num-gpuss; check the spelling in `meshlm plan --help`" in err
    assert len(err.splitlines()) == 1


def test_sets_are_megatron_flags():
    assert set(NO_EFFECT) <= MEGATRON_FLAGS and len(MEGATRON_FLAGS) > 800


def test_checkpoint_and_exit_switches_and_rotary_percent_have_the_same_meaning(capsys):
    """Megatron flags that are config flags now (same name, meaning and default): parsed into the
    config, accepted by a dry run, not refused."""
    from meshlm.config import config_fields, flag_of
    from meshlm.megatron_flags import DIFFERENT_DEFAULTS
    flags = ("--finetune", "--no-load-optim", "--no-load-rng", "--exit-duration-in-mins", "--exit-interval",
             "--exit-signal-handler", "--exit-signal", "--rotary-percent")
    config_flags = {flag_of(f) for _, f in config_fields()}
    for flag in flags:
        assert flag in MEGATRON_FLAGS and flag in config_flags and flag not in DIFFERENT_DEFAULTS
    argv = ["pretrain", "--mock-data", "--vocab-size", "1000", "--dry-run", "--world-size", "1",
            "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--exit-duration-in-mins", "230",
            "--exit-interval", "1000", "--exit-signal-handler", "--exit-signal", "SIGUSR1", "--finetune",
            "--no-load-optim", "--no-load-rng"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "--finetune --no-load-optim --no-load-rng ignored without --load" in capsys.readouterr().out


def test_data_flags_have_megatron_meaning_and_default():
    from meshlm.config import Config, config_fields, flag_of
    from meshlm.megatron_flags import DIFFERENT_DEFAULTS, help_epilog
    flags = {flag_of(f) for _, f in config_fields()}
    same = help_epilog(flags).split("Same meaning and default: ")[1].split(". ")[0].split()
    for flag in ("--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
                 "--per-split-data-args-path", "--split", "--num-workers"):
        assert flag in same and flag not in DIFFERENT_DEFAULTS, flag
    d = Config().data
    assert d.num_workers == 2 and d.split is None  # Megatron's defaults (--split: 969,30,1 with --data-path)


# ----------------------------------------------------------------------------- examples/*.sh

def _example_args(tmp_path, valid: bool) -> list:
    """The script's five arguments, with a real tokenizer.json and one-document .bin/.idx files."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    Tokenizer(WordLevel({"<unk>": 0, "a": 1, "<|endoftext|>": 2}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    for name in ("train_text_document", "valid_text_document"):
        _dataset(tmp_path / name)
    args = [tmp_path / "ckpt", tmp_path / "tb", tmp_path / "tokenizer.json", tmp_path / "train_text_document"]
    return [str(a) for a in args + ([tmp_path / "valid_text_document"] if valid else [])]


def _launch_line(tmp_path, args: list) -> list:
    """The arguments the example script gives torchrun (a stand-in on PATH records them)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "torchrun.args"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$RECORD\"\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RECORD=str(record))
    subprocess.run(["bash", str(EXAMPLE), *args], env=env, check=True)
    return record.read_text().split("\0")[:-1]


@pytest.mark.parametrize("valid", [True, False], ids=["per-split-data", "data-path-and-split"])
def test_example_launch_script_passes_dry_run(tmp_path, capsys, valid):
    argv = _launch_line(tmp_path, _example_args(tmp_path, valid))
    i = argv.index("-m")
    assert argv[:i] == ["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                        "localhost", "--master-port", "29500"]
    assert argv[i + 1:i + 3] == ["meshlm", "pretrain"]
    flags = argv[i + 3:]
    assert ("--train-data-path" in flags and "--split" not in flags) == valid
    assert set(f for f in flags if f.startswith("--")) <= MEGATRON_FLAGS
    assert main(["pretrain", *flags, "--dry-run", "--world-size", "16"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TP 4 × CP 1 × PP 2 × DP 2" in out and "global 128 = micro 1 × 64 micro-batches × DP 2" in out
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_example_launch_script_dry_runs_itself(tmp_path):
    """DRY_RUN=1: the script runs `meshlm pretrain … --dry-run --world-size 16` itself."""
    src = str(EXAMPLE.parent.parent / "src")
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(["bash", str(EXAMPLE), *_example_args(tmp_path, True)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "all checks passed" in done.stdout and "DP 2" in done.stdout


# Megatron's examples/mixtral/train_mixtral_8x7b_distributed.sh, its data flags replaced by mock data
MIXTRAL = ["pretrain", "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
           "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size", "4096",
           "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--init-method-std", "0.01",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
           "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion",
           "--no-position-embedding", "--rotary-base", "1000000", "--num-experts", "8", "--moe-router-topk", "2",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
           "--mock-data", "--vocab-size", "32000", "--split", "99990,8,2", "--micro-batch-size", "1",
           "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000", "--lr-decay-iters", "320000",
           "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
           "--clip-grad", "1.0", "--bf16", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
           "4", "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
           "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
           "--no-load-optim", "--no-load-rng", "--dry-run", "--world-size", "64"]


def _mixtral(tmp_path):
    return MIXTRAL + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]


def test_mixtral_example_dry_runs_unchanged_with_sp_turned_off_at_tp_1(tmp_path, capsys):
    assert main(_mixtral(tmp_path)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: --sequence-parallel is turned off at --tensor-model-parallel-size 1" in out
    assert "TP 1 × CP 1 × PP 4 × DP 16" in out


@pytest.mark.parametrize("argv,expected", [
    (["--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type sinkhorn: not supported by meshlm, which has aux_loss"),
    (["--position-embedding-type", "learned_absolute"],
     "--no-position-embedding is deprecated (as in Megatron) and allowed only with --position-embedding-type rope"),
    (["--moe-router-dtype", "fp64"], "argument --moe-router-dtype: invalid choice: 'fp64' (choose from 'fp32')"),
])
def test_mixtral_flags_refuse_what_meshlm_cannot_do_in_one_line(tmp_path, capsys, argv, expected):
    assert main(_mixtral(tmp_path) + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_mixtral_example_with_the_router_in_fp32_dry_runs(tmp_path, capsys):
    """DeepSeek-style Megatron scripts pass --moe-router-dtype fp32, which meshlm always does: it was
    refused as an unsupported Megatron flag."""
    assert main(_mixtral(tmp_path) + ["--moe-router-dtype", "fp32"]) == 0, capsys.readouterr().err


def test_load_balancing_none_applies_no_aux_loss():
    from meshlm.config import ModelConfig
    from meshlm.model.moe import aux_coeff
    m = ModelConfig(num_experts=4, moe_aux_loss_coeff=1e-2)
    assert aux_coeff(m) == 1e-2
    m.moe_router_load_balancing_type = "none"
    assert aux_coeff(m) == 0.0


def test_bias_gelu_fusion_gives_megatrons_tanh_gelu_by_default():
    """Megatron-LM's default --bias-gelu-fusion computes GeLU's tanh approximation for a GeLU MLP
    with biases; --no-bias-gelu-fusion, a model without biases, and a checkpoint config saved
    before the flag existed compute the exact GeLU (against megatron-core itself:
    tests/test_megatron.py)."""
    import torch
    import torch.nn.functional as F

    from meshlm import config as C
    from meshlm.model.mlp import MLP
    from meshlm.parallel.mesh import ParallelState
    from meshlm.parallel.tensor import ShardedInit
    init = lambda name: ShardedInit((1, name), 1.0)  # noqa: E731
    x = torch.randn(5, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cases = [({}, "tanh"), ({"bias_gelu_fusion": False}, "none"), ({"add_bias_linear": False}, "none"),
             ({"openai_gelu": True, "bias_gelu_fusion": False}, "tanh")]
    for fields, want in cases:
        m = C.ModelConfig(hidden_size=8, num_attention_heads=2, **fields)
        mlp = MLP(m, ParallelState.single(), init, init, sequence_parallel=False, params_dtype=torch.float64)
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        h = x @ fc1.weight.t() + (fc1.bias if fc1.bias is not None else 0)
        forms = {f: F.gelu(h, approximate=f) @ fc2.weight.t() + (fc2.bias if fc2.bias is not None else 0)
                 for f in ("tanh", "none")}
        assert (forms["tanh"] - forms["none"]).abs().max() > 1e-3
        assert (mlp(x) - forms[want]).abs().max() < 1e-12 and C.gelu_tanh(m) == (want == "tanh"), fields
    old = C.Config.from_dict({"model": {"hidden_size": 8}})  # a config.json from before the flag
    assert not C.gelu_tanh(old.model) and C.gelu_tanh(C.Config.from_dict({}).model)


@pytest.mark.parametrize("hidden", [32, 1000, 2048, 4096, 5120])
def test_swiglu_without_ffn_hidden_size_is_megatrons_width(hidden):
    """Megatron-LM (arguments.py) derives a SwiGLU MLP's width as int((4 · h · 2 / 3) / 64) · 64, rounding
    down: 10,880 at h = 4,096. meshlm rounded up (10,944), so a Megatron script with --swiglu and no
    --ffn-hidden-size built another model, whose Megatron checkpoint would not load."""
    import argparse

    from meshlm.config import add_config_args, config_from_args, ffn_hidden
    p = argparse.ArgumentParser()
    add_config_args(p)
    m = config_from_args(p.parse_args(["--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "8"])).model
    assert ffn_hidden(m) == int((4 * hidden * 2 / 3) / 64) * 64 and ffn_hidden(m) % 64 == 0
    assert ffn_hidden(m) <= 8 * hidden / 3 < ffn_hidden(m) + 64
