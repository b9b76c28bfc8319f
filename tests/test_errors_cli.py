"""Bad input and lost runs at the command line: the --save lock, what the launcher reports from a
reused log, and workers that stop when their launcher is killed."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from meshlm import launch
from meshlm.checkpoint.lock import hold
from meshlm.cli import main, worker_main
from meshlm.config import Config
from meshlm.errors import CheckpointError, ConfigError, MeshlmError
from test_launch import TINY, clean_env, meshlm, torchrun

# a run that trains until it is stopped; two workers (DP=2)
LONG = ["--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "100000", "--log-interval", "1",
        "--eval-interval", "100000", "--nproc-per-node", "2"]
HOLDER = ("import sys, time\nfrom meshlm.checkpoint.lock import hold\n"
          "with hold(sys.argv[1], 'first-run'):\n    print('held', flush=True)\n    time.sleep(600)\n")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def _stat(pid: int):
    """(state, parent pid) of a process from /proc, or None when it is gone."""
    try:
        text = open(f"/proc/{pid}/stat").read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def children(pid: int) -> list:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or ("", 0))[1] == pid]


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has stopped; only its exit status is left


def _holding(folder):
    """Another job (a process) holding the lock of ``folder`` until the generator is closed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], env=clean_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def lock_holder(tmp_path):
    """Another job holding the lock of tmp_path/ckpt; yields its process."""
    yield from _holding(tmp_path / "ckpt")


# ----------------------------------------------------------------------------- one --save folder, one run

