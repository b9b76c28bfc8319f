"""Launching: `meshlm pretrain` starts its workers, each logs to its own file, and a failing worker
is reported as one line naming its rank, not as the elastic agent's tracebacks."""

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import yaml

from distributed import _free_port
from meshlm import launch
from meshlm.cli import main, worker_main
from meshlm.config import Config
from meshlm.errors import DataError, MeshlmError

TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "1", "--eval-iters", "1"]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", launch.WORKER_ENV)}
    env.update(extra)
    return env


def meshlm(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "meshlm", *argv], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_pretrain_on_two_cpu_workers_end_to_end(tmp_path):
    out = meshlm("pretrain", *TINY, "--train-iters", "2", "--nproc-per-node", "2", "--run-dir", "run",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == "meshlm: run directory run"
    assert "DP=2" in out.stdout and "validation loss at iteration 2" in out.stdout
    saved = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    assert saved["training"]["train_iters"] == 2 and saved["logging"]["run_dir"] == "run"
    for rank in (0, 1):
        assert (tmp_path / "run" / "logs" / f"rank{rank}.log").exists()
    records = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "metrics.jsonl")]
    assert max(r.get("iteration", 0) for r in records) == 2
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_data_error_inside_a_worker_is_one_line_naming_the_rank(tmp_path):
    # a valid indexed dataset (so validation passes) holding an id beyond --vocab-size 128, which
    # the workers check against the tokenizer before the first step
    from meshlm.data.indexed import IndexedDatasetWriter
    writer = IndexedDatasetWriter(str(tmp_path / "bad"))
    writer.add_document(list(range(120, 140)) * 4)
    writer.finalize()
    out = meshlm("pretrain", *[a for a in TINY if a != "--mock-data"], "--data-path", str(tmp_path / "bad"),
                 "--tokenizer-type", "NullTokenizer", "--train-iters", "2", "--nproc-per-node", "2",
                 "--run-dir", "run", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshlm: error: rank ") and "bad" in lines[0]


@pytest.mark.slow
def test_a_crashed_worker_is_reported_by_rank_with_its_log_tail(tmp_path):
    # a config file the workers cannot read: each worker exits with status 2 before training
    code = ("import sys; from meshlm import launch; from meshlm.cli import worker_main; from meshlm.config import Config\n"
            "cfg = Config(); cfg.logging.run_dir = sys.argv[1]\n"
            "sys.exit(launch.launch_local(cfg, sys.argv[2], 2, worker_main))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(tmp_path / "absent.yaml")],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "meshlm: error: worker rank " in out.stderr and "exited with code 2" in out.stderr
    assert "ChildFailedError" not in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- in-process pieces

@pytest.fixture
def world_of_one(monkeypatch, tmp_path):
    """Environment of rank 0 of a one-process job launched by meshlm; a Config with a run dir."""
    port = _free_port()
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), **{launch.WORKER_ENV: "1"}).items():
        monkeypatch.setenv(key, value)
    cfg = Config()
    cfg.logging.run_dir = str(tmp_path / "run")
    return cfg


def fake_trainer(monkeypatch, pretrain):
    module = types.ModuleType("meshlm.training.trainer")
    module.pretrain = pretrain
    monkeypatch.setitem(sys.modules, "meshlm.training.trainer", module)


def test_worker_output_and_user_errors_go_to_its_log(world_of_one, monkeypatch):
    def pretrain(cfg):
        print("step 1 done")
        raise DataError("--data-path x: truncated index")
    fake_trainer(monkeypatch, pretrain)
    assert launch.run_worker(world_of_one) == 2
    log = open(launch.worker_log_path(world_of_one, 0)).read()
    assert "step 1 done\n" in log and log.endswith("meshlm: error: --data-path x: truncated index\n")


def test_worker_bug_keeps_its_traceback_in_the_log(world_of_one, monkeypatch):
    def pretrain(cfg):
        raise RuntimeError("shape mismatch in layer 3")
    fake_trainer(monkeypatch, pretrain)
    assert launch.run_worker(world_of_one) == 1
    log = open(launch.worker_log_path(world_of_one, 0)).read()
    assert "Traceback" in log and "RuntimeError: shape mismatch in layer 3" in log


