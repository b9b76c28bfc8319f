"""`meshlm plan`'s LR and global batch from DeepSeek LLM's scaling law (planner/hyperparams.py)."""

import json

import pytest

from meshlm.cli import main
from meshlm.config import Config
from meshlm.planner.hyperparams import flops_per_token, recommend


def _cfg(tokens_of_samples: int, **model) -> Config:
    cfg = Config()
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.training.train_iters, cfg.training.global_batch_size = 1, tokens_of_samples
    return cfg


def test_flops_per_token_is_deepseeks_m_for_their_shape():
    m = _cfg(1, num_layers=30, hidden_size=4096, num_attention_heads=32, seq_length=4096,
             add_bias_linear=False).model
    assert flops_per_token(m) == 72 * 30 * 4096 ** 2 + 6 * 30 * 4096 * 4096  # §3.2, Eq. (2)


def test_recommendation_at_one_exaflop_and_outside_the_fitted_range():
    cfg = _cfg(1, num_layers=1, hidden_size=64, num_attention_heads=1, seq_length=64)
    m = flops_per_token(cfg.model)
    cfg.training.train_iters = round(1e18 / (m * 64))  # C ≈ 1e18 FLOPs, global batch 1
    rec = recommend(cfg, 1)
    assert rec.compute == pytest.approx(1e18, rel=1e-3) and rec.inside
    assert rec.lr == pytest.approx(1.7533e-3, rel=1e-3)           # 0.3118 · 1e18^-0.125
    assert rec.batch_tokens == pytest.approx(225_519, rel=1e-3)   # 0.2920 · 1e18^0.3271
    assert rec.global_batch == round(rec.batch_tokens / 64)
    tiny = recommend(_cfg(1, num_layers=1, hidden_size=64, num_attention_heads=1, seq_length=64), 1)
    assert not tiny.inside and "OUTSIDE (an extrapolation)" in tiny.line() and "2401.02954" in tiny.line()


def test_plan_prints_and_writes_the_recommendation(capsys):
    flags = ["plan", "--model", "gpt2-125m", "--vocab-size", "50257", "--mock-data", "--micro-batch-size", "4",
             "--global-batch-size", "64", "--train-iters", "10000", "--num-gpus", "8", "--top", "1"]
    assert main(flags + ["--json"]) == 0
    hp = json.loads(capsys.readouterr().out)["hyperparameters"]
    assert hp["inside_fitted_range"] and 0 < hp["lr"] < 1e-2 and hp["fitted_range_flops"] == [1e17, 2e19]
    assert main(flags) == 0
    assert "hyperparameters: --lr " in capsys.readouterr().out


def test_recommended_global_batch_is_a_multiple_of_micro_batch_times_dp():
    cfg = _cfg(1, num_layers=1, hidden_size=64, num_attention_heads=1, seq_length=64)
    cfg.training.micro_batch_size = 4
    small = recommend(cfg, 8)  # B_opt of a tiny budget is a few sequences: below micro × DP = 32
    assert round(small.batch_tokens / 64) < 32 and small.global_batch == 32 and small.step == 32
    assert "multiple of micro-batch × DP = 32" in small.line()
    cfg.training.train_iters = round(1e18 / (flops_per_token(cfg.model) * 64))
    big = recommend(cfg, 8)  # ≈ 3,524 sequences: the nearest multiple of 32
    assert big.global_batch % 32 == 0 and abs(big.global_batch - big.batch_tokens / 64) <= 16
    assert big.to_json()["global_batch_multiple_of"] == 32


def test_plans_train_tokens_is_the_budget_of_the_recommendation(capsys):
    """--train-tokens set the campaign's length but not C: 1e9 and 1e11 tokens got the same LR and batch."""
    flags = ["plan", "--model", "gpt2-125m", "--vocab-size", "50257", "--num-gpus", "8", "--top", "1", "--json"]
    budgets = {}
    for tokens in ("1e9", "1e11"):
        assert main(flags + ["--train-tokens", tokens]) == 0
        budgets[tokens] = json.loads(capsys.readouterr().out)["hyperparameters"]["compute_flops"]
    assert budgets["1e11"] == pytest.approx(100 * budgets["1e9"])


def test_no_run_length_gets_a_note_not_a_recommendation_for_the_default_100_iterations(capsys):
    """Without --train-iters/--train-samples/--train-tokens the LR and batch were DeepSeek's for
    meshlm's default 100 iterations (llama3-8b: --lr 0.0017 for 26M tokens), unmarked."""
    flags = ["plan", "--model", "gpt2-125m", "--vocab-size", "50257", "--num-gpus", "8", "--top", "1"]
    assert main(flags + ["--json"]) == 0
    assert "give --train-iters, --train-samples or --train-tokens" in json.loads(
        capsys.readouterr().out)["hyperparameters"]["note"]
    assert main(flags) == 0
    assert "hyperparameters: give --train-iters" in capsys.readouterr().out
