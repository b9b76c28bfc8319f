"""--exit-duration-in-mins and --exit-interval (Megatron's checkpoint_and_decide_exit): every rank
stops after the same iteration, saves first with --save, and returns normally (exit status 0)
without the end-of-run evaluation."""

import os
import signal

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



def _signal_rank1_after(iteration: int):
    """launch_step that sends rank 1 its own SIGTERM right after ``iteration`` (rank 0 gets none)."""
    real = trainer.launch_step

    def step(run, state):
        loss = real(run, state)
        if run.ps.rank == 1 and state.iteration == iteration:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    return step


def _losses(rank, world, tmp, flags, signal_at=None, load=False):
    import torch
    if signal_at is not None:
        trainer.launch_step = _signal_rank1_after(signal_at)
    cfg = _config(tmp, **flags)  # dropout on (the default): the RNG state must resume too
    if load:
        cfg.checkpoint.load = cfg.checkpoint.save
    summary = trainer.pretrain(cfg, dtype=torch.float64)
    return summary["iterations"], summary["train_losses"], summary["val_losses"]


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_saves_and_the_resumed_run_repeats_the_losses(tmp_path):
    """--exit-signal-handler: SIGTERM on rank 1 after iteration 2 → both ranks stop after iteration
    2 (the flag is reduced over ranks), save it, return normally; resuming gives, in float64, the
    losses of iterations 3..6 of an uninterrupted run, exactly."""
    whole = run_distributed(_losses, 2, str(tmp_path / "whole"), {})
    cut = run_distributed(_losses, 2, str(tmp_path / "cut"), {"exit_signal_handler": True}, 2)
    assert [c[0] for c in cut] == [2, 2] and cut[0][2] == []  # no evaluation after the stop
    assert (tmp_path / "cut" / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    rest = run_distributed(_losses, 2, str(tmp_path / "cut"), {"exit_signal_handler": True}, None, True)
    assert rest[0][0] == ITERS
    assert cut[0][1] + rest[0][1] == whole[0][1]


def test_the_signal_flag_records_the_signal_and_puts_the_old_handler_back():
    with trainer.SignalFlag("SIGUSR1") as flag:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
