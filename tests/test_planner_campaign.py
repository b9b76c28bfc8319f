"""planner/campaign.py: run length, failures, the Young/Daly checkpoint interval, goodput; `plan --train-tokens`."""

import json
import math

import pytest

from meshlm.cli import main
from meshlm.batches import BatchSchedule
from meshlm.planner.campaign import MTBF_GPU_HOURS, campaign, daly_interval, run_length


def _daly_exact_wall(tau, delta, mtbf, restart=0.0, solve=1.0):
    """Daly 2006's exact expected wall time (exponential failures) of ``solve`` seconds of work."""
    return mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1) * solve / tau


@pytest.mark.parametrize("ratio", [1e-4, 1e-2, 0.1])
def test_daly_interval_minimises_dalys_exact_model_and_tends_to_young(ratio):
    mtbf = 36_000.0
    delta = ratio * mtbf
    grid = [t for t in (delta * 10 ** (k / 2000) for k in range(-4000, 8000)) if t < 20 * mtbf]
    best = min(grid, key=lambda t: _daly_exact_wall(t, delta, mtbf))
    tau = daly_interval(delta, mtbf)
    assert _daly_exact_wall(tau, delta, mtbf) <= _daly_exact_wall(best, delta, mtbf) * (1 + 1e-4)
    assert tau == pytest.approx(best, rel=0.02)
    if ratio <= 1e-4:
        assert tau == pytest.approx(math.sqrt(2 * delta * mtbf), rel=0.01)  # Young 1974
    assert daly_interval(3 * mtbf, mtbf) == mtbf


def test_run_length_from_iters_samples_or_tokens_as_pretrain_takes_them():
    """--train-samples 801 at batch 8 was 101 steps (pretrain drops the partial batch: 100), and a
    --rampup-batch-size ramp's smaller steps were not counted (100,000 samples: 196 steps, not 444)."""
    g8 = BatchSchedule(8, 1)
    assert run_length(100, None, None, g8, 2048) == (100, 800)
    assert run_length(None, 801, None, g8, 2048) == (100, 800)
    assert run_length(None, None, 300e9, BatchSchedule(1536, 1), 2048)[0] == math.ceil(300e9 / (1536 * 2048))
    assert run_length(None, None, None, g8, 2048) is None
    ramp = BatchSchedule(512, 1, (32, 32, 50_000))
    steps, samples = run_length(None, 100_000, None, ramp, 2048)
    assert steps == ramp.iterations(100_000) == 444 and samples <= 100_000
    steps, samples = run_length(None, None, 100_000 * 2048, ramp, 2048)  # the fewest steps reaching the tokens
    assert samples >= 100_000 and run_length(steps - 1, None, None, ramp, 2048)[1] < 100_000
    c = campaign(steps=steps, step_s=1.0, global_batch=512, seq_length=2048, num_gpus=8, params=10 ** 9,
                 samples=samples)
    assert c.tokens == samples * 2048 and c.train_s == pytest.approx(samples / 512)


def test_campaign_failures_gpu_hours_and_goodput_follow_from_the_terms():
    c = campaign(steps=10_000, step_s=10.0, global_batch=1024, seq_length=2048, num_gpus=1024, params=10 ** 11)
    assert c.train_s == 1e5 and c.gpu_hours == pytest.approx(1e5 * 1024 / 3600)
    assert c.job_mtbf_s == pytest.approx(MTBF_GPU_HOURS * 3600 / 1024)
    assert MTBF_GPU_HOURS == pytest.approx(16384 * 54 * 24 / 419)  # Llama 3 §3.3.4
    sync, asy = c.saves["sync"], c.saves["async"]
    assert sync["blocking_s"] == pytest.approx(14e11 / 273e9) and asy["durable_s"] == sync["blocking_s"]
    assert asy["interval_s"] >= asy["durable_s"] and asy["blocking_s"] < sync["blocking_s"]
    for s in (sync, asy):
        assert s["expected_failures"] == pytest.approx(s["wall_s"] / c.job_mtbf_s)
        assert 0 < s["goodput"] < 1 and s["goodput"] == pytest.approx(c.train_s / s["wall_s"])
        assert s["interval_steps"] * 10.0 == pytest.approx(s["interval_s"])
    assert asy["goodput"] > sync["goodput"]
    flaky = campaign(steps=10_000, step_s=10.0, global_batch=1024, seq_length=2048, num_gpus=1024, params=10 ** 11,
                     gpu_mtbf_hours=MTBF_GPU_HOURS / 10)
    assert flaky.saves["sync"]["goodput"] < sync["goodput"]
    assert flaky.saves["sync"]["interval_s"] < sync["interval_s"]  # more failures: save more often


GPT = ["plan", "--model", "gpt2-1.3b", "--vocab-size", "50257", "--global-batch-size", "64", "--bf16",
       "--num-gpus", "8", "--top", "1"]


