"""A real single-host Slurm cluster for tests: munged, slurmctld and slurmd (Debian's packages
slurmctld, slurmd, slurm-client, munge) started in the foreground from a temporary folder, with a
slurm.conf of one node and one partition, no cgroups, no accounting.

:func:`start` returns a :class:`Cluster` or raises :class:`SlurmUnavailable` saying exactly why
it could not (a program missing, not root, a daemon that exited or never reported the node idle,
with the end of its log, or a trivial job that failed). :meth:`Cluster.stop` ends the three daemons it started, by their pids.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional

from distributed import _free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"
START_S = 30.0


class SlurmUnavailable(Exception):
    """Why a real Slurm could not be started here (one line, or one line and a log's end)."""


def tail(path: str, lines: int = 8) -> str:
    """The last ``lines`` lines of a log file (or a note that it was not written)."""
    if not os.path.isfile(path):
        return f"({path} was not written)"
    return "\n".join(open(path, errors="replace").read().splitlines()[-lines:])


CRED_EXPIRE_S = 15


def slurm_conf(folder: str, host: str, cpus: int) -> str:
    """slurm.conf for one node ``host`` (``cpus`` CPUs, reached at 127.0.0.1) in a partition
    "debug"; daemons as root, state, spool, pid and log files in ``folder``, ports picked free."""
    f = folder
    return "\n".join([
        "ClusterName=meshlmtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root",
        # cred_expire: how long a requeued job waits before it may start again (default 120 s);
        # sooner, slurmd still holds the first attempt's revoked credential and kills the start
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={f}/munge.sock,cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={f}/state", f"SlurmdSpoolDir={f}/spool",
        f"SlurmctldPidFile={f}/slurmctld.pid", f"SlurmdPidFile={f}/slurmd.pid",
        f"SlurmctldLogFile={f}/slurmctld.log", f"SlurmdLogFile={f}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",  # no cgroups
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2", "JobRequeue=1", "MinJobAge=600",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ""])


class Cluster:
    """The running daemons; ``env`` is what a client command needs (SLURM_CONF)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.conf = os.path.join(folder, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.daemons: dict = {}

    def _daemon(self, name: str, *argv: str) -> None:
        with open(os.path.join(self.folder, f"{name}.out"), "w") as log:
            self.daemons[name] = subprocess.Popen([name, *argv], stdout=log, stderr=subprocess.STDOUT,
                                                  env=self.env, cwd=self.folder)

    def run(self, *argv: str) -> str:
        """A client command's stdout (CalledProcessError on failure)."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=True).stdout

    def version(self) -> str:
        return self.run("sinfo", "--version").strip()

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, …) of one job."""
        fields = self.run("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def node_state(self) -> str:
        """sinfo's short state of the one node: "idle", "alloc", "comp" (a job's processes still
        being cleaned up), …"""
        return self.run("sinfo", "-h", "-o", "%t").strip()

    def stop(self) -> None:
        """End the daemons this cluster started (SIGTERM, then SIGKILL after 10 s)."""
        for proc in reversed(list(self.daemons.values())):
            proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _why_down(self) -> Optional[str]:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                return (f"{name} exited with status {proc.returncode}; the end of its log:\n"
                        f"{tail(os.path.join(self.folder, name + '.log'))}\n"
                        f"{tail(os.path.join(self.folder, name + '.out'))}")
        return None


def start(cpus: int = 2) -> Cluster:
    """Start munged, slurmctld and slurmd for one node of ``cpus`` CPUs named after this host."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed (Debian: apt-get install {PACKAGES})")
    if os.geteuid() != 0:
        raise SlurmUnavailable("not root: the test's slurmd must run as root (SlurmdUser=root) to start jobs")
    # munged wants every folder above its socket searchable by all: not pytest's 0700 tmp folders
    folder = tempfile.mkdtemp(prefix="meshlm-slurm-", dir="/tmp")
    os.chmod(folder, 0o755)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(folder, sub))
    with open(os.path.join(folder, "munge.key"), "wb") as key:
        key.write(os.urandom(1024))
    os.chmod(os.path.join(folder, "munge.key"), 0o600)
    host = socket.gethostname().split(".")[0]
    cluster = Cluster(folder)
    with open(cluster.conf, "w") as conf:
        conf.write(slurm_conf(folder, host, cpus))
    try:
        cluster._daemon("munged", "-F", f"--key-file={folder}/munge.key", f"--socket={folder}/munge.sock",
                        f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                        f"--seed-file={folder}/munged.seed")
        cluster._daemon("slurmctld", "-D", "-c", "-f", cluster.conf)
        cluster._daemon("slurmd", "-D", "-f", cluster.conf, "-N", host)
        _wait_until_idle(cluster)
        _run_a_trivial_job(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_until_idle(cluster: Cluster) -> None:
    deadline, state = time.monotonic() + START_S, ""
    while time.monotonic() < deadline:
        down = cluster._why_down()
        if down:
            raise SlurmUnavailable(down)
        try:
            state = cluster.node_state()
        except subprocess.CalledProcessError as e:
            state = e.stderr.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise SlurmUnavailable(f"the node was not idle {START_S:.0f} s after the daemons started (sinfo: {state!r}); "
                           f"slurmd's log ends:\n{tail(os.path.join(cluster.folder, 'slurmd.log'))}")


def _run_a_trivial_job(cluster: Cluster) -> None:
    """Slurm that starts but cannot run a job here (slurmstepd refused by the container) is no
    cluster for the test either: say so instead of failing the sbatch script's test."""
    try:
        out = subprocess.run(["srun", "--nodes=1", "--ntasks=1", "true"], env=cluster.env, capture_output=True,
                             text=True, timeout=START_S)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"`srun true` did not end within {START_S:.0f} s; slurmd's log ends:\n"
                               f"{tail(os.path.join(cluster.folder, 'slurmd.log'))}") from None
    if out.returncode != 0:
        raise SlurmUnavailable(f"`srun true` failed (status {out.returncode}): {out.stderr.strip()}")