HANG = "meshlm: error: hang: rank 0 waited 6.2 s in all_reduce of DP gradient bucket 0; ending the job"


def test_a_hang_in_a_self_launched_worker_is_reported_once_with_status_1(world_of_one, monkeypatch, capfd):
    """The watchdog printed its line on the console and the launcher printed it again from the log
    (two lines, exit status 2); now it goes to the log alone and the launcher prints it once, exit 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api
    from meshlm.parallel import watchdog

    fake_trainer(monkeypatch, lambda cfg: watchdog._last_words(HANG))  # the watchdog's words before os._exit(1)
    assert launch.run_worker(world_of_one) == 0
    assert HANG not in "".join(capfd.readouterr())
    assert open(launch.worker_log_path(world_of_one, 0)).read().endswith(HANG + "\n")

    def elastic_launch(launch_cfg, entry):
        def run(*argv):
            with open(launch.worker_log_path(world_of_one, 0), "a") as log:
                log.write(HANG + "\n")
            raise ChildFailedError("meshlm", {0: ProcessFailure(0, 123, 1, "")})
        return run
    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    assert launch.launch_local(world_of_one, "config.yaml", 1, worker_main) == 1
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "hang" in line] == [HANG]


def test_a_collective_a_dead_peer_broke_is_one_line_and_other_errors_keep_their_traceback(world_of_one,
                                                                                            monkeypatch):
    """kill -9 of one rank of a torchrun / srun / hand-launched job: each survivor ended in gloo's
    RuntimeError traceback ("Read error …: Connection reset by peer. This is typically caused by a
    remote worker hanging or bugs in the application"), out of a collective."""
    from meshlm.errors import TrainingError
    from meshlm.parallel import watchdog

    def broken(message):
        def fn():
            raise RuntimeError(message)
        return lambda cfg: watchdog.call("all_reduce of DP gradient bucket 0", None, fn)
    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43679: Connection reset by peer. This is …"
    fake_trainer(monkeypatch, broken(gloo))
    assert launch.run_worker(world_of_one) == 2  # self-launched: the launcher reports the log's line
    [line] = [x for x in open(launch.worker_log_path(world_of_one, 0)) if x.startswith("meshlm: error:")]
    assert line.startswith("meshlm: error: lost a peer in all_reduce of DP gradient bucket 0 over ")
    assert "the backend says 'reset by peer', so another rank of the job died first" in line
    monkeypatch.delenv(launch.WORKER_ENV)  # under torchrun / srun: raised, printed in one line by cli
    with pytest.raises(TrainingError, match="^lost a peer in all_reduce of DP gradient bucket 0"):
        launch.run_worker(world_of_one)
    fake_trainer(monkeypatch, broken("shape [4] does not match [8]"))  # a bug: its traceback stays
    with pytest.raises(RuntimeError, match="shape"):
        launch.run_worker(world_of_one)


def test_a_dead_data_loader_process_is_one_line_and_the_launcher_names_its_rank_not_the_survivor(
        world_of_one, monkeypatch, capsys):
    """A data-loader process killed (the OOM killer's SIGKILL) ended its rank in a 40-line traceback;
    the other rank then lost its peer at once, and the launcher, taking the lower rank at the same
    time, named the survivor's lost connection, not the dead loader."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    def pretrain(cfg):
        raise RuntimeError("DataLoader worker (pid 12324) is killed by signal: Killed. ")
    fake_trainer(monkeypatch, pretrain)
    assert launch.run_worker(world_of_one) == 2
    log = open(launch.worker_log_path(world_of_one, 0)).read()
    assert "Traceback" not in log and log.endswith(
        "meshlm: error: a data-loader process of this rank died (DataLoader worker (pid 12324) is killed by "
        "signal: Killed): the kernel's out-of-memory killer is a common cause (dmesg names it); give fewer "
        "--num-workers (0 reads in the training process) and restart with --load to resume from the last "
        "checkpoint\n")

    def elastic_launch(launch_cfg, entry):
        def run(*argv):
            with open(launch.worker_log_path(world_of_one, 1), "a") as fh:
                fh.write("meshlm: error: data-loader died\n")
            with open(launch.worker_log_path(world_of_one, 0), "a") as fh:
                fh.write("meshlm: error: lost a peer in all_reduce of DP gradient bucket 0 over …\n")
            failures = {0: ProcessFailure(0, 1, 2, ""), 1: ProcessFailure(1, 2, 2, "")}
            for failure in failures.values():  # seen at the same poll of the agent
                failure.timestamp = 5
            raise ChildFailedError("meshlm", failures)
        return run
    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    with pytest.raises(MeshlmError, match="^rank 1: data-loader died$"):
        launch.launch_local(world_of_one, "config.yaml", 2, worker_main)


def test_ctrl_c_is_reported_once_by_the_launcher_not_by_every_worker(monkeypatch, capsys):
    """Ctrl-C: the agent passes SIGINT on to each worker, and each printed "meshlm: interrupted"
    above the launcher's "meshlm: interrupted (SIGINT); workers stopped"."""
    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(launch, "run_worker", interrupted)
    monkeypatch.setenv(launch.WORKER_ENV, "1")
    assert main(["pretrain", *TINY, "--train-iters", "1"]) == 130
    monkeypatch.delenv(launch.WORKER_ENV)
    monkeypatch.setattr(launch, "resolve_on_rank0", lambda resolve, own: own)
    monkeypatch.setenv("RANK", "0")  # a torchrun rank: no launcher of meshlm's to say it
    assert main(["pretrain", *TINY, "--train-iters", "1"]) == 130
    assert capsys.readouterr().err == "meshlm: interrupted\n"


class _FullDiskFile:
    """A log file on a full disk: opens, refuses every write (once closed, as a closed file does)."""
    name, closed = "full/rank0.log", False

    def write(self, text):
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        raise OSError(28, "No space left on device")

    flush = write

    def close(self):
        self.closed = True


def test_a_worker_whose_log_is_on_a_full_disk_trains_on_and_its_error_reaches_the_console(
        world_of_one, monkeypatch, capfd):
    """The log's OSError used to end the worker in a cascade of tracebacks, its error line lost."""
    def pretrain(cfg):
        print("step 1 done")
        print("step 2 done")
        raise DataError("--data-path x: truncated index")
    fake_trainer(monkeypatch, pretrain)
    monkeypatch.setattr(launch, "open", lambda *args, **kwargs: _FullDiskFile(), raising=False)
    assert launch.run_worker(world_of_one) == 2
    out, err = capfd.readouterr()
    assert "step 1 done\nstep 2 done\n" in out
    warnings = [line for line in (out + err).splitlines() if "warning" in line]
    assert warnings == ["meshlm: warning: full/rank0.log: No space left on device; the log file stops here "
                        "(the console keeps every line)"]
    assert err.strip().endswith("meshlm: error: --data-path x: truncated index")


def test_outside_a_launched_worker_errors_propagate(world_of_one, monkeypatch):
    monkeypatch.delenv(launch.WORKER_ENV)
    def pretrain(cfg):
        raise DataError("--data-path x: truncated index")
    fake_trainer(monkeypatch, pretrain)
    with pytest.raises(DataError):
        launch.run_worker(world_of_one)


def test_a_worker_knows_whether_its_launcher_lives_with_or_without_proc(monkeypatch):
    """A worker's parent is the launcher's forkserver: the launcher is its grandparent (/proc); where
    /proc cannot say (macOS) a probe of the pid stands in, so no worker there kills itself at start."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert launch._launcher_alive(os.getppid()) and not launch._launcher_alive(gone.pid)
    monkeypatch.setattr(launch, "_parent_of", lambda pid: 0)
    assert launch._launcher_alive(os.getpid()) and not launch._launcher_alive(gone.pid)


def test_the_agents_and_the_process_contexts_warnings_go_to_the_launcher_log(tmp_path, capfd):
    """torch.multiprocessing's "Terminating process N via signal SIGTERM" (the forked workers' process
    context stopping the others after one failed) reached the console beside the one error line."""
    import logging

    import torch.multiprocessing.spawn  # noqa: F401  (torch's loggers and their console handlers)
    log = tmp_path / "logs" / "launcher.log"
    with launch._agent_log(str(log)):
        logging.getLogger("torch.multiprocessing.spawn").warning("Terminating process 1 via signal SIGTERM")
        logging.getLogger("torch.distributed.elastic.agent.server.api").warning("Received 2 death signal")
    assert capfd.readouterr().err == ""
    text = log.read_text()
    assert "Terminating process 1 via signal SIGTERM" in text and "Received 2 death signal" in text


def test_threads_per_worker_share_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert launch.worker_threads(1) == cores
    assert launch.worker_threads(cores * 4) == 1


def test_workers_get_nvls_off_and_the_worker_marker(tmp_path, monkeypatch):
    # the environment the launcher hands to its workers, seen through a worker that prints it
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    seen = {}

    def fake_launch(config, entrypoint):
        def run(config_path, env):
            seen.update(os.environ)  # what the forkserver starts with
            seen.update(entry=entrypoint, start=config.start_method, config_path=config_path, env=env)
        return run
    import torch.distributed.launcher.api as api
    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    cfg = Config()
    cfg.logging.run_dir = str(tmp_path)
    assert launch.launch_local(cfg, "run/config.yaml", 2, worker_main) == 0
    for env in (seen, seen["env"]):
        assert env["NCCL_NVLS_ENABLE"] == "0" and env[launch.WORKER_ENV] == "1"
        assert int(env["OMP_NUM_THREADS"]) == launch.worker_threads(2)
        assert env[launch.LAUNCHER_PID_ENV] == str(os.getpid())
    assert (seen["entry"], seen["start"], seen["config_path"]) == (worker_main, "forkserver", "run/config.yaml")
    assert launch.WORKER_ENV not in os.environ  # restored in the launcher


def torchrun(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", "-m", "meshlm", *argv], cwd=cwd, env=clean_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_under_torchrun_rank0_resolves_one_run_for_all_ranks(tmp_path):
    out = torchrun("pretrain", *TINY, "--train-iters", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = os.listdir(tmp_path / "runs")  # one run directory, although every rank started alike
    assert out.stdout.count("meshlm: run directory") == 1
    assert sorted(os.listdir(tmp_path / "runs" / run / "logs")) == ["meshlm.lock", "metrics.jsonl", "rank0.log",
                                                                   "rank1.log"]


@pytest.mark.slow
def test_under_torchrun_a_config_error_is_printed_once(tmp_path):
    out = torchrun("pretrain", *TINY, "--global-batch-size", "7", cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("meshlm: error:") == 1 and "--global-batch-size 7" in out.stderr


def _last_logged_iteration(metrics: str) -> int:
    if not os.path.isfile(metrics):
        return 0
    records = [json.loads(line) for line in open(metrics) if line.strip()]
    return max((r["iteration"] for r in records if "lm_loss" in r or "loss" in r), default=0)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_the_workers_after_a_checkpoint_with_exit_0(tmp_path):
    """--exit-signal-handler: SIGTERM to `meshlm pretrain` reaches its workers (not their data-loader
    processes), which finish the iteration, save it and exit 0; so does the launcher."""
    proc = subprocess.Popen([sys.executable, "-m", "meshlm", "pretrain", *TINY, "--eval-interval", "100000",
                             "--train-iters", "100000", "--nproc-per-node", "2", "--run-dir", "run",
                             "--save", "ckpt", "--exit-signal-handler"],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = str(tmp_path / "run" / "logs" / "metrics.jsonl")
    deadline = time.monotonic() + 240
    while _last_logged_iteration(metrics) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    assert "meshlm: stopped on SIGTERM (--exit-signal-handler)" in out
    stopped = _last_logged_iteration(metrics)
    assert 2 <= stopped < 100000
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert f"exiting after iteration {stopped}: SIGTERM received" in out


def test_a_stop_signal_waits_for_a_starting_workers_handler_instead_of_killing_it(tmp_path):
    """SIGTERM about 2 s after "starting N workers" killed the workers still importing torch
    ("killed by signal 15", exit 1): the launcher now holds the signal until a worker handles it."""
    child = ("import signal, sys, time; time.sleep(1.0); got = []; "
             "signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); end = time.time() + 10\n"
             "while not got and time.time() < end: time.sleep(0.05)\n"
             "print('stopped' if got else 'never signalled'); sys.exit(0 if got else 3)")
    # a worker is a grandchild of the launcher (forked from its forkserver): a shell stands in between
    worker = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$CHILD"; exit $?'],
                              env=clean_env(CHILD=child, **{launch.WORKER_ENV: "1"}), stdout=subprocess.PIPE, text=True)
    with launch._forward_signal("SIGUSR1") as received:
        os.kill(os.getpid(), signal.SIGUSR1)  # the user's stop, while the worker has no handler yet
        out, _ = worker.communicate(timeout=60)
    assert received == [signal.SIGUSR1] and worker.returncode == 0 and out.strip() == "stopped"


def test_a_worker_the_stop_signal_killed_during_start_up_is_a_clean_stop(tmp_path, monkeypatch, capsys):
    """Sent to the whole process group, the signal can still kill a worker before its handler: that
    is reported as a stop before the first step (exit 0), not as a crash."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    def elastic_launch(launch_cfg, entry):
        def run(*argv):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the launcher's handler runs
            raise ChildFailedError("meshlm", {1: ProcessFailure(1, 123, -signal.SIGTERM, "")})
        return run
    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launch, "_worker_pids", lambda: [])
    cfg = Config()
    cfg.logging.run_dir, cfg.training.exit_signal_handler = str(tmp_path), True
    assert launch.launch_local(cfg, str(tmp_path / "config.yaml"), 2, worker_main) == 0
    out = capsys.readouterr().out
    assert "meshlm: stopped on SIGTERM (--exit-signal-handler) during start-up, before the first step: worker " \
           "rank(s) 1 got it before setting up the handler; nothing trained, nothing to save" in out


