"""ParallelState: every process group of the job, built once from one rank grid.

Rank order (DESIGN.md, Megatron's default tp-cp-dp-pp):
``rank = ((pp_rank * DP + dp_rank) * CP + cp_rank) * TP + tp_rank`` — TP innermost so a TP group
stays inside one NVLink domain, PP outermost so pipeline stages cross nodes.

Nothing reads process groups from module globals: the one ParallelState is passed to whatever
communicates. ``ParallelState.single()`` is the world-size-1 state that single-process reference
runs use (every group of size 1, no collective issued).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError


def local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK (torchrun, and meshlm's own launcher), else
    SLURM_LOCALID (srun without torchrun), else 0. The node's leader (local rank 0) does
    the node's file-system duties: the trainer passes it to data/gpt_dataset.py's index cache."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _int(env, name: str):
    """``env[name]`` as an int, or None where it is not one."""
    try:
        return int(env[name])
    except ValueError:
        return None


def job_env_problem(env=os.environ) -> Optional[str]:
    """What keeps the environment from describing one rank of a launched job, as one line, or None.

    A torchrun rank (RANK set) needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, integers where
    they are numbers, with 0 <= RANK < WORLD_SIZE (a RANK at or beyond WORLD_SIZE waits for a job
    that never forms); an srun task without torchrun (SLURM_PROCID set, no RANK) needs SLURM_NTASKS
    above SLURM_PROCID and MASTER_ADDR. No launcher variable at all is a world of one (None)."""
    if "RANK" in env:
        names, fix = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), (
            "start the job with torchrun (it sets all of them), or unset RANK to let `meshlm pretrain` start "
            "its own workers")
        rank, world = "RANK", "WORLD_SIZE"
    elif "SLURM_PROCID" in env:
        names, fix = ("SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR"), (
            "start each task with srun (it sets SLURM_PROCID and SLURM_NTASKS) and export MASTER_ADDR (the first "
            "node's hostname), or run torchrun inside the allocation")
        rank, world = "SLURM_PROCID", "SLURM_NTASKS"
    else:
        return None
    problems = [f"{name} is not set" for name in names if name not in env]
    numbers = (rank, world, "LOCAL_RANK", "SLURM_LOCALID", "MASTER_PORT")
    problems += [f"{name}={env[name]!r} is not an integer" for name in numbers if name in env and _int(env, name) is None]
    r, w = (_int(env, rank) if rank in env else None), (_int(env, world) if world in env else None)
    if w is not None and w < 1:
        problems.append(f"{world}={w} is below 1")
    elif r is not None and w is not None and not 0 <= r < w:
        problems.append(f"{rank}={r} is outside 0..{world}-1 = 0..{w - 1}")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if port is not None and not 0 < port < 65536:
        problems.append(f"MASTER_PORT={port} is not a port (1..65535)")
    if not problems:
        return None
    return f"the environment does not describe one rank of a launched job: {', '.join(problems)}; {fix}"


def init_distributed(timeout_minutes: int = 10) -> None:
    """Join the job from the environment (torchrun's RANK/WORLD_SIZE/MASTER_ADDR, or Slurm's).

    NCCL when CUDA is available, else gloo. Sets the CUDA device to LOCAL_RANK.
    A process started outside any launcher becomes a world of one (gloo on a free local port).
    An incomplete launcher environment (:func:`job_env_problem`) raises ConfigError before joining.

    A collective that outlasts ``timeout_minutes`` ends the job: on NCCL through NCCL's own
    watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, set unless given: abort the communicators and the
    process); on gloo through meshlm's (parallel/watchdog.py, which names the missing ranks), so
    gloo's own timeout is set a minute later, never to pre-empt that report.
    """
    if dist.is_initialized():
        return
    env = os.environ
    problem = job_env_problem(env)
    if problem:
        raise ConfigError(problem)
    if "RANK" not in env and "SLURM_PROCID" in env:  # Slurm's srun without torchrun
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_PORT", "29500")
    if "RANK" not in env:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", 0)))
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    minutes = timeout_minutes + (0 if use_cuda else 1)
    with _join_note(env, timeout_minutes, minutes):
        try:
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=minutes))
        except dist.DistError as e:
            if "timed out" not in str(e).lower():
                raise
            raise ConfigError(f"the job's other ranks (WORLD_SIZE {env['WORLD_SIZE']}) did not all join at "
                              f"MASTER_ADDR:MASTER_PORT {env['MASTER_ADDR']}:{env['MASTER_PORT']} within "
                              f"the --distributed-timeout-minutes ({_first_line(e)}); start every rank with the same "
                              f"MASTER_ADDR, MASTER_PORT and WORLD_SIZE, MASTER_ADDR reachable from every node") \
                from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@contextlib.contextmanager
def _join_note(env, timeout_minutes: int, minutes: int):
    """While the block waits for the job's other ranks to join, one note on stderr after a tenth of
    the timeout (at most 30 s; a rank whose peers never start, or that has another MASTER_ADDR, waited
    the whole --distributed-timeout-minutes in silence)."""
    from .watchdog import timeout_seconds
    done = threading.Event()

    def note():
        if not done.wait(min(30.0, timeout_seconds(timeout_minutes) / 10)):
            print(f"meshlm: rank {env['RANK']} of WORLD_SIZE {env['WORLD_SIZE']}: waiting for the job's other ranks "
                  f"to join at MASTER_ADDR:MASTER_PORT {env['MASTER_ADDR']}:{env['MASTER_PORT']} (it gives up after "
                  f"{minutes} minutes: --distributed-timeout-minutes)", file=sys.stderr, flush=True)
    thread = threading.Thread(target=note, name="meshlm-join-note", daemon=True)
    if int(env["WORLD_SIZE"]) > 1:
        thread.start()
    try:
        yield
    finally:
        done.set()


@dataclass
class ParallelState:
    """Sizes, this rank's coordinates and the process groups of a TP × CP × DP × PP job.

    Groups (None when their size is 1 and no collective is ever needed):
      tp_group      ranks that split one layer's weights
      cp_group      ranks that split one sequence (context parallel)
      dp_group      ranks that hold the same model shard and average gradients
      dp_cp_group   dp × cp ranks: gradient reduction under context parallelism
      tp_cp_group   tp × cp ranks: those that split one micro-batch's tokens under SP and CP
                    (MoE routing counts; Megatron's tp_cp group); the tp or cp group itself
                    when the other size is 1
      pp_group      the stages of one pipeline
      mp_group      tp × pp ranks of one model replica (gradient-norm reduction)
      embedding_group  first and last stage of a pipeline (tied embeddings), None if PP == 1
      ep_group      ranks that split one MoE layer's routed experts (expert parallel): EP
                    consecutive dp × cp ranks of one (pp, tp) slice (Megatron's tp-cp-ep-dp-pp)
      edp_group     ranks that hold the same experts and average their gradients (expert data
                    parallel): the dp × cp / EP ranks of one (pp, tp) slice with this ep_rank
      shard_group / replica_group  hybrid sharding (--num-distributed-optimizer-instances N):
                    the dp × cp group cut into N replicas of consecutive ranks (a node each);
                    shard_group = this rank's replica, replica_group = the N ranks at its place
                    in every replica (None both unless N > 1; and each when its size is 1)
    pp_ranks: global ranks of this pipeline's stages in order (for p2p send/recv).
    """

    world_size: int = 1
    rank: int = 0
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: Optional[object] = None
    cp_group: Optional[object] = None
    dp_group: Optional[object] = None
    dp_cp_group: Optional[object] = None
    tp_cp_group: Optional[object] = None
    pp_group: Optional[object] = None
    mp_group: Optional[object] = None
    embedding_group: Optional[object] = None
    ep_group: Optional[object] = None
    edp_group: Optional[object] = None
    instances: int = 1
    shard_group: Optional[object] = None
    replica_group: Optional[object] = None
    pp_ranks: tuple = (0,)
    tp_ranks: tuple = (0,)
    dp_ranks: tuple = (0,)

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelState":
        """World of one: every size 1, no groups. For single-process reference runs."""
        return cls(device=device or torch.device("cpu"))

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, instances: int = 1) -> "ParallelState":
        """Create every group. Collective: all ranks must call it with the same sizes.
        instances: replicas of hybrid sharding (the shard and replica groups), 1 for none.

        Raises ConfigError if the world size is not divisible by TP × CP × PP, or DP × CP by EP.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (tp * cp * pp):
            raise ConfigError(f"world size {world} is not divisible by TP×CP×PP = {tp}×{cp}×{pp}")
        dp = world // (tp * cp * pp)
        if (dp * cp) % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide DP × CP = {dp * cp}")
        grid = torch.arange(world).view(pp, dp, cp, tp)  # rank = ((pp*DP + dp)*CP + cp)*TP + tp
        pp_r, dp_r, cp_r, tp_r = [int(i) for i in (grid == rank).nonzero()[0]]

        def groups(ranks_list):
            """new_group for each list (every rank calls for all, in order); return this rank's."""
            mine = None
            for ranks in ranks_list:
                ranks = [int(r) for r in ranks]
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = (g, tuple(ranks))
            return mine

        tp_g, tp_ranks = groups(grid.reshape(-1, tp))
        cp_g, _ = groups(grid.permute(0, 1, 3, 2).reshape(-1, cp))
        dp_g, dp_ranks = groups(grid.permute(0, 2, 3, 1).reshape(-1, dp))
        dpcp_g, _ = groups(grid.permute(0, 3, 1, 2).reshape(-1, dp * cp))
        tpcp_g = groups(grid.reshape(-1, cp * tp))[0] if tp > 1 and cp > 1 else (tp_g if cp == 1 else cp_g)
        pp_g, pp_ranks = groups(grid.permute(1, 2, 3, 0).reshape(-1, pp))
        mp_g, _ = groups(grid.permute(1, 2, 0, 3).reshape(-1, pp * tp))
        emb = groups([[r[0], r[-1]] if pp > 1 else [r[0]] for r in grid.permute(1, 2, 3, 0).reshape(-1, pp)])
        slices = grid.permute(0, 3, 1, 2).reshape(pp, tp, dp * cp // ep, ep)  # [pp, tp, edp, ep]
        ep_g, ep_ranks = groups(slices.reshape(-1, ep))
        edp_g, _ = groups(slices.permute(0, 1, 3, 2).reshape(-1, dp * cp // ep))
        emb_g = emb[0] if emb is not None else None  # middle stages belong to no embedding group
        shard_g = replica_g = None
        if instances > 1:  # [pp, tp, replica, place in replica] over the dp × cp ranks
            hybrid = grid.permute(0, 3, 1, 2).reshape(pp, tp, instances, dp * cp // instances)
            shard_g = groups(hybrid.reshape(-1, dp * cp // instances))[0]
            replica_g = groups(hybrid.permute(0, 1, 3, 2).reshape(-1, instances))[0]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        return cls(world_size=world, rank=rank, tp=tp, cp=cp, dp=dp, pp=pp, tp_rank=tp_r, cp_rank=cp_r,
                   dp_rank=dp_r, pp_rank=pp_r, device=device, tp_group=tp_g, cp_group=cp_g,
                   dp_group=dp_g, dp_cp_group=dpcp_g, tp_cp_group=tpcp_g, pp_group=pp_g, mp_group=mp_g,
                   embedding_group=emb_g, ep=ep, ep_rank=ep_ranks.index(rank), ep_group=ep_g,
                   edp_group=edp_g, pp_ranks=pp_ranks, tp_ranks=tp_ranks, dp_ranks=dp_ranks,
                   instances=instances, shard_group=shard_g, replica_group=replica_g)

    # ------------------------------------------------------------------ pipeline helpers
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage, None on the first."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage, None on the last."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints log lines: last pipeline stage, first TP/CP/DP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0

    def describe(self) -> str:
        ep = f" EP={self.ep}" if self.ep > 1 else ""
        return (f"world={self.world_size} TP={self.tp} CP={self.cp} DP={self.dp} PP={self.pp}{ep} "
                f"(rank {self.rank}: tp={self.tp_rank} cp={self.cp_rank} dp={self.dp_rank} pp={self.pp_rank})")
