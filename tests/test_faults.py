"""Keep training through faults, or end clearly: a hang ends the job within the timeout naming
the collective, its group and the missing rank; a NaN is named with its iteration and rank and
stops or skips the step; a slowed rank is named as a straggler; heartbeats reach every rank's log."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest

from distributed import run_distributed
from inject_faults import inject, weights
from meshlm.config import Config
from meshlm.errors import TrainingError
from meshlm.training import trainer
from test_launch import TINY, clean_env

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _config(tmp: str, iters: int = 4, **training) -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 1, 16, 2, 8, 64
    m.make_vocab_size_divisible_by = 16
    t.micro_batch_size, t.global_batch_size, t.train_iters = 1, 2, iters
    t.log_interval, t.eval_interval, t.eval_iters = 1, 1000, 1
    t.lr_warmup_iters = 0
    for key, value in training.items():
        setattr(t, key, value)
    cfg.data.mock_data = True
    cfg.logging.log_dir = os.path.join(tmp, "logs")
    return cfg


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """Rank 1 sleeps before iteration 2's DP reduction; rank 0 waits in the bucket's all-reduce.
    With a 3 s timeout the job ends (nonzero) long before the 120 s sleep, with one error line
    naming the collective, the dp×cp group [0, 1] and rank 1 as the rank that did not arrive."""
    args = [*TINY, "--eval-interval", "100000", "--train-iters", "4", "--run-dir", "run", "--num-workers", "0"]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(HERE, "inject_faults.py"), "pretrain", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env=clean_env(OMP_NUM_THREADS="1", FAULT="hang:1:2", MESHLM_DISTRIBUTED_TIMEOUT_S="3",
                                        PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])))
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert elapsed < 60
    errors = [line for line in done.stderr.splitlines() if line.startswith("meshlm: error: hang:")]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert "rank 0 waited" in line and "in all_reduce of DP gradient bucket 0 over the dp_cp[0, 1] group" in line
    assert "at iteration 2" in line and "did not arrive: rank 1 (outside collectives" in line, line
    assert "iteration 2 (forward-backward)" in line  # what rank 1 published about itself
    assert line in (tmp_path / "run" / "logs" / "rank0.log").read_text()


def _nan_run(rank, world, tmp, skip):
    inject("nan:1:3")
    seen = {}
    step = trainer.launch_step

    def launch_step(run, state):  # the weights before and after iteration 3
        if state.iteration == 2:
            seen["before"] = weights(run)
        loss = step(run, state)
        if state.iteration == 3:
            seen["after"] = weights(run)
        return loss
    trainer.launch_step = launch_step
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            summary = trainer.pretrain(_config(tmp, iters=5, skip_nan_steps=skip))
    except TrainingError as e:
        return {"error": str(e)}
    return {"losses": summary["train_losses"], "unchanged": bool((seen["before"] == seen["after"]).all()),
            "printed": out.getvalue()}


def test_a_nan_on_one_rank_stops_the_run_naming_the_iteration_and_the_rank(tmp_path):
    results = run_distributed(_nan_run, 2, str(tmp_path), False)
    for r in results:
        assert r["error"].startswith("iteration 3: lm loss is nan (local loss non-finite on rank(s) 1 (dp=1 "), r
        assert "local gradients non-finite before the DP reduction on rank(s) 1 (dp=1" in r["error"]
        assert "rank(s) 0" not in r["error"] and "last good checkpoint: none" in r["error"]


def test_a_nan_under_skip_nan_steps_skips_that_step_only(tmp_path):
    """--skip-nan-steps: iteration 3 is skipped (no loss, weights untouched on every rank), the
    run finishes; iterations 1-2 have the losses of a run without the fault."""
    results = run_distributed(_nan_run, 2, str(tmp_path / "nan"), True)
    clean = run_distributed(_clean_run, 2, str(tmp_path / "clean"))
    for r in results:
        assert r["losses"][2] is None and all(x is not None for x in r["losses"][:2] + r["losses"][3:])
        assert r["unchanged"]
        assert r["losses"][:2] == clean[0][:2]
    assert "iteration 3: lm loss is nan (local loss non-finite on rank(s) 1 (dp=1" in results[0]["printed"]
    assert "step skipped (--skip-nan-steps)" in results[0]["printed"]


def _clean_run(rank, world, tmp):
    return trainer.pretrain(_config(tmp, iters=2))["train_losses"]


def _slowed_run(rank, world, tmp):
    inject("slow:1:0.3")
    cfg = _config(tmp, iters=4)
    cfg.logging.heartbeat_interval = 0.1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.pretrain(cfg)
    return out.getvalue()


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """A 2-rank run whose rank 1 sleeps 0.3 s before each step's forward-backward."""
    tmp = tmp_path_factory.mktemp("slowed")
    printed = run_distributed(_slowed_run, 2, str(tmp))
    records = [json.loads(line) for line in open(tmp / "logs" / "metrics.jsonl")]
    return tmp, printed, [r for r in records if "lm_loss" in r]


