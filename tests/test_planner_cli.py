"""meshlm plan (--json, --calibrate), the launch lint in --dry-run, and the out-of-memory message."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from meshlm.cli import main
from meshlm.config import add_config_args, config_from_args
from meshlm.planner.gpus import PRESETS, load_profile
from meshlm.planner.oom import explain_oom

GPT = ["--model", "gpt2-1.3b", "--vocab-size", "50257", "--mock-data", "--micro-batch-size", "4",
       "--global-batch-size", "64", "--bf16"]


def test_plan_json_document(capsys):
    assert main(["plan", *GPT, "--num-gpus", "8", "--gpu", "H100-80GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["num_gpus"] == 8 and doc["layouts"]
    best = doc["layouts"][0]
    assert best["memory"]["device_bytes"] <= PRESETS["H100-80GB"].memory_bytes
    assert "--micro-batch-size" in best["flags"] and best["time"]["total"] > 0
    assert doc["current"]["memory"]["weights"] > 0  # the flags' own layout (DP 8)


def test_a_bare_plan_plans_what_a_bare_pretrain_trains(capsys):
    """`meshlm plan` with no pretrain flag planned Config's defaults (h 256, seq 256, vocabulary 32000
    assumed, global batch 4), not the embedded default `meshlm pretrain` with no flags trains."""
    from meshlm.cli import EMBEDDED_DEFAULT
    from meshlm.data.corpus import DEFAULT_VOCAB
    assert main(["plan", "--json", "--top", "1"]) == 0
    out, err = capsys.readouterr()
    model = json.loads(out)["model"]
    e = EMBEDDED_DEFAULT
    assert (model["num_layers"], model["hidden_size"], model["seq_length"], model["vocab_size"],
            model["global_batch_size"]) == (e["num_layers"], e["hidden_size"], e["seq_length"], DEFAULT_VOCAB,
                                            e["global_batch_size"])
    assert err.startswith("meshlm plan: note: no pretrain flags: planning what `meshlm pretrain` with no flags "
                          "trains") and len(err.splitlines()) == 1
    assert main(["plan", "--json", "--top", "1", "--train-tokens", "1e9"]) == 0  # plan's length, not the default's
    assert json.loads(capsys.readouterr().out)["campaign"]["tokens"] == pytest.approx(1e9, rel=1e-5)
    assert main(["plan", "--num-layers", "2", "--json", "--top", "1"]) == 0  # a flag: the flags alone, no note
    out, err = capsys.readouterr()
    assert json.loads(out)["model"]["hidden_size"] != e["hidden_size"] and "embedded default" not in err


def test_quick_without_calibrate_is_named_as_ignored(capsys):
    """It was silently ignored (the plan measures nothing)."""
    assert main(["plan", *GPT, "--num-gpus", "8", "--top", "1", "--quick"]) == 0
    assert "meshlm plan: note: --quick ignored without --calibrate" in capsys.readouterr().err


def test_plan_tables_and_lint_warnings(capsys):
    assert main(["plan", *GPT, "--num-gpus", "8", "--pipeline-model-parallel-size", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "warning: PP 8 = one node's GPUs, but the model fits at PP 1 with DP 8" in out
    assert "feasible layouts" in out and "excluded" in out


def test_dry_run_prints_lint_warnings(capsys):
    assert main(["pretrain", "--model", "tiny", "--mock-data", "--vocab-size", "256", "--tensor-model-parallel-size",
                 "2", "--dry-run", "--world-size", "2"]) == 0
    assert "warning: TP 2 without --sequence-parallel" in capsys.readouterr().out


def test_dry_run_memory_is_the_planners_estimate_of_the_same_layout(capsys):
    layout = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--recompute-activations"]
    assert main(["pretrain", *GPT, *layout, "--dry-run", "--world-size", "8"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "memory" in x]
    assert main(["plan", *GPT, *layout, "--num-gpus", "8", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["current"]["memory"]
    GiB = 2 ** 30
    assert f"weights {mem['weights'] / GiB:.2f} GiB + grads {mem['grads'] / GiB:.2f} GiB + optimizer " \
           f"{mem['optimizer'] / GiB:.2f} GiB" in lines[0]
    assert f"activations {mem['activations'] / GiB:.2f} GiB" in lines[0] and "selective recompute" in lines[0]
    assert f"{mem['peak_bytes'] / GiB:.2f} GiB allocated, about {mem['device_bytes'] / GiB:.2f} GiB" in lines[1]
    assert "9 bytes/parameter" in lines[0]  # 2 + 4 + 12/DP under ZeRO-1 (DP 4)


def test_calibrate_on_cpu_writes_a_profile(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    assert main(["plan", "--model", "tiny", "--mock-data", "--vocab-size", "256", "--calibrate", "--quick",
                 "--gpu-profile", str(path)]) == 0
    gpu = load_profile(str(path))
    assert gpu.peak_flops > 0 and gpu.hbm_bytes_per_s > 0 and 0 < gpu.gemm_efficiency <= 1
    assert main(["plan", *GPT, "--num-gpus", "1", "--gpu-profile", str(path), "--json"]) == 0
    capsys.readouterr()
    # a CPU's GFLOP/s read "GEMM 0.00 TFLOP/s" and "0 TFLOP/s bf16"; the links it kept were not named
    assert "GEMM 0.00 TFLOP/s" not in gpu.source and "links not measured (one device: H200-141GB's)" in gpu.source
    assert main(["plan", *GPT, "--num-gpus", "1", "--gpu-profile", str(path)]) == 0
    assert f"{gpu.peak_flops / 1e12:.3g} TFLOP/s bf16" in capsys.readouterr().out



def test_calibrate_measures_the_grouped_gemm_of_an_moe_model(tmp_path):
    """--calibrate on an MoE model times torch._grouped_mm (CPU here, tiny shapes) and stores its
    efficiency, which a dense model's profile keeps from the preset."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    from meshlm.planner.calibrate import calibrate
    p = argparse.ArgumentParser()
    add_config_args(p)
    moe = calibrate(config_from_args(p.parse_args(["--model", "mixtral-tiny", "--vocab-size", "256"])), quick=True)
    assert 0 < moe.grouped_gemm_efficiency <= 1 and moe.grouped_wave_s >= 0
    assert "grouped GEMM" in moe.source and "ms at (experts, rows, h, f_e, gates)" in moe.source
    dense = calibrate(config_from_args(p.parse_args(["--model", "tiny", "--vocab-size", "256"])), quick=True)
    assert dense.grouped_gemm_efficiency == PRESETS["H200-141GB"].grouped_gemm_efficiency

