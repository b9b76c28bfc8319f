"""`meshlm sweep` (meshlm/sweep.py): real pretrain trials, a diverged one recorded and passed over,
a resumed sweep running only the trials it lacks, the page and the chosen flags."""

import json

import pytest

from meshlm.cli import main

PRETRAIN = ["--", "--mock-data", "--vocab-size", "64", "--num-layers", "1", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1",
            "--eval-iters", "0", "--use-mup"]


@pytest.mark.slow
def test_sweep_records_divergence_resumes_and_prints_mup_flags(tmp_path, capsys):
    sweep = ["sweep", "--hidden-size", "32", "--train-iters", "3", "--slots", "2", "--sweep-dir", str(tmp_path),
             "--target-hidden-size", "256"]
    assert main(sweep + ["--lr", "1e-3,1e4"] + PRETRAIN) == 0
    first = [json.loads(line) for line in open(tmp_path / "trials.jsonl")]
    status = {r["values"]["lr"]: r["status"] for r in first}
    assert status == {1e-3: "ok", 1e4: "diverged"}, first
    capsys.readouterr()
    # a second start with one more LR: the two finished trials are kept, only the new one runs
    assert main(sweep + ["--lr", "1e-3,3e-3,1e4"] + PRETRAIN) == 0
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in open(tmp_path / "trials.jsonl")]
    assert lines[:2] == first and [r["values"]["lr"] for r in lines[2:]] == [3e-3]
    assert "resuming, 2 trial(s) already" in out
    best = min((r for r in lines if r["status"] == "ok"), key=lambda r: r["loss"])
    assert (f"chosen for the full run: --use-mup --mup-base-hidden-size 32 --hidden-size 256 "
            f"--lr {best['values']['lr']!r}") in out
    page = (tmp_path / "sweep.html").read_text()
    assert 'data-series="width 32, 3 iters" data-points="2"' in page and page.count('class="diverged"') == 1


def test_successive_halving_keeps_the_best_half_and_runs_them_longer(tmp_path, monkeypatch, capsys):
    from meshlm import sweep

    ran = []

    def fake_trials(todo, args, base, done):  # loss: distance of log10(lr) from -2.8, less with more iters
        import math
        for values, iters in todo:
            ran.append((values["lr"], iters))
            done[sweep._key(values, iters)] = {"values": values, "iters": iters, "status": "ok", "note": "",
                                               "loss": abs(math.log10(values["lr"]) + 2.8) + 1 / iters}

    monkeypatch.setattr(sweep, "_run_trials", fake_trials)
    assert main(["sweep", "--lr", "1e-4,1e-3,1e-2,1e-1", "--method", "halving", "--train-iters", "2",
                 "--sweep-dir", str(tmp_path), "--", "--mock-data", "--vocab-size", "64"]) == 0
    assert ran == [(1e-4, 2), (1e-3, 2), (1e-2, 2), (1e-1, 2), (1e-3, 4), (1e-2, 4)]  # one left: done
    assert "chosen for the full run: --lr 0.001" in capsys.readouterr().out