def test_a_slowed_rank_is_named_as_a_straggler_and_every_rank_time_is_recorded(slowed):
    _, printed, records = slowed
    assert len(records) == 4 and all(len(r["rank_iter_s"]) == 2 for r in records)
    times = [r["rank_iter_s"] for r in records]
    # rank 1's 0.3 s sleep is its own work (the first step's warm-up on rank 0 may hide part of it)
    assert all(slow - fast > 0.2 for fast, slow in times[1:]) and times[0][1] > times[0][0], times
    lines = [line for line in printed[0].splitlines() if line.startswith("straggler:")]
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 1 took "), printed[0]
    assert "for 3 log intervals in a row" in lines[0]
    assert not [line for line in printed[1].splitlines() if line.startswith("straggler:")]  # rank 0 says it


def test_every_rank_writes_heartbeats_to_its_own_log(slowed):
    tmp, _, _ = slowed
    for rank in (0, 1):
        beats = [line for line in open(tmp / "logs" / f"rank{rank}.log") if line.startswith(f"heartbeat rank {rank}: ")]
        assert len(beats) >= 3
        assert any(" s since the last step ended, " in b and "iteration " in b for b in beats)


def _watchdog(positions: dict):
    """A rank-0 Watchdog of a world of 3 whose store holds ``positions`` (no process group)."""
    from meshlm.parallel import watchdog
    dog = object.__new__(watchdog.Watchdog)
    dog.rank, dog.timeout_s, dog.poll_s = 0, 3.0, 0.3
    dog.labels, dog.ranks = {id(None): "world[0, 1, 2]"}, {id(None): [0, 1, 2]}
    dog._read = lambda r: positions[r]
    return dog


def _position(inside=None, count=5, idle_s=0.0):
    return {"t": time.time(), "iteration": 3, "phase": "forward-backward", "in": inside, "idle_s": idle_s,
            "counts": {"world[0, 1, 2]": count}}


def test_a_hang_names_each_ranks_own_collective_not_a_pairing_fault_when_they_differ():
    """Rank 1 sits in a broadcast where rank 0 waits in an all_reduce (the same call #5 of the world
    group): the line said every other rank was inside the all_reduce too ("pairing fault")."""
    dog = _watchdog({1: _position(["broadcast", "world[0, 1, 2]", 5, 4.0]), 2: _position(None, 4, 3.5)})
    line = dog.verdict(("all_reduce", None, 5, time.monotonic() - 4.0, None))
    assert "in all_reduce over the world[0, 1, 2] group (its collective #5 there)" in line
    assert "did not arrive: rank 2 (outside collectives for 3.5 s, at iteration 3 (forward-backward))" in line
    assert "in another collective: rank 1 (inside broadcast over world[0, 1, 2] (#5) for 4.0 s)" in line
    assert "pairing" not in line and "inside it too" not in line, line
    dog = _watchdog({1: _position(["all_reduce", "world[0, 1, 2]", 5, 4.0]), 2: _position(None, 6)})
    line = dog.verdict(("all_reduce", None, 5, time.monotonic() - 4.0, None))
    assert "already returned from it: rank 2 (outside collectives" in line and "inside it too: rank 1" in line
    assert "pairing" not in line
    dog = _watchdog({1: _position(["all_reduce", "world[0, 1, 2]", 5, 4.0]),
                     2: _position(["all_reduce", "world[0, 1, 2]", 5, 4.0])})
    line = dog.verdict(("all_reduce", None, 5, time.monotonic() - 4.0, None))
    assert line.endswith("inside it too: rank 1, rank 2 (every other rank is in it: a transport or pairing "
                         "fault); ending the job")


class _PS:
    def __init__(self, world):
        import torch
        self.world_size, self.rank, self.device = world, 0, torch.device("cpu")


