"""examples/slurm/train.sbatch under a real single-host Slurm: a job of 2 CPU workers (one torchrun,
gloo) gets the pre-emption warning (SIGTERM to the batch shell, as --signal=B:TERM@120 sends it),
saves, requeues itself and, in its second attempt, resumes from the checkpoint and ends with the
losses of an uninterrupted run.

Where Slurm cannot be started (tests/slurm_cluster.py says why; a warning names the path that
ran), the same script runs with srun's environment simulated: SLURM_* variables set and srun,
scancel and scontrol replaced by the shims in tests/slurm_shims. MESHLM_SLURM=simulated runs the
simulated path even where Slurm starts. The uninterrupted reference run is the same script under
the shims, so they are exercised everywhere.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

import slurm_cluster
from distributed import _free_port
from test_launch import TINY, clean_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "examples", "slurm", "train.sbatch")
SHIMS = os.path.join(HERE, "slurm_shims")
ITERS, STOP_AT, GLOBAL_BATCH = 6, 3, 4
FLAGS = [*TINY, "--eval-interval", "100000", "--train-iters", str(ITERS), "--global-batch-size",
         str(GLOBAL_BATCH), "--save-interval", "2", "--num-workers", "0"]
WAITING = f"waiting for the stop signal at iteration {STOP_AT}"
LINE = re.compile(r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*\| lm loss: (\S+) \|")
JOB_ID = "4242"  # the simulated job's
TIMEOUT_S = 180
pytestmark = pytest.mark.slow  # three launches of 2 workers (about 20 CPU-seconds each)


class SlurmPathWarning(UserWarning):
    """Names the path test_slurm took: real Slurm, or simulated (and why)."""


def _job_env(**extra) -> dict:
    """What both paths give the script: CPU mode with 2 workers, this Python and source tree; none
    of the SLURM_* variables of a job the tests themselves might run in."""
    path = os.pathsep.join(p for p in (os.path.join(REPO, "src"), HERE, os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:  # a host that cannot resolve its own name: rendezvous on the loopback address
        env["RDZV_HOST"] = "127.0.0.1"
    env.update(CPU_ONLY="1", NPROC_PER_NODE="2", OMP_NUM_THREADS="1", RDZV_PORT=str(_free_port()),
               PYTHON=sys.executable, PYTHONPATH=path, **extra)
    return env


def _simulated_env(folder, **extra) -> dict:
    """srun's batch environment for job JOB_ID on one node (this host), shims first on PATH."""
    shim_dir = folder / "shim"
    shim_dir.mkdir(exist_ok=True)
    env = _job_env(SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="meshlm", SLURM_JOB_NODELIST=socket.gethostname(),
                   SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_CPUS_ON_NODE="2",
                   SLURM_SUBMIT_DIR=str(folder), SLURM_SHIM_DIR=str(shim_dir), **extra)
    env["PATH"] = SHIMS + os.pathsep + env["PATH"]
    return env


def _wait_for(predicate, what: str, timeout: float = TIMEOUT_S, explain=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"{what} did not happen within {timeout:.0f} s\n{explain()}")


def _read(path) -> str:
    return open(path, errors="replace").read() if os.path.isfile(path) else ""


def _trajectory(run_dir) -> list:
    """(iteration, consumed samples, lm loss) of each iteration in metrics.jsonl."""
    records = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    return [(r["iteration"], r["consumed_samples"], r["lm_loss"]) for r in records if "lm_loss" in r]


