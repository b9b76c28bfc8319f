"""Auto-resume: a job under `torchrun --max-restarts 3` whose worker is killed (SIGKILL) restarts,
finds the latest complete checkpoint in --load (== --save) by itself and goes on with the loss
trajectory of an uninterrupted run, no sample consumed twice or skipped."""

import json
import os
import re
import subprocess
import sys

from test_launch import TINY, clean_env

ITERS, SAVE_EVERY, GLOBAL_BATCH = 8, 2, 4
HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*\| lm loss: (\S+) \|")


def _torchrun(cwd, kill: str = ""):
    args = [*TINY, "--eval-interval", "100000", "--train-iters", str(ITERS), "--run-dir", "run",
            "--save", "ckpt", "--load", "ckpt", "--save-interval", str(SAVE_EVERY), "--num-workers", "0"]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", "--max-restarts", "3", os.path.join(HERE, "kill_once.py"), "pretrain", *args],
                          cwd=cwd, env=clean_env(OMP_NUM_THREADS="1", KILL_ONCE=kill),
                          capture_output=True, text=True, timeout=300)


def _trajectory(run_dir) -> list:
    """(iteration, consumed samples, lm loss) of each logged iteration in metrics.jsonl."""
    records = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    return [(r["iteration"], r["consumed_samples"], r["lm_loss"]) for r in records if "lm_loss" in r]


def _printed(run_dir) -> list:
    """(iteration, consumed samples, lm loss as printed) of each iteration line in rank 0's log,
    every attempt of the job (the log is appended to)."""
    return [m.groups() for m in LINE.finditer(open(run_dir / "logs" / "rank0.log").read())]


def test_a_killed_worker_restarts_from_the_latest_checkpoint_and_repeats_the_uninterrupted_run(tmp_path):
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole = _torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    marker = tmp_path / "killed"
    cut = _torchrun(tmp_path / "cut", kill=f"1:5:{marker}")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert marker.exists()  # rank 1 was killed after iteration 5, before the save at 6
    reference = _trajectory(tmp_path / "whole" / "run")
    assert [r[:2] for r in reference] == [(i, i * GLOBAL_BATCH) for i in range(1, ITERS + 1)]
    assert _trajectory(tmp_path / "cut" / "run") == reference  # exact: every loss, every position
    printed, expected = _printed(tmp_path / "cut" / "run"), _printed(tmp_path / "whole" / "run")
    # first attempt: iterations 1..5 (rank 0 may print 5 before its peer dies); then 5..8 again from
    # the checkpoint of iteration 4, each line as in the uninterrupted run
    restart = next(i for i in range(1, len(printed)) if int(printed[i][0]) <= int(printed[i - 1][0]))
    assert printed[restart][0] == "5" and printed[:restart] == expected[:restart]
    assert printed[restart:] == expected[4:]
    assert "loaded checkpoint" in open(tmp_path / "cut" / "run" / "logs" / "rank0.log").read()