def _gathering(monkeypatch, intervals):
    """gather() sees the given [rank 0 s, rank 1 s] per log interval, in turn (no process group)."""
    from meshlm.training import stragglers
    feed = iter(intervals)

    def call(name, group, fn, parts, mine):
        for p, t in zip(parts, next(feed)):
            p.fill_(t)
    monkeypatch.setattr(stragglers.watchdog, "call", call)
    return stragglers


def test_a_straggler_is_named_when_it_starts_lagging_and_once_when_it_recovers(monkeypatch, capsys):
    """The line was printed again every CONSECUTIVE intervals while the rank lagged (30 times in a run)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    stragglers = _gathering(monkeypatch, [[0.01, 0.05]] * 12 + [[0.01, 0.01]] * 3 + [[0.01, 0.05]] * 3)
    watch = stragglers.StragglerWatch(_PS(2))
    for _ in range(18):
        watch.gather()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split(" took")[0] for line in lines] == [" rank 1", " rank 1 recovered", " rank 1"]
    assert lines[0].startswith("straggler: rank 1 took 50.0 ms") and "for 3 log intervals in a row" in lines[0]
    assert lines[1] == "straggler: rank 1 recovered: 10.0 ms per iteration outside collectives, the median of all " \
                       "2 ranks 10.0 ms"


def test_more_cpu_workers_than_cores_is_said_once_and_turns_straggler_lines_off(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    stragglers = _gathering(monkeypatch, [[0.01, 0.05]] * 6)
    watch = stragglers.StragglerWatch(_PS(2))
    for _ in range(6):
        assert len(watch.gather()) == 2  # still recorded (metrics.jsonl's rank_iter_s)
    assert capsys.readouterr().out == ("meshlm: note: 4 workers on 2 CPU cores: they take turns on the cores, so "
                                       "step times are shared-core times; straggler detection is off\n")


def test_a_run_of_loss_spikes_prints_one_line_when_it_starts_and_one_when_it_ends():
    """A loss that stayed high printed the spike line every iteration (a spike stays out of the mean)."""
    from meshlm.training.faults import LossSpikes
    spikes, lines = LossSpikes(2.0), []
    for it, loss in enumerate([1.0] * 6 + [5.0] * 4 + [None, 1.0, 1.0, 5.0], 1):
        lines.append(spikes.report(it, loss, spikes.check(loss)))
    said = [(it, line) for it, line in enumerate(lines, 1) if line]
    assert [it for it, _ in said] == [7, 12, 14], said
    assert said[0][1].startswith("loss spike at iteration 7: lm loss 5.000000E+00 > 2 × the mean 1.000000E+00")
    assert said[1][1] == "loss back below 2 × the running mean at iteration 12 (1.000000E+00) after 4 spiking " \
                         "step(s) (--loss-spike-threshold)"


def test_skip_nan_steps_stops_after_too_many_non_finite_steps_in_a_row(monkeypatch, capsys):
    """Weights that make every batch NaN (--lr 1e20) were skipped step after step to the end of the
    run under --skip-nan-steps (a skipped step leaves them as they are): hours that trained nothing."""
    import types
    monkeypatch.setattr(trainer, "nan_origin", lambda ps, outputs, finite: "local loss non-finite on rank(s) 0")
    cfg = Config()
    cfg.training.skip_nan_steps = True
    run = types.SimpleNamespace(cfg=cfg, ps=types.SimpleNamespace(rank=0), last_checkpoint="ck/iter_0000004",
                                ddp=types.SimpleNamespace(local_grads_finite=lambda: False), nan_skips=0)
    for iteration in range(1, trainer.MAX_NAN_SKIPS):
        trainer._stop_unless_skipping(run, iteration, "lm loss is nan", [])
    run.nan_skips = 0  # a good step between: counting starts again
    for iteration in range(1, trainer.MAX_NAN_SKIPS):
        trainer._stop_unless_skipping(run, iteration, "lm loss is nan", [])
    with pytest.raises(TrainingError, match=rf"^iteration {trainer.MAX_NAN_SKIPS}: lm loss is nan \(.*\), the "
                                            rf"{trainer.MAX_NAN_SKIPS}th step in a row: --skip-nan-steps cannot "
                                            r"recover .*last good checkpoint: ck/iter_0000004; resume from it"):
        trainer._stop_unless_skipping(run, trainer.MAX_NAN_SKIPS, "lm loss is nan", [])
    assert capsys.readouterr().out.count("step skipped (--skip-nan-steps)") == 2 * (trainer.MAX_NAN_SKIPS - 1)