@pytest.mark.parametrize("bad, words", [
    (["--lr", "1e-3", "--rungs", "0", "--method", "halving"], "--rungs 0 is out of range"),
    (["--lr", "1e-3", "--slots", "0"], "--slots 0 is out of range"),
    (["--lr", "1e-3", "--eta", "1", "--method", "halving"], "--eta 1 is out of range"),
    (["--lr", "1e-3,,2e-3"], "give comma-separated floats"),
    (["--lr", "nan,inf"], "'nan' is not a finite positive value"),
    (["--lr=-1e-3,0"], "'-1e-3' is not a finite positive value"),
    (["--lr", "-1e-3,1e-2"], "--lr -1e-3,1e-2: '-1e-3' is not a finite positive value"),  # no '=': was argparse's
    (["--lr", "1e-3", "--init-method-std", "-.02"], "'-.02' is not a finite positive value"),
    (["--lr", "1e-3,1e-3"], "a value is listed twice"),
    (["--lr", "1e-3", "--hidden-size", "0,-8"], "'0' is not a finite positive value; give e.g. --hidden-size 256,512"),
    (["--lr", "1e-3", "--global-batch-size", "3.5"], "give comma-separated ints, e.g. --global-batch-size 32,64"),
    (["--lr", "1e-3", "--", "--bogus-flag"], "the trials' pretrain flags are refused"),
    (["--lr", "1e-3", "--", "--mock-data", "--num-attention-heads", "3"], "the trials' pretrain flags are refused"),
    # the sweep's own per-trial flags, given after `--` too: the trial's were silently replaced (50 iterations run)
    (["--lr", "1e-3", "--", "--mock-data", "--train-iters", "3"], "--train-iters 3 after `--`: the sweep sets each "
                                                                   "trial's length: give it as `meshlm sweep --train-iters N`"),
    (["--lr", "1e-3,2e-3", "--", "--lr=5"], "--lr 5 after `--`: the sweep sets each trial's value from its own --lr"),
    (["--lr", "1e-3", "--hidden-size", "32,64", "--", "--hidden-size", "48"], "--hidden-size 48 after `--`"),
    (["--lr", "1e-3", "--", "--run-dir", "x"], "--run-dir x after `--`: the sweep runs each trial in its own folder"),
    # folders every trial shared: under --log-dir every trial "failed" unread (and the sweep said to lower --lr);
    # under --save = --load each trial resumed the one before it
    (["--lr", "1e-3,2e-3", "--", "--mock-data", "--log-dir", "logs"], "--log-dir logs after `--`: every trial would "
                                                                       "log into that one folder"),
    (["--lr", "1e-3,2e-3", "--", "--mock-data", "--save=ck", "--load", "ck"], "--save ck after `--`: every trial "
                                                                               "would save into that one folder"),
    # halving's flags on a grid sweep were silently ignored
    (["--lr", "1e-3", "--rungs", "4", "--eta", "3", *PRETRAIN], "--rungs 4 --eta 3: successive halving's, and this "
                                                                 "sweep is --method grid"),
    # the full run's width: the sweep ran every trial, then printed flags of a model pretrain refuses
    (["--lr", "1e-3", "--target-hidden-size", "65", *PRETRAIN], "--target-hidden-size 65: the full run would be "
                                                                 "refused: --hidden-size 65 is not divisible by"),
])
def test_bad_sweep_input_is_one_line_before_any_trial(tmp_path, capsys, bad, words):
    """The newcomer's cases: each crashed, was silently changed, or ran every trial before failing."""
    assert main(["sweep", "--sweep-dir", str(tmp_path / "sw"), *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "sw" / "trials.jsonl").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_sweep_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, where):
    """os.makedirs' FileExistsError / FileNotFoundError traceback before."""
    folder = tmp_path / "f" if where == "file" else "/proc/meshlm-sweep"
    if where == "file":
        folder.write_text("x")
    assert main(["sweep", "--lr", "1e-3", "--sweep-dir", str(folder), "--"]) == 2
    [err] = capsys.readouterr().err.splitlines()
    assert err.startswith(f"meshlm: error: --sweep-dir {folder} ")


def test_a_trials_line_cut_by_a_kill_is_dropped_and_the_sweep_resumes(tmp_path, monkeypatch, capsys):
    """The kill the resume is for can cut trials.jsonl's last line: its JSONDecodeError was a traceback,
    and a line appended after it would have been glued to it."""
    from meshlm import sweep
    ok = {"values": {"lr": 1e-3}, "iters": 2, "status": "ok", "loss": 1.0, "note": ""}
    (tmp_path / "trials.jsonl").write_text(json.dumps(ok) + '\n{"values": {"lr": 2e-3}, "it')

    def fake_trials(todo, args, base, done):
        with open(tmp_path / "trials.jsonl", "a") as fh:
            for values, iters in todo:
                if sweep._key(values, iters) not in done:
                    rec = {"values": values, "iters": iters, "status": "ok", "loss": 2.0, "note": ""}
                    done[sweep._key(values, iters)] = rec
                    fh.write(json.dumps(rec) + "\n")
    monkeypatch.setattr(sweep, "_run_trials", fake_trials)
    monkeypatch.setattr(sweep, "_dry_run", lambda *a: None)
    assert main(["sweep", "--lr", "1e-3,2e-3", "--train-iters", "2", "--sweep-dir", str(tmp_path), "--"]) == 0
    captured = capsys.readouterr()
    assert "resuming, 1 trial(s) already" in captured.out and "line 2 is cut off" in captured.err
    assert [json.loads(line)["values"]["lr"] for line in open(tmp_path / "trials.jsonl")] == [1e-3, 2e-3]
    (tmp_path / "trials.jsonl").write_text("[1, 2]\n")
    assert main(["sweep", "--lr", "1e-3", "--sweep-dir", str(tmp_path), "--"]) == 2
    assert "is not a trial record" in capsys.readouterr().err


def test_a_sweep_dir_of_other_pretrain_flags_is_refused_not_reused(tmp_path, capsys):
    """A resume with another model after `--` (here --num-layers 2) kept the first model's trials and
    chose the full run's LR from their losses."""
    ok = {"values": {"lr": 1e-3}, "iters": 2, "status": "ok", "loss": 1.0, "note": "", "pretrain": PRETRAIN[1:]}
    (tmp_path / "trials.jsonl").write_text(json.dumps(ok) + "\n")
    other = PRETRAIN[:5] + ["2"] + PRETRAIN[6:]
    assert main(["sweep", "--lr", "1e-3", "--train-iters", "2", "--sweep-dir", str(tmp_path), *other]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--sweep-dir {tmp_path} holds trials of other pretrain flags" in err and len(err.splitlines()) == 1
    assert "now --mock-data --vocab-size 64 --num-layers 2" in err
