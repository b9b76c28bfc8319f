"""training.metrics and meshlm.flops: the FLOPs formula, the MFU peak table, the log line, TensorBoard (and its absence)."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshlm.config import Config, padded_vocab_size
from meshlm import flops
from meshlm.errors import ConfigError
from meshlm.model.transformer import GPTModel
from meshlm.parallel.mesh import ParallelState
from meshlm.training import metrics
from full_disk import FullDiskFile


def _model_cfg(**kw):
    m = Config().model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 32
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 16
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_flops_equal_narayanan_formula_for_gpt():
    """a = g, f = 4h: 72·B·s·L·h²·(1 + s/6h + V/12Lh) (Narayanan et al. 2021 §5.1, no recompute)."""
    m = _model_cfg(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    B, V, L, h, s = 512, 51200, 24, 2048, 2048
    paper = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops.flops_per_iteration(m, B, V) == pytest.approx(paper, rel=1e-12)


@pytest.mark.parametrize("kw", [{}, {"swiglu": True, "group_query_attention": True, "num_query_groups": 2}])
def test_flops_match_the_matmuls_torch_counts_in_forward_and_backward(kw):
    """GeLU/MHA and SwiGLU/GQA: torch's FLOP counter over one forward+backward of the real model,
    plus the attention core (SDPA, not counted by torch on CPU) 3·B·L·4·s²·a·d, equals the formula."""
    m = _model_cfg(**kw)
    B, vocab = 3, 100
    model = GPTModel(m, ParallelState.single(), vocab, seed=1)
    tokens = torch.randint(0, vocab, (B, m.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).sum().backward()
    d = m.hidden_size // m.num_attention_heads
    core = 3 * B * m.num_layers * 4 * m.seq_length ** 2 * m.num_attention_heads * d
    expected = counter.get_total_flops() + core
    assert flops.flops_per_iteration(m, B, padded_vocab_size(vocab, 16, 1)) == expected


def test_peak_table_knows_h100_h200_a100_and_refuses_to_guess():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert flops.peak_tflops("NVIDIA H200", torch.bfloat16) == 989.4
    assert flops.peak_tflops("NVIDIA H100 PCIe", torch.float16) == 756.0
    assert flops.peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert flops.peak_tflops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert flops.peak_tflops(None, torch.bfloat16) is None  # CPU
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", torch.float32) is None


def _logger(tmp_path, **kw):
    args = dict(enabled=True, log_dir=str(tmp_path), train_iters=100, log_interval=10, global_batch=32,
                seq_length=1024, flops_per_iter=4e12, world_size=4, dtype=torch.float32)
    args.update(kw)
    return metrics.MetricsLogger(**args)


def test_log_line_averages_the_interval_and_prints_na_for_unknown_mfu(tmp_path, capsys):
    log = _logger(tmp_path)
    for it in range(1, 11):
        rec = log.train_step(it, 32 * it, lm_loss=float(it), lr=3e-4, grad_norm=1.5, iter_s=0.5)
    line = capsys.readouterr().out
    assert line.startswith(" iteration       10/     100 | consumed samples:          320 |")
    assert "elapsed time per iteration (ms): 500.0" in line and "lm loss: 5.500000E+00" in line
    assert "MFU: n/a" in line and "learning rate: 3.000E-04" in line
    assert rec["tokens_per_sec"] == pytest.approx(32 * 1024 / 0.5)
    assert rec["tflops_per_gpu"] == pytest.approx(4e12 / 0.5 / 4 / 1e12)
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written["lm_loss"] == 5.5 and written["mfu"] is None


def test_mfu_is_throughput_over_the_known_peak(tmp_path, capsys):
    log = _logger(tmp_path, dtype=torch.bfloat16)
    log.peak = 989.4  # as on an H100/H200
    rec = None
    for it in range(1, 11):
        rec = log.train_step(it, 32 * it, lm_loss=1.0, lr=1e-4, grad_norm=None, iter_s=0.001)
    assert rec["mfu"] == pytest.approx(rec["tflops_per_gpu"] / 989.4)
    assert f"MFU: {100 * rec['mfu']:.1f}%" in capsys.readouterr().out


def test_only_the_logging_rank_writes(tmp_path, capsys):
    log = _logger(tmp_path, enabled=False, log_interval=1)
    log.train_step(1, 32, lm_loss=1.0, lr=1e-4, grad_norm=1.0, iter_s=0.1)
    assert capsys.readouterr().out == "" and not (tmp_path / "metrics.jsonl").exists()


def test_fp16_line_shows_loss_scale_and_skipped_iterations(tmp_path, capsys):
    log = _logger(tmp_path, log_interval=2, fp16=True, dtype=torch.float16)
    log.train_step(1, 32, lm_loss=2.0, lr=1e-4, grad_norm=None, iter_s=0.1, loss_scale=65536.0, skipped=True)
    rec = log.train_step(2, 64, lm_loss=3.0, lr=1e-4, grad_norm=1.0, iter_s=0.1, loss_scale=32768.0)
    out = capsys.readouterr().out
    assert "loss scale: 32768.0" in out and "number of skipped iterations:   1" in out
    assert rec["lm_loss"] == 3.0  # the skipped iteration's loss is not averaged in


def test_tensorboard_dir_without_tensorboard_is_noted_before_start_and_the_run_logs_without_it(tmp_path, monkeypatch):
    """Megatron's behaviour (a warning, training goes on): a launch script with --tensorboard-dir runs
    unchanged where tensorboard is not installed; the note comes from validate, before any worker."""
    import builtins
    import importlib.util

    from meshlm.validate import notes
    real_import, real_find = builtins.__import__, importlib.util.find_spec

    def no_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real_find(name, *a))
    cfg = Config()
    cfg.logging.tensorboard_dir = str(tmp_path / "tb")
    [line] = [n for n in notes(cfg) if "--tensorboard-dir" in n]
    assert "not installed" in line and "pip install tensorboard" in line
    log = _logger(tmp_path, log_interval=1, tensorboard_dir=str(tmp_path / "tb"))
    assert log.tb is None
    log.train_step(1, 32, lm_loss=4.0, lr=1e-4, grad_norm=1.0, iter_s=0.5)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["lm_loss"] == 4.0


class _Writer:
    """SummaryWriter's add_scalar/close, kept in a list (tensorboard is optional, not installed in CI)."""

    def __init__(self, log_dir):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        pass