def test_the_checkpoint_interval_never_passes_the_run_s_end():
    """A 5-step run was told --save-interval 8794237 (Daly's interval, far past its end)."""
    short = campaign(steps=5, step_s=1.0, global_batch=8, seq_length=1024, num_gpus=8, params=10 ** 9)
    for mode in ("sync", "async"):
        assert short.saves[mode]["interval_steps"] == 5 and short.saves[mode]["flags"].startswith("--save-interval 5")


def test_plan_gives_the_campaign_in_json_and_text(capsys):
    assert main([*GPT, "--train-tokens", "26e9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    c = doc["campaign"]
    assert c["steps"] == math.ceil(26e9 / (64 * doc["model"]["seq_length"])) and c["step_s"] == doc["layouts"][0]["time"]["total"]
    assert set(c["saves"]) == {"sync", "async"} and c["chosen"] == "sync"
    assert doc["current"]["campaign"]["steps"] == c["steps"]
    assert main([*GPT, "--train-iters", "1000", "--async-save", "--save", "/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "campaign (best layout): 1,000 steps" in out and "async (your flags)" in out


@pytest.mark.parametrize("flags, named", [(["--train-tokens", "1e9", "--train-iters", "5"], "give one run length"),
                                          (["--train-samples", "63"], "--train-samples 63 is less than one global "
                                                                      "batch (64)"),  # pretrain takes no step
                                          (["--train-iters", "9", "--rampup-batch-size", "32", "32", "640"],
                                           "--rampup-batch-size needs --train-samples or --train-tokens"),
                                          (["--gpu-mtbf-hours", "0"], "--gpu-mtbf-hours 0"),
                                          (["--train-tokens", "0"], "--train-tokens 0"),
                                          # a ramp of no schedule: a ZeroDivisionError traceback walking it
                                          (["--train-samples", "1000", "--rampup-batch-size", "32", "32", "0"],
                                           "--rampup-batch-size 32 32 0: give three positive integers"),
                                          (["--train-samples", "1000", "--rampup-batch-size", "64", "32", "640"],
                                           "START 64 must be below the global batch 64")])
def test_plan_refuses_bad_campaign_flags(capsys, flags, named):
    assert main([*GPT, *flags]) == 2
    assert named in capsys.readouterr().err


def test_plan_json_stays_valid_json_when_the_campaign_never_ends(capsys):
    """A restart longer than the job's MTBF makes the expected wall time infinite: --json printed the
    bare token Infinity, which jq, JavaScript and strict JSON readers refuse."""
    assert main([*GPT, "--train-iters", "1000", "--restart-minutes", "1e9", "--json"]) == 0

    def refuse(token):
        raise ValueError(f"bare {token} in --json")
    doc = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert doc["campaign"]["saves"]["sync"]["wall_s"] == "Infinity" and doc["campaign"]["saves"]["sync"]["goodput"] == 0


def test_train_tokens_replaces_a_config_files_run_length(tmp_path, capsys):
    """`plan --config llama3-70b.yaml --train-tokens 15e12` planned the YAML's 10,000 iterations (2.1e10
    tokens): the flag replaces the file's length, as pretrain's flags replace a YAML's exclusive ways."""
    yaml = tmp_path / "run.yaml"
    yaml.write_text("training:\n  train_iters: 10\n")
    assert main([*GPT, "--config", str(yaml), "--train-tokens", "26e9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["campaign"]["steps"] == math.ceil(26e9 / (64 * doc["model"]["seq_length"]))


def test_the_flags_save_interval_is_evaluated_beside_dalys():
    """`plan --save-interval 5` marked Daly's --save-interval 240 line "(your flags)": the interval
    the flags save at was never evaluated."""
    c = campaign(steps=10_000, step_s=10.0, global_batch=1024, seq_length=2048, num_gpus=1024, params=10 ** 11,
                 save_interval=5)
    yours, sync = c.saves["yours"], c.saves["sync"]
    assert yours["interval_steps"] == 5 and yours["flags"] == "--save-interval 5"
    assert yours["goodput"] < sync["goodput"] and yours["blocking_s"] == sync["blocking_s"]
    fast = campaign(steps=10_000, step_s=0.1, global_batch=1024, seq_length=2048, num_gpus=1024, params=10 ** 11,
                    save_interval=1, async_save=True)  # a save each 0.1 s waits for the last one's write
    assert fast.saves["yours"]["blocking_s"] == pytest.approx(fast.saves["async"]["durable_s"] - 0.1 +
                                                              fast.saves["async"]["blocking_s"])
    assert "yours" not in campaign(steps=10, step_s=1.0, global_batch=8, seq_length=64, num_gpus=8,
                                   params=10 ** 6).saves


def test_plan_prints_the_flags_save_interval(capsys):
    assert main([*GPT, "--train-iters", "1000", "--save-interval", "5"]) == 0
    out = capsys.readouterr().out
    assert "  your --save-interval 5: " in out and "(your flags)" not in out