def test_explain_oom_names_prediction_allocation_and_fixes():
    p = argparse.ArgumentParser()
    add_config_args(p)
    cfg = config_from_args(p.parse_args(["--model", "llama-3b", "--vocab-size", "128256", "--seq-length", "4096",
                                         "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16"]))
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = explain_oom(cfg, exc, world=1, vocab=128256, gpu=PRESETS["H100-80GB"], gpus_per_node=1)
    assert "CUDA out of memory" in msg
    assert "planner's prediction per GPU: weights" in msg and "activations" in msg
    assert "allocated when it failed" in msg
    assert "layouts that fit (planner): " in msg and ("--recompute" in msg or "--micro-batch-size 1" in msg)


def test_plan_a_cluster_script_whose_files_are_not_here(tmp_path, monkeypatch, capsys):
    """The shipped llama3-8b example (data and tokenizer paths of a cluster, --overlap-param-gather) is
    planned on a machine without those files: one note names the assumed vocabulary."""
    example = str(Path(__file__).resolve().parent.parent / "examples" / "llama3-8b.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", example, "--num-gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["layouts"] and "problems" not in doc["current"]
    note = [x for x in captured.err.splitlines() if "note:" in x]
    assert len(note) == 1 and "llama3/tokenizer.json not found" in note[0]
    assert f"vocabulary {doc['model']['vocab_size']} " in note[0]
    assert main(["plan", "--model", "llama3-8b", "--data-path", "/cluster/data/x_text_document", "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", "/cluster/tok.json", "--vocab-size", "128256",
                 "--micro-batch-size", "1", "--global-batch-size", "128", "--bf16", "--num-gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model"]["vocab_size"] == 128256
    assert "vocabulary 128256 (--vocab-size)" in captured.err


@pytest.mark.parametrize("gpus", [4, 16])
def test_plan_names_a_gpu_count_the_flags_tp_does_not_divide(capsys, gpus):
    """--num-gpus 16 with TP 3 was planned as DP 5 (15 GPUs: 'micro 2 × DP 5'), --num-gpus 4 as a TP
    group crossing a node; the problem is the count, named with plan's own flag."""
    argv = ["plan", "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "48",
            "--num-attention-heads", "3", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--tensor-model-parallel-size", "3", "--num-gpus", str(gpus),
            "--gpus-per-node", str(gpus), "--json"]
    main(argv)
    problems = json.loads(capsys.readouterr().out)["current"]["problems"]
    assert problems[0] == f"world size {gpus} is not divisible by TP×CP×PP = 3×1×1; set --num-gpus to a multiple of 3"
    assert not any("DP 5" in p or "crosses a node" in p for p in problems)


def test_dry_run_names_the_flag_that_sized_its_world(capsys):
    argv = ["pretrain", "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "48",
            "--num-attention-heads", "3", "--seq-length", "32", "--micro-batch-size", "1",
            "--tensor-model-parallel-size", "3", "--dry-run", "--world-size", "8"]
    assert main(argv) == 2
    assert "world size 8 is not divisible by TP×CP×PP = 3×1×1; set --world-size to a multiple of 3" in \
        capsys.readouterr().err


@pytest.mark.parametrize("field, value, words", [
    ("peak_flops", 0, "peak_flops is 0, not a finite number above 0"),  # ZeroDivisionError
    ("hbm_bytes_per_s", None, "hbm_bytes_per_s is None, not a finite number above 0"),  # TypeError
    ("peak_flops", "fast", "peak_flops is 'fast'"),  # TypeError
    ("memory_bytes", -1, "memory_bytes is -1"),  # planned as if nothing fits, no word why
    ("gemm_efficiency", 5, "gemm_efficiency is 5, not a finite number at most 1"),
    ("sm_count", 0.5, "sm_count is 0.5, not an integer above 0")])
def test_a_gpu_profile_value_of_the_wrong_kind_is_one_line(tmp_path, capsys, field, value, words):
    """A hand-edited (or damaged) profile: a zero peak was a ZeroDivisionError traceback, a string or
    null a TypeError, a negative number a plan of nonsense."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(dict(PRESETS["H100-80GB"].to_json(), **{field: value})))
    assert main(["plan", *GPT, "--num-gpus", "1", "--gpu-profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--gpu-profile {path}: {words}" in err and len(err.splitlines()) == 1


def test_nproc_per_node_is_one_node_of_that_many_gpus(capsys):
    """`plan --nproc-per-node 16` planned the 16 workers meshlm starts on one node as two nodes of
    --gpus-per-node's default 8 (TP 16 'crossing a node', DP over the inter-node link)."""
    assert main(["plan", *GPT, "--nproc-per-node", "16", "--json", "--top", "1"]) == 0
    cluster = json.loads(capsys.readouterr().out)["cluster"]
    assert (cluster["num_gpus"], cluster["gpus_per_node"]) == (16, 16)
    assert main(["plan", *GPT, "--nproc-per-node", "16", "--gpus-per-node", "8"]) == 2
    assert "--nproc-per-node 16 starts 16 workers on one node of --gpus-per-node 8" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_full_calibration_of_a_large_model_on_a_cpu_is_refused_before_it_runs(tmp_path, capsys):
    """`plan --model llama3-8b --calibrate` on a CPU timed 9e14 FLOPs of GEMMs (hours) printing nothing."""
    path = tmp_path / "cpu.json"
    assert main(["plan", "--model", "llama3-8b", "--calibrate", "--gpu-profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--calibrate on a CPU would time this model's full-size GEMMs, 9.3e+14 FLOPs" in err and "--quick" in err
    assert len(err.splitlines()) == 1 and not path.exists()


def test_fp8_planned_for_a_gpu_without_fp8_tensor_cores_is_a_warning(capsys):
    """`plan --fp8-format hybrid --gpu A100-80GB` ranked FP8 layouts with no word that the launch refuses
    --fp8-format on an A100 (compute capability 8.0)."""
    fp8 = ["plan", *GPT, "--bf16", "--fp8-format", "hybrid", "--num-gpus", "8", "--top", "1"]
    assert main(fp8 + ["--gpu", "A100-80GB"]) == 0
    assert "warning: --fp8-format on A100-80GB, which has no FP8 tensor cores" in capsys.readouterr().out
    assert main(fp8 + ["--gpu", "H100-80GB"]) == 0
    assert "no FP8 tensor cores" not in capsys.readouterr().out
