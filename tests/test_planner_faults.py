"""`meshlm plan` as a new user tried it (issue 29): nonsense sizes refused as pretrain refuses them,
a non-zero exit with advice when nothing fits, and GPU names matched by their words."""

import json
import signal

import pytest
import torch

from meshlm.cli import main
from meshlm.flops import peak_tflops
from meshlm.planner.command import NO_FIT
from meshlm.planner.gpus import PRESETS, gpu_of_device, resolve_gpu

SHAPE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "512", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2"]


def _err_of(capsys, argv) -> tuple:
    code = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.err.strip()


@pytest.mark.parametrize("bad", [["--seq-length", "0"], ["--hidden-size", "0"], ["--micro-batch-size", "0"],
                                 ["--num-layers", "0"], ["--vocab-size", "-5"], ["--seq-length", "-1"],
                                 ["--num-attention-heads", "3"], ["--train-iters", "0"], ["--train-iters", "-5"],
                                 ["--global-batch-size", "0"], ["--train-samples", "16"]])
def test_plan_refuses_a_nonsense_size_with_pretrains_own_words(capsys, bad):
    plan = _err_of(capsys, ["plan", *SHAPE, *bad, "--num-gpus", "1"])
    dry = _err_of(capsys, ["pretrain", "--mock-data", *SHAPE, *bad, "--dry-run", "--world-size", "1"])
    assert plan[0] == dry[0] == 2
    assert plan[1] == dry[1] and bad[0] in plan[1] and len(plan[1].splitlines()) == 1


def test_plan_refuses_more_gpus_than_it_plans_in_one_line(capsys):
    """--num-gpus 2**40 planned for 70 s (its divisors, then every layout of them)."""
    from meshlm.planner.command import MAX_GPUS
    code, err = _err_of(capsys, ["plan", *SHAPE, "--num-gpus", str(2 ** 40)])
    assert code == 2 and f"--num-gpus {2 ** 40}: give the job's GPU count (1 to {MAX_GPUS:,})" in err
    assert len(err.splitlines()) == 1


def test_plan_refuses_more_layers_than_it_can_search_in_one_line(capsys):
    """--num-layers 10**8 searched for days: every layout's memory walks every layer."""
    from meshlm.planner.command import MAX_LAYERS

    def hung(*_):
        raise TimeoutError("still planning 10**8 layers after 20 s")
    signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        code, err = _err_of(capsys, ["plan", *SHAPE, "--num-layers", str(10**8), "--num-gpus", "8"])
    finally:
        signal.alarm(0)
    assert code == 2 and "--num-layers 100,000,000" in err and f"{MAX_LAYERS:,} or fewer" in err
    assert len(err.splitlines()) == 1


def test_plan_exits_non_zero_when_no_layout_fits_and_says_what_would(capsys):
    argv = ["plan", "--model", "gpt2-1.3b", "--vocab-size", "50257", "--global-batch-size", "8", "--bf16",
            "--num-gpus", "1", "--gpu-memory-gib", "8"]
    assert main(argv) == NO_FIT
    err = capsys.readouterr().err
    assert "no layout fits 1 × H100-80GB" in err and "a GPU with at least" in err
    assert main([*argv, "--json"]) == NO_FIT
    advice = json.loads(capsys.readouterr().out)["no_fit"]
    assert any(line.startswith("--num-gpus ") and " fits: " in line for line in advice)
    assert main([*argv[:-2], "--json"]) == 0  # 80 GiB: it fits, exit 0


def test_gpu_names_match_by_word_not_by_substring():
    bf16 = torch.bfloat16
    assert peak_tflops("NVIDIA L40", bf16) == 181.0 and peak_tflops("NVIDIA L4", bf16) == 121.0
    assert peak_tflops("NVIDIA L40S", bf16) == 362.0
    assert peak_tflops("NVIDIA H800 PCIe", bf16) == 756.0 and peak_tflops("NVIDIA H800", bf16) == 989.4
    assert peak_tflops("NVIDIA A10", bf16) == 125.0 and peak_tflops("NVIDIA A100-SXM4-80GB", bf16) == 312.0
    gpu, note = gpu_of_device("NVIDIA H100 PCIe")
    assert gpu.peak_flops == 756e12 and "756" in note
    assert gpu_of_device("NVIDIA H100 80GB HBM3")[0] == PRESETS["H100-80GB"]


def test_gpu_preset_names_are_case_insensitive():
    assert resolve_gpu("h100-80gb") == PRESETS["H100-80GB"] and resolve_gpu("a100-80GB") == PRESETS["A100-80GB"]


@pytest.mark.parametrize("command", ["plan", "analyze"])
def test_a_gpu_name_and_a_gpu_profile_together_are_refused(tmp_path, capsys, command):
    """`plan --gpu A100-80GB --gpu-profile h200.json` planned for the profile's GPU, silently."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(PRESETS["H200-141GB"].to_json()))
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("parallel: {}\n")
    (run / "logs" / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "iter_ms": 5.0}) + "\n")
    first = ["plan", "--model", "tiny", "--num-gpus", "1"] if command == "plan" else ["analyze", str(run)]
    assert main(first + ["--gpu", "A100-80GB", "--gpu-profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--gpu A100-80GB and --gpu-profile {path} name two GPUs; give one of them" in err
    assert len(err.splitlines()) == 1
    if command == "analyze":  # a GPU to predict for, with the predictions left out: it was ignored
        assert main(first + ["--gpu", "A100-80GB", "--no-predict"]) == 2
        assert "--gpu A100-80GB names the GPU to predict for, and --no-predict" in capsys.readouterr().err


def test_plan_warns_of_a_layout_above_the_safety_margin_and_names_the_fastest_safe_one(capsys):
    from meshlm.planner.safety import SAFE_FRACTION
    argv = ["plan", "--model", "gpt2-1.3b", "--vocab-size", "50257", "--global-batch-size", "8", "--bf16",
            "--num-gpus", "1", "--micro-batch-size", "8", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    need = doc["current"]["memory"]["device_bytes"]
    hbm = need / (SAFE_FRACTION + 1) * 2  # a GPU on which this layout is just past the margin
    assert main([*argv, "--gpu-memory-gib", str(hbm / 2 ** 30)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["safety"]["current_safe"] is False and doc["safety"]["fraction"] == SAFE_FRACTION
    i = doc["safety"]["fastest_safe"]
    assert i is not None and doc["layouts"][i]["memory"]["device_bytes"] <= SAFE_FRACTION * hbm
    assert all(x["memory"]["device_bytes"] > SAFE_FRACTION * hbm for x in doc["layouts"][:i])
    assert main(argv[:-1] + ["--gpu-memory-gib", str(hbm / 2 ** 30)]) == 0
    assert "above the safety margin" in capsys.readouterr().out