def test_a_worker_keeps_its_temporary_files_out_of_the_launchers_folder(monkeypatch, tmp_path):
    """The launcher's multiprocessing folder (/tmp/pymp-…, inherited by the forked workers) is removed
    when the launcher exits, while a worker's data-loader processes, whose batch-sharing sockets lived
    there, outlived it by seconds: a SIGTERM to `meshlm pretrain` (no handler) or a killed worker
    ended with a FileNotFoundError traceback from each of them on the console."""
    import multiprocessing
    import torch
    launcher_folder = str(tmp_path / "pymp-launcher")
    monkeypatch.setitem(multiprocessing.current_process()._config, "tempdir", launcher_folder)
    monkeypatch.setattr(os, "setsid", lambda: None)  # the test process stays in its session
    monkeypatch.setattr(os, "environ", dict(os.environ))
    launch.become_worker({"OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert multiprocessing.util.get_temp_dir() != launcher_folder


@pytest.mark.parametrize("args, shown", [
    (["--save", "my-ckpt"], "--save my-ckpt"), (["--train-iters", "3", "--load=ckpt"], "--load=ckpt"),
    (["--run-dir", "r"], "--run-dir r"), (["--exit-signal", "SIGUSR1"], "--exit-signal SIGUSR1")])
def test_the_slurm_script_refuses_the_flags_it_sets_itself(args, shown):
    """train.sbatch appends --save/--load/--run-dir and --exit-signal-handler to the user's flags, and the
    last of a flag wins: a user's --save was never written, and --exit-signal SIGUSR1 let the warning's
    SIGTERM kill the workers with nothing saved."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "slurm",
                          "train.sbatch")
    out = subprocess.run(["bash", script, *args], env=clean_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith(f"train.sbatch: error: {shown} is set by this script; ")