def test_save_onto_a_file_fails_at_once_not_at_the_first_save(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").write_text("my notes\n")
    assert main(["pretrain", *TINY, "--train-iters", "1", "--save", "ckpt", "--run-dir", "run"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshlm: error: --save ckpt is a file, not a directory; give a directory path (it is created if missing)"]
    assert not (tmp_path / "run").exists() and (tmp_path / "ckpt").read_text() == "my notes\n"


@pytest.mark.slow
def test_a_second_run_on_a_save_folder_in_use_is_refused_before_anything_is_written(tmp_path, lock_holder):
    out = meshlm("pretrain", *TINY, "--train-iters", "1", "--save", "ckpt", "--run-dir", "second",
                 cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"meshlm: error: --save ckpt is in use by a running job (pid {lock_holder.pid} on "
        f"{socket.gethostname()}, run directory first-run); wait for it to end or give another --save"]
    assert not (tmp_path / "second").exists()
    assert os.listdir(tmp_path / "ckpt") == ["meshlm.lock"]


def test_a_crashed_holder_leaves_no_stale_lock(tmp_path, lock_holder):
    with pytest.raises(CheckpointError, match=f"pid {lock_holder.pid} "):
        with hold(str(tmp_path / "ckpt")):
            pass
    lock_holder.send_signal(signal.SIGKILL)
    lock_holder.wait()
    with hold(str(tmp_path / "ckpt"), "next-run"):  # the kernel dropped the lock with its holder
        assert "run directory next-run" in open(tmp_path / "ckpt" / "meshlm.lock").read()
    with hold(str(tmp_path / "ckpt")):  # and the block released it
        pass


@pytest.mark.slow
def test_under_torchrun_rank0_takes_the_lock_and_the_refusal_is_printed_once(tmp_path, lock_holder):
    out = torchrun("pretrain", *TINY, "--train-iters", "1", "--save", "ckpt", cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("meshlm: error:") == 1 and "--save ckpt is in use" in out.stderr


def test_the_lock_is_released_when_the_run_ends(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["pretrain", *TINY, "--nproc-per-node", "1", "--train-iters", "1", "--save", "ckpt"]
    monkeypatch.setattr(launch, "run_worker", lambda cfg: 0)  # the run itself is not the point here
    assert main(argv) == 0 and main(argv) == 0
    with hold("ckpt"):
        pass


def test_a_second_run_given_a_running_jobs_log_folder_is_refused_and_leaves_its_logs(tmp_path, monkeypatch,
                                                                                    capsys):
    """`--run-dir other --log-dir first/logs` while `first` ran: the second run set the running job's
    logs aside (logs.<time>) and wrote its own metrics.jsonl and rank logs in their place."""
    monkeypatch.chdir(tmp_path)
    second = []

    def first_job(cfg):  # the first run's workers: meanwhile a second run starts on its log folder
        (tmp_path / "first" / "logs" / "metrics.jsonl").write_text('{"iteration": 1}\n')
        second.append(main(["pretrain", *TINY, "--train-iters", "1", "--run-dir", "other", "--log-dir",
                            "first/logs"]))
        return 0
    monkeypatch.setattr(launch, "run_worker", first_job)
    assert main(["pretrain", *TINY, "--nproc-per-node", "1", "--train-iters", "1", "--run-dir", "first"]) == 0
    assert second == [2]
    assert "meshlm: error: --log-dir first/logs is in use by a running job (pid " in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "first")) == ["config.yaml", "logs", "meshlm.lock"]
    assert (tmp_path / "first" / "logs" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    # a run's own log folder may be its --save folder too (one folder, one lock)
    assert main(["pretrain", *TINY, "--nproc-per-node", "1", "--train-iters", "1", "--run-dir", "third",
                 "--log-dir", "ckpt", "--save", "ckpt"]) == 0


def test_a_save_folder_the_os_refuses_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", *TINY, "--train-iters", "1", "--run-dir", "run", "--save", "/proc/foo"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "meshlm: error: --save /proc/foo cannot be created (No such file or directory); "
        "give a folder you can write to"]
    assert os.listdir(tmp_path) == []


def test_the_lock_never_raises_a_raw_os_error():
    with pytest.raises(ConfigError, match=r"^--log-dir /proc/foo/bar cannot be used \(No such file"):
        with hold("/proc/foo/bar", flag="--log-dir"):
            pass


# ----------------------------------------------------------------------------- one --run-dir, one run

@pytest.fixture
def run_dir_holder(tmp_path):
    """Another job holding the lock of tmp_path/run; yields its process."""
    yield from _holding(tmp_path / "run")


@pytest.mark.parametrize("data", [TINY, ["--train-iters", "1"]], ids=["mock", "embedded-default"])
def test_a_second_run_in_a_run_dir_in_use_is_refused_before_writing_there(tmp_path, monkeypatch, capsys,
                                                                          run_dir_holder, data):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "run_worker", lambda cfg: 0)
    assert main(["pretrain", *data, "--train-iters", "1", "--run-dir", "run", "--save", "ckpt"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"meshlm: error: --run-dir run is in use by a running job (pid {run_dir_holder.pid} on "
        f"{socket.gethostname()}, run directory first-run); wait for it to end or give another --run-dir"]
    assert os.listdir(tmp_path / "run") == ["meshlm.lock"] and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("save", ["run/ckpt", "run"])
def test_a_save_folder_inside_or_equal_to_the_run_dir_works(tmp_path, monkeypatch, save):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "run_worker", lambda cfg: 0)
    argv = ["pretrain", *TINY, "--nproc-per-node", "1", "--train-iters", "1", "--run-dir", "run", "--save", save]
    assert main(argv) == 0 and main(argv) == 0
    assert (tmp_path / "run" / "config.yaml").exists()
    with hold("run"), hold(save if save != "run" else "other"):
        pass


@pytest.mark.slow
def test_under_torchrun_rank0_takes_the_run_dir_lock_and_the_refusal_is_printed_once(tmp_path, run_dir_holder):
    out = torchrun("pretrain", *TINY, "--train-iters", "1", "--run-dir", "run", cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("meshlm: error:") == 1 and "--run-dir run is in use" in out.stderr


# ----------------------------------------------------------------------------- what the launcher reports

@pytest.fixture
def reused_run_dir(tmp_path, monkeypatch):
    """A run directory whose rank0.log holds an error of an earlier run; returns a function that
    makes the next launch_local's worker append ``text`` to that log and fail with ``exitcode``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    import torch.distributed.launcher.api as api

    cfg = Config()
    cfg.logging.run_dir = str(tmp_path / "run")
    log = launch.worker_log_path(cfg, 0)
    os.makedirs(os.path.dirname(log))
    with open(log, "w") as fh:
        fh.write("old output\nmeshlm: error: --data-path old: an earlier run's problem\n")

    def fail_with(text: str, exitcode: int):
        def fake_launch(config, entrypoint):
            def run(*argv):
                with open(log, "a") as fh:
                    fh.write(text)
                failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")
                raise ChildFailedError("meshlm", {0: failure})
            return run
        monkeypatch.setattr(api, "elastic_launch", fake_launch)
        return lambda: launch.launch_local(cfg, "run/config.yaml", 2, worker_main)
    return fail_with


def test_an_old_error_in_a_reused_log_is_not_this_runs_error(reused_run_dir, capsys):
    assert reused_run_dir("new output\n", 1)() == 1
    err = capsys.readouterr().err
    assert "worker rank 0 exited with code 1" in err and "new output" in err
    assert "earlier run" not in err and "old output" not in err


def test_this_runs_own_error_line_is_reported(reused_run_dir):
    with pytest.raises(MeshlmError, match=r"^rank 0: --data-path new: truncated index$"):
        reused_run_dir("meshlm: error: --data-path new: truncated index\n", 2)()


def test_a_worker_killed_by_a_signal_is_reported_as_such(reused_run_dir, capsys):
    assert reused_run_dir(" iteration 7\n", -signal.SIGKILL)() == 1
    err = capsys.readouterr().err
    assert "worker rank 0 was killed by signal 9" in err and "iteration 7" in err
    assert "earlier run" not in err


# ----------------------------------------------------------------------------- workers die with the launcher

@pytest.mark.slow
def test_killing_the_launcher_stops_its_workers_and_frees_the_save_lock(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "meshlm", "pretrain", *LONG, "--save", "ckpt",
                                 "--run-dir", "run"], cwd=tmp_path, env=clean_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        log = tmp_path / "run" / "logs" / "rank0.log"
        wait_for(lambda: log.exists() and " iteration " in log.read_text(), 240, "the workers to train")
        # forked from the launcher's forkserver (its one child that imported meshlm)
        [forkserver] = [pid for pid in children(launcher.pid)
                        if b"meshlm" in open(f"/proc/{pid}/cmdline", "rb").read()]
        workers = children(forkserver)
        assert len(workers) == 2
        # each leads a session of its own (a terminal's Ctrl-C reaches the launcher, whose agent stops them)
        assert [os.getsid(pid) for pid in workers] == workers

        second = meshlm("pretrain", *LONG, "--save", "ckpt", "--run-dir", "second", cwd=tmp_path)
        assert second.returncode == 2 and len(second.stderr.splitlines()) == 1
        assert f"--save ckpt is in use by a running job (pid {launcher.pid} " in second.stderr

        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        wait_for(lambda: not any(alive(pid) for pid in workers), 30, "the workers to stop")
        with hold(str(tmp_path / "ckpt")):
            pass
    finally:
        for pid in workers + [launcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


def test_the_lock_holds_on_a_full_disk_without_its_note_of_who_holds_it(tmp_path, monkeypatch):
    """Writing the holder's note raised ENOSPC out of `hold`, a traceback before the run started."""
    import types

    from meshlm.checkpoint import lock

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    class FullDiskFile:  # the real lock file, whose writes the full disk refuses
        def __init__(self, fh):
            self.fh = fh

        def __getattr__(self, name):
            return full_disk if name in ("write", "flush") else getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()
    real_open = lock._open_lock
    monkeypatch.setattr(lock, "_open_lock", lambda folder, flag: FullDiskFile(real_open(folder, flag)))
    monkeypatch.setattr(lock, "os", types.SimpleNamespace(**{**vars(os), "write": full_disk}))
    with hold(str(tmp_path), flag="--run-dir"):
        monkeypatch.undo()
        with pytest.raises(CheckpointError, match="is in use by a running job"):
            with hold(str(tmp_path), flag="--run-dir"):
                pass
