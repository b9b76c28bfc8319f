"""--exit-duration-in-mins and --exit-interval (Megatron's checkpoint_and_decide_exit): every rank
stops after the same iteration, saves first with --save, and returns normally (exit status 0)
without the end-of-run evaluation."""

import os

import pytest

from distributed import run_distributed
from meshlm.config import Config
from meshlm.training import trainer

ITERS = 6


def _config(tmp: str, **training) -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 1, 16, 2, 8, 64
    m.make_vocab_size_divisible_by = 16
    t.micro_batch_size, t.global_batch_size, t.train_iters = 1, 2, ITERS
    t.log_interval, t.eval_interval, t.eval_iters = 1, 100, 1
    for key, value in training.items():
        setattr(t, key, value)
    cfg.data.mock_data = True
    cfg.logging.log_dir = os.path.join(tmp, "logs")
    cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    return cfg


def _rank1_clock_jumps_an_hour_at_its_third_reading():
    real, readings = trainer._wall_clock, [0]

    def clock():
        readings[0] += 1
        return real() + (3600.0 if readings[0] >= 3 else 0.0)
    return clock


def _run(rank, world, tmp, flags):
    if rank == 1 and "exit_duration_in_mins" in flags:
        trainer._wall_clock = _rank1_clock_jumps_an_hour_at_its_third_reading()
    summary = trainer.pretrain(_config(tmp, **flags))
    return summary["iterations"], summary["val_losses"]


@pytest.mark.parametrize("flags", [{"exit_duration_in_mins": 60}, {"exit_interval": 3}],
                         ids=["duration", "interval"])
def test_early_exit_stops_every_rank_after_the_same_iteration_and_saves(tmp_path, flags):
    """Duration: only rank 1's clock passes the hour (after iteration 3); the MAX over ranks stops
    rank 0 there too (without it rank 0 would wait for rank 1 in the next step's collectives)."""
    results = run_distributed(_run, 2, str(tmp_path), flags)
    assert results == [(3, []), (3, [])]  # no evaluation after an early exit
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