def _printed(run_dir) -> tuple:
    """Iteration lines of rank 0's log (appended to by every attempt) before and after the second
    attempt's "loaded checkpoint" line."""
    before, _, after = _read(run_dir / "logs" / "rank0.log").partition("loaded checkpoint")
    return [m.groups() for m in LINE.finditer(before)], [m.groups() for m in LINE.finditer(after)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: the script under the shims, `-m meshlm` as torchrun's entry."""
    folder = tmp_path_factory.mktemp("whole")
    out = subprocess.run(["bash", SCRIPT, *FLAGS], cwd=folder, env=_simulated_env(folder),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "train.sbatch: training finished" in out.stdout
    run_dir = folder / "runs" / f"slurm-{JOB_ID}"
    trajectory = _trajectory(run_dir)
    assert [r[:2] for r in trajectory] == [(i, i * GLOBAL_BATCH) for i in range(1, ITERS + 1)]
    first, none = _printed(run_dir)
    assert none == [] and len(first) == ITERS
    return trajectory, first


@pytest.fixture(scope="module")
def slurm():
    """A started single-host Slurm, or the reason (a string) why there is none."""
    if os.environ.get("MESHLM_SLURM") == "simulated":
        reason = "MESHLM_SLURM=simulated"
        cluster = None
    else:
        try:
            cluster, reason = slurm_cluster.start(cpus=2), None
        except slurm_cluster.SlurmUnavailable as e:
            cluster, reason = None, str(e)
    if cluster is None:
        warnings.warn(SlurmPathWarning(f"test_slurm: real Slurm not started ({reason}); "
                                       "the sbatch script ran with srun's environment simulated"))
        yield reason
        return
    warnings.warn(SlurmPathWarning(f"test_slurm: the sbatch script ran under real Slurm ({cluster.version()})"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _assert_resumed_as_uninterrupted(run_dir, reference):
    trajectory, expected = reference
    assert _trajectory(run_dir) == trajectory  # exact: every loss, every consumed-samples count
    first, again = _printed(run_dir)
    assert first == expected[:STOP_AT]  # the first attempt stopped after STOP_AT …
    assert again == expected[STOP_AT:]  # … and the requeued one went on from its checkpoint
    checkpoint = os.path.join("runs", run_dir.name, "checkpoints", f"iter_{STOP_AT:07d}")
    assert f"loaded checkpoint {checkpoint} (iteration {STOP_AT})" in _read(run_dir / "logs" / "rank0.log")


def _second_attempt_ended(slurm, job: str) -> bool:
    """True once the requeued job has run to its end. Slurm starts it by itself after the
    credential lifetime (slurm_cluster.CRED_EXPIRE_S, EligibleTime); a start forced sooner
    (scontrol update StartTime=now) is killed: "Killing non-startable batch JobId=2: Job
    credential revoked" (seen on CI: FAILED, ExitCode 1:0, RunTime 0)."""
    state = slurm.job(job)
    return state.get("Restarts") == "1" and \
        state["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")


def test_real_slurm_job_saves_on_the_warning_requeues_and_resumes(slurm, reference, tmp_path):
    if isinstance(slurm, str):
        pytest.skip(f"real Slurm not started: {slurm}")
    out_file = tmp_path / "slurm.out"
    env = _job_env(TRAIN_SCRIPT=os.path.join(HERE, "slurm_stop_at.py"), STOP_AT=str(STOP_AT),
                   SLURM_CONF=slurm.conf)
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                          "--time=10", f"--output={out_file}", f"--chdir={tmp_path}", SCRIPT, *FLAGS],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    log = run_dir / "logs" / "rank0.log"

    def explain():
        ctld = slurm_cluster.tail(os.path.join(slurm.folder, "slurmctld.log"), 15)
        slurmd = slurm_cluster.tail(os.path.join(slurm.folder, "slurmd.log"), 15)
        return (f"job: {slurm.job(job)}\nslurmctld.log:\n{ctld}\nslurmd.log:\n{slurmd}\n"
                f"{out_file}:\n{_read(out_file)[-3000:]}")
    try:
        _wait_for(lambda: WAITING in _read(log), f"iteration {STOP_AT} of job {job}", explain=explain)
        slurm.run("scancel", "--signal=TERM", "--batch", job)  # what --signal=B:TERM@120 sends
        _wait_for(lambda: _second_attempt_ended(slurm, job), "the requeue and the second attempt",
                  timeout=TIMEOUT_S + slurm_cluster.CRED_EXPIRE_S, explain=explain)
    finally:
        if slurm.job(job)["JobState"] in ("PENDING", "RUNNING"):
            slurm.run("scancel", job)
    state = slurm.job(job)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), explain()
    text = _read(out_file)
    assert "requeueing job" in text and "train.sbatch: training finished" in text, text
    _assert_resumed_as_uninterrupted(run_dir, reference)


def test_simulated_srun_job_saves_on_the_warning_requeues_and_resumes(slurm, reference, tmp_path):
    if not isinstance(slurm, str):
        pytest.skip("real Slurm ran the script (MESHLM_SLURM=simulated runs this path too)")
    stop = dict(TRAIN_SCRIPT=os.path.join(HERE, "slurm_stop_at.py"), STOP_AT=str(STOP_AT))
    run_dir = tmp_path / "runs" / f"slurm-{JOB_ID}"
    first = subprocess.Popen(["bash", SCRIPT, *FLAGS], cwd=tmp_path, env=_simulated_env(tmp_path, **stop),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: WAITING in _read(run_dir / "logs" / "rank0.log") or first.poll() is not None,
                  f"iteration {STOP_AT}")
        first.send_signal(signal.SIGTERM)  # to the batch shell alone, as --signal=B:TERM@120
        output, _ = first.communicate(timeout=TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and "requeueing job" in output, output
    assert (tmp_path / "shim" / "requeued").read_text() == JOB_ID + "\n"
    again = subprocess.run(["bash", SCRIPT, *FLAGS], cwd=tmp_path, capture_output=True, text=True,
                           env=_simulated_env(tmp_path, SLURM_RESTART_COUNT="1", **stop), timeout=TIMEOUT_S)
    assert again.returncode == 0 and "train.sbatch: training finished" in again.stdout, again.stdout + again.stderr
    _assert_resumed_as_uninterrupted(run_dir, reference)


def test_real_slurm_job_runs_inside_the_container(slurm, reference, tmp_path):
    """train.sbatch with CONTAINER_IMAGE: the job's torchrun and workers run in the image that
    .ci/container builds from the Dockerfile (it runs this test, with MESHLM_CONTAINER_IMAGE and
    MESHLM_CONTAINER_RUNTIME set, after building); the losses are the uninterrupted run's."""
    image = os.environ.get("MESHLM_CONTAINER_IMAGE")
    if not image:
        pytest.skip("needs the image .ci/container builds (MESHLM_CONTAINER_IMAGE)")
    if isinstance(slurm, str):
        pytest.skip(f"real Slurm not started: {slurm}")
    out_file = tmp_path / "slurm.out"
    env = _job_env(SLURM_CONF=slurm.conf, CONTAINER_IMAGE=image,
                   CONTAINER_RUNTIME=os.environ.get("MESHLM_CONTAINER_RUNTIME", "podman"))
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                          "--time=10", f"--output={out_file}", f"--chdir={tmp_path}", SCRIPT, *FLAGS],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    _wait_for(lambda: slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
              f"job {job} in the container", explain=lambda: _read(out_file)[-3000:])
    state = slurm.job(job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), _read(out_file)[-3000:]
    assert "train.sbatch: training finished" in _read(out_file)
    assert _trajectory(tmp_path / "runs" / f"slurm-{job}") == reference[0]
