"""The launcher's environment variables (torchrun's RANK/WORLD_SIZE/MASTER_*, Slurm's SLURM_*):
one that cannot describe a job is one line naming each variable before any rendezvous (no
traceback, no wait for ranks that never come), and a WORLD_SIZE left in a shell that is no job
does not size the workers `meshlm pretrain` starts itself."""

import pytest

from meshlm import launch
from meshlm.cli import main
from meshlm.config import Config, world_size_of
from meshlm.parallel.mesh import job_env_problem

JOB = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
TINY = ["pretrain", "--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1"]
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
            "SLURM_LOCALID", launch.WORKER_ENV)


@pytest.fixture
def env(monkeypatch):
    """Set the given launcher variables, every other one unset."""
    def set_env(**values):
        for name in LAUNCHER:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


@pytest.mark.parametrize("values,named", [
    (dict(RANK="0"), ["WORLD_SIZE is not set", "MASTER_ADDR is not set", "MASTER_PORT is not set"]),
    ({**JOB, "WORLD_SIZE": "x"}, ["WORLD_SIZE='x' is not an integer"]),
    ({**JOB, "RANK": "2"}, ["RANK=2 is outside 0..WORLD_SIZE-1 = 0..1"]),
    ({**JOB, "RANK": "-1"}, ["RANK=-1 is outside"]),
    ({**JOB, "WORLD_SIZE": "0"}, ["WORLD_SIZE=0 is below 1"]),
    ({**JOB, "MASTER_PORT": "abc"}, ["MASTER_PORT='abc' is not an integer"]),
    ({**JOB, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000 is not a port"]),
    ({**JOB, "LOCAL_RANK": "a"}, ["LOCAL_RANK='a' is not an integer"]),
    (dict(SLURM_PROCID="0"), ["SLURM_NTASKS is not set", "MASTER_ADDR is not set"]),
    (dict(SLURM_PROCID="3", SLURM_NTASKS="2", MASTER_ADDR="n0"), ["SLURM_PROCID=3 is outside"]),
])
def test_a_launcher_environment_that_is_no_job_is_named_variable_by_variable(values, named):
    problem = job_env_problem(values)
    assert problem and "\n" not in problem
    for text in named:
        assert text in problem
    assert ("torchrun" in problem) and ("unset RANK" in problem or "srun" in problem)


def test_no_launcher_and_a_whole_job_are_no_problem():
    assert job_env_problem({}) is None and job_env_problem({"WORLD_SIZE": "4"}) is None
    assert job_env_problem(JOB) is None
    assert job_env_problem(dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", MASTER_ADDR="n0")) is None


@pytest.mark.parametrize("values", [dict(RANK="0"), {**JOB, "RANK": "3", "WORLD_SIZE": "1"},
                                    {**JOB, "WORLD_SIZE": "x"}, dict(SLURM_PROCID="0")])
def test_pretrain_refuses_it_in_one_line_before_joining(env, values, tmp_path, capsys):
    env(**values)
    assert main([*TINY, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshlm: error: the environment does not describe") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_stray_world_size_does_not_size_a_self_launched_run(env):
    env(WORLD_SIZE="3")
    cfg = Config()
    cfg.parallel.nproc_per_node = 1
    assert world_size_of(cfg) == 1
    env(WORLD_SIZE="3", RANK="0")
    assert world_size_of(cfg) == 3
    env(SLURM_NTASKS="2", SLURM_PROCID="0")
    assert world_size_of(cfg) == 2


def test_checkpoint_verify_inside_an_srun_step_loads_in_a_world_of_one(env):
    """An interactive `srun --pty bash` shell has SLURM_PROCID set: verify's one-process load took
    the srun path (and asked for the MASTER_ADDR it had just removed)."""
    import os

    import torch.distributed as dist

    from meshlm.inspect_checkpoint import _world_of_one
    env(SLURM_PROCID="0", SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1")
    with _world_of_one():
        assert dist.get_world_size() == 1
    assert not dist.is_initialized() and os.environ["SLURM_PROCID"] == "0"


def test_a_rank_whose_peers_do_not_join_says_so_and_its_timeout_is_one_line(env, monkeypatch, capsys):
    """RANK=0 WORLD_SIZE=2 with the other rank never started (or given another MASTER_ADDR) waited the
    whole --distributed-timeout-minutes in silence, then ended in torch's DistStoreError traceback."""
    import time

    import torch.distributed as dist
    from meshlm.errors import ConfigError
    from meshlm.parallel import mesh

    env(**JOB)
    monkeypatch.setenv("MESHLM_DISTRIBUTED_TIMEOUT_S", "1")  # the note after a tenth of it

    def never_joined(**kwargs):
        time.sleep(0.5)
        raise dist.DistStoreError("Timed out after 61 seconds waiting for clients. 1/2 clients joined.")
    monkeypatch.setattr(dist, "init_process_group", never_joined)
    with pytest.raises(ConfigError) as refused:
        mesh.init_distributed(1)
    assert str(refused.value) == (
        "the job's other ranks (WORLD_SIZE 2) did not all join at MASTER_ADDR:MASTER_PORT 127.0.0.1:29500 within "
        "the --distributed-timeout-minutes (Timed out after 61 seconds waiting for clients. 1/2 clients joined.); "
        "start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, MASTER_ADDR reachable from every "
        "node")
    assert capsys.readouterr().err == (
        "meshlm: rank 0 of WORLD_SIZE 2: waiting for the job's other ranks to join at MASTER_ADDR:MASTER_PORT "
        "127.0.0.1:29500 (it gives up after 2 minutes: --distributed-timeout-minutes)\n")


@pytest.mark.parametrize("values", [{**JOB, "WORLD_SIZE": "1"}, dict(SLURM_PROCID="0", SLURM_NTASKS="2")])
def test_a_nproc_per_node_beyond_a_launched_jobs_world_is_refused(env, values):
    """RANK=0 WORLD_SIZE=1 (or an srun task) with --nproc-per-node 4 trained in one process, the flag
    dropped in silence (only torchrun's LOCAL_WORLD_SIZE was compared with it)."""
    from meshlm.errors import ConfigError
    from meshlm.validate import validate
    env(**values)
    cfg = Config()
    cfg.data.mock_data, cfg.model.vocab_size, cfg.parallel.nproc_per_node = True, 64, 4
    with pytest.raises(ConfigError, match=r"--nproc-per-node 4 is meshlm's own launcher's, but this process is a "
                                          r"rank of a job of \d processes its launcher started"):
        validate(cfg, world_size_of(cfg), check_files=False)
    validate(cfg, 16, check_files=False)  # a dry run's size (--nnodes 4): checked in any shell
    env()  # no launcher: meshlm's own --nproc-per-node
    validate(cfg, world_size_of(cfg), check_files=False)