def test_tensorboard_gets_the_moe_routing_communication_and_loss_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "tensorboard_writer", lambda: _Writer)
    log = _logger(tmp_path, log_interval=2, tensorboard_dir=str(tmp_path / "tb"))
    moe = {0: {"tokens": [30.0, 10.0], "routes": 40.0, "aux": 1.5, "z": None},
           1: {"tokens": [20.0, 20.0], "routes": 50.0, "aux": 0.5, "z": None}}
    log.train_step(1, 32, lm_loss=4.0, lr=1e-4, grad_norm=1.0, iter_s=0.5, comm_s=0.1)
    rec = log.train_step(2, 64, lm_loss=3.0, lr=1e-4, grad_norm=1.0, iter_s=0.5, comm_s=0.1, moe=moe)
    got = {tag: value for tag, value, step in log.tb.scalars if step == 2}
    assert got["lm loss"] == 3.5 and got["moe/load-balancing-loss"] == 1.0
    assert got["moe/imbalance-layer-0"] == 1.5 and got["moe/imbalance-layer-1"] == 1.0  # max / mean routes
    assert got["moe/imbalance"] == 1.25 and got["moe/dropped-fraction"] == pytest.approx(1 - 80 / 90)
    assert got["communication/dp-s"] == pytest.approx(0.1) == rec["comm_s"]["dp"]
    assert "moe/z-loss" not in got  # off: no pair


def _strict(line):
    """json.loads that refuses the bare NaN/Infinity tokens (as jq or JavaScript do)."""
    return json.loads(line, parse_constant=lambda token: pytest.fail(f"bare {token} in {line}"))


def test_non_finite_values_are_written_as_valid_json_and_read_back_in_both_forms(tmp_path, capsys):
    from meshlm import metrics_json
    log = _logger(tmp_path, log_interval=1)
    log.train_step(1, 32, lm_loss=2.0, lr=1e-4, grad_norm=float("inf"), iter_s=0.1, rank_iter_s=[0.1, float("nan")])
    log.evaluation(1, 32, float("nan"))
    log.train_step(2, 64, lm_loss=2.0, lr=1e-4, grad_norm=1.0, iter_s=0.1)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    train, val = _strict(lines[0]), _strict(lines[1])
    assert train["grad_norm"] == "Infinity" and train["rank_iter_s"] == [0.1, "NaN"]
    assert val["val_loss"] == val["val_ppl"] == "NaN"  # a NaN loss has no perplexity of e^20
    back = metrics_json.loads(lines[0])
    assert back["grad_norm"] == float("inf") and back["rank_iter_s"][1] != back["rank_iter_s"][1]
    assert metrics_json.loads('{"val_loss": NaN, "x": -Infinity}')["x"] == float("-inf")  # the old form
    # resume's cut-back reads both forms, and drops a line cut off by a killed run
    (tmp_path / "metrics.jsonl").write_text(lines[0] + '\n{"iteration": 1, "val_loss": NaN}\n' + lines[2] +
                                            '\n{"iteration": 3, "iter_')
    _logger(tmp_path, log_interval=1).begin(1)
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert kept == [lines[0], '{"iteration": 1, "val_loss": NaN}']


def test_a_full_disk_under_metrics_jsonl_is_one_line_naming_the_file(tmp_path, monkeypatch):
    """It was the OSError's traceback from inside the training loop."""
    log = _logger(tmp_path)
    monkeypatch.setattr(metrics, "open", FullDiskFile, raising=False)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'metrics.jsonl'}: no space left in {tmp_path} "
                                          r"\([\d,]+ bytes free; OSError"):
        log.evaluation(10, 320, 2.5)
