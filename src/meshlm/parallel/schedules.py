"""Pipeline schedules as data: each schedule is the ordered instruction list of one pipeline rank.

A schedule never touches a tensor. ``build_schedule(name, pp, rank, num_microbatches, v)`` returns
a list whose items are either a compute ``Action`` (``F``/``B`` of one micro-batch on one local
model chunk) or a ``P2P`` step: a tuple of sends/receives that the executor posts together as one
batch (``torch.distributed.batch_isend_irecv``) and waits for. It can be printed
(``format_schedule``), checked for deadlocks and mismatched messages without any process
(``simulate``), and run by ``meshlm.parallel.pipeline.forward_backward``.

Model stages: with PP ranks and v chunks per rank, local chunk c of rank r is model stage
``s = c·PP + r`` (Megatron's interleaved placement, Narayanan et al. 2021 §2.2); stage 0 holds the
embedding, stage PP·v − 1 the output layer and loss. Activations go from stage s to s + 1
(rank r → r + 1, wrapping from the last rank to rank 0 with the chunk index + 1) and their
gradients back.

Communication is derived from the compute order in one rule, Megatron's pairing: before each
compute action, one batch holds the send of what the previous action produced (its output, or
its input gradient) together with the receive that this action needs (``send_forward_recv_backward``
and friends in Megatron's ``p2p_communication.py``). ``simulate`` proves the rule deadlock-free
for every schedule here under NCCL's rules (in-order matching per rank pair, tags ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional

from ..errors import ConfigError

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One instruction. kind: F, B (compute) or SEND_F, RECV_F, SEND_B, RECV_B (p2p).

    mb: micro-batch index; chunk: local model chunk index on this rank (0 ≤ chunk < v). For p2p
    kinds, chunk is the local chunk that produced (SEND) or will consume (RECV) the tensor.
    """

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class P2P(NamedTuple):
    """Sends and receives posted together as one batch; the step ends when all have completed."""

    ops: tuple

    def __str__(self) -> str:
        return "[" + " ".join(str(op) for op in self.ops) + "]"


def resolve_schedule(name: str, pp: int, v: int) -> str:
    """``--pipeline-schedule auto`` → none when PP = 1, interleaved when v > 1, else 1f1b."""
    if name != "auto":
        return name
    if pp == 1:
        return "none"
    return "interleaved" if v > 1 else "1f1b"


def interleaved_order(num_microbatches: int, v: int, group: int) -> list:
    """Forward order [(mb, chunk)] of the interleaved schedule (Megatron ``get_schedule_table``).

    Micro-batches run in groups of ``group`` (Megatron's microbatch_group_size_per_vp_stage, here
    PP): chunk 0 of the whole group, then chunk 1, …; the last group takes whatever is left.
    """
    order = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        order += [(mb, c) for c in range(v) for mb in range(lo, hi)]
    return order


def compute_order(name: str, pp: int, rank: int, num_microbatches: int, v: int = 1,
                  forward_only: bool = False) -> list:
    """The F/B actions of one rank in execution order, as groups that run between P2P steps.

    Returns a list of tuples of Actions; one P2P step precedes each group. Schedules:
    - none: F0 B0 F1 B1 … (plain gradient accumulation, PP = 1)
    - gpipe: all forwards, then all backwards (Huang et al. 2019)
    - 1f1b: warm-up of PP − rank − 1 forwards, then one forward / one backward, then cool-down
      backwards (PipeDream-Flush; Narayanan et al. 2021 §2.2.1)
    - interleaved: v chunks per rank; warm-up 2(PP − rank − 1) + (v − 1)·PP forwards capped at
      m·v, backwards visit chunks in reverse (Narayanan et al. 2021 §2.2.2; Megatron
      ``get_pp_rank_microbatches``). In steady state each (F, B) pair is one group: one batch
      sends both results and receives both inputs, as Megatron's
      ``send_forward_backward_recv_forward_backward``; one step per action would deadlock.
    """
    m = num_microbatches
    if name == "interleaved":
        fwd = interleaved_order(m, v, pp)
        bwd = [(mb, v - 1 - c) for mb, c in fwd]
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)
    else:
        fwd = [(mb, 0) for mb in range(m)]
        bwd = list(fwd)
        warmup = {"none": 0, "gpipe": m, "1f1b": min(pp - rank - 1, m)}[name]
    if forward_only:
        return [(Action("F", mb, c),) for mb, c in fwd]
    groups = [(Action("F", mb, c),) for mb, c in fwd[:warmup]]
    for i in range(len(fwd) - warmup):
        pair = (Action("F", *fwd[warmup + i]), Action("B", *bwd[i]))
        groups += [pair] if name == "interleaved" else [pair[:1], pair[1:]]
    groups += [(Action("B", mb, c),) for mb, c in bwd[len(fwd) - warmup:]]
    return groups


def add_p2p(groups: Iterable[tuple], pp: int, rank: int, v: int) -> list:
    """Flatten groups into steps, with one P2P step before each group: it sends the results of the
    previous group (activations of its forwards, input gradients of its backwards) and receives
    the inputs of this group (activation for an F on a non-first stage, output gradient for a B
    on a non-last stage). A final step sends the last results."""
    last_stage = pp * v - 1
    steps, pending = [], []
    for group in groups:
        ops = list(pending)
        for a in group:
            stage = a.chunk * pp + rank
            if a.kind == "F" and stage > 0:
                ops.append(Action("RECV_F", a.mb, a.chunk))
            if a.kind == "B" and stage < last_stage:
                ops.append(Action("RECV_B", a.mb, a.chunk))
        if ops:
            steps.append(P2P(tuple(ops)))
        steps += group
        pending = []
        for a in group:
            stage = a.chunk * pp + rank
            if a.kind == "F" and stage < last_stage:
                pending.append(Action("SEND_F", a.mb, a.chunk))
            if a.kind == "B" and stage > 0:
                pending.append(Action("SEND_B", a.mb, a.chunk))
    if pending:
        steps.append(P2P(tuple(pending)))
    return steps


def build_schedule(name: str, pp: int, rank: int, num_microbatches: int, v: int = 1,
                   forward_only: bool = False) -> list:
    """The full instruction list (compute and P2P steps) of pipeline rank ``rank``.

    Raises ConfigError for a schedule that cannot run this layout (checked up front by
    ``meshlm.parallel.pipeline.validate_pipeline``).
    """
    problem = schedule_problem(name, pp, v, num_microbatches)
    if problem:
        raise ConfigError(problem)
    order = compute_order(name, pp, rank, num_microbatches, v, forward_only)
    return add_p2p(order, pp, rank, v)


def schedule_problem(name: str, pp: int, v: int, num_microbatches: Optional[int]) -> str:
    """Why schedule ``name`` cannot run PP × v with this many micro-batches ("" if it can; None: any
    number, checked elsewhere)."""
    if name not in SCHEDULES:
        return f"--pipeline-schedule {name!r} is not one of auto, {', '.join(SCHEDULES)}"
    if name == "none" and pp > 1:
        return f"--pipeline-schedule none needs --pipeline-model-parallel-size 1, got {pp}; use 1f1b"
    if name != "interleaved" and v > 1:
        return (f"--pipeline-schedule {name} runs one model chunk per rank; with "
                f"--virtual-pipeline-model-parallel-size {v} use interleaved")
    if name == "interleaved" and v == 1:
        return "--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size > 1"
    if name == "interleaved" and num_microbatches is not None and num_microbatches % pp:
        return (f"interleaved 1F1B needs the number of micro-batches ({num_microbatches}) to be a "
                f"multiple of --pipeline-model-parallel-size {pp}; change --global-batch-size")
    return ""


def format_schedule(steps: list) -> str:
    """One line: ``F0 [SEND_F0 RECV_B0] B0 …`` (chunk shown as F3.1 when not 0)."""
    return " ".join(str(s) for s in steps)


@dataclass
class SimResult:
    """Outcome of ``simulate``: per-rank finish time (unit-time compute, free communication)
    and the peak number of micro-batches each rank holds between its F and its B."""

    makespan: float
    finish: list
    peak_in_flight: list


def simulate(schedules: list, pp: int, v: int, f_time: float = 1.0, b_time: float = 1.0, *,
             duration: Optional[Callable[[int, Action], float]] = None, p2p_time: float = 0.0,
             timeline: Optional[list] = None) -> SimResult:
    """Run every rank's schedule against the others under NCCL's rules; raise on a deadlock.

    Messages between a pair of ranks are matched in posting order, regardless of kind (NCCL
    ignores tags), and each matched pair must name the same tensor (same micro-batch and model
    stage), else AssertionError. A P2P step completes once all its ops are matched, ``p2p_time``
    after the later of the two posts. F and B take ``f_time``/``b_time`` per chunk, or
    ``duration(rank, action)`` when given. timeline, if a list, receives one event per F/B in
    the form pipeline.forward_backward logs, tagged with the rank: {"stage", "chunk", "mb",
    "kind", "start", "end"}.
    """
    n = len(schedules)
    pos = [0] * n
    clock = [0.0] * n
    posted = [False] * n
    channels: dict = {}  # (src, dst) → {"send": [...], "recv": [...]} of (message id, post time)
    matched: dict = {}  # (rank, step index, op index) → ready time
    live = [0] * n
    peak = [0] * n

    def peer_and_msg(rank, op):
        stage = op.chunk * pp + rank
        if op.kind in ("SEND_F", "RECV_B"):
            other = stage + 1
        else:
            other = stage - 1
        peer = other % pp
        src_stage = stage if op.kind in ("SEND_F", "SEND_B") else other
        kind = "act" if op.kind in ("SEND_F", "RECV_F") else "grad"
        return peer, (kind, op.mb, src_stage)

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pos[r] < len(schedules[r]):
                step = schedules[r][pos[r]]
                if isinstance(step, Action):
                    start = clock[r]
                    clock[r] += duration(r, step) if duration else f_time if step.kind == "F" else b_time
                    if timeline is not None:
                        timeline.append({"stage": r, "chunk": step.chunk, "mb": step.mb, "kind": step.kind,
                                         "start": start, "end": clock[r]})
                    live[r] += 1 if step.kind == "F" else -1
                    peak[r] = max(peak[r], live[r])
                    pos[r] += 1
                    progress = True
                    continue
                if not posted[r]:
                    for i, op in enumerate(step.ops):
                        peer, msg = peer_and_msg(r, op)
                        sending = op.kind.startswith("SEND")
                        key = (r, peer) if sending else (peer, r)
                        ch = channels.setdefault(key, {"send": [], "recv": []})
                        ch["send" if sending else "recv"].append((msg, clock[r], (r, pos[r], i)))
                        _match(ch, matched, p2p_time)
                    posted[r] = True
                    progress = True
                done = [matched.get((r, pos[r], i)) for i in range(len(step.ops))]
                if any(t is None for t in done):
                    break
                clock[r] = max([clock[r]] + done)
                posted[r] = False
                pos[r] += 1
                progress = True
    stuck = [r for r in range(n) if pos[r] < len(schedules[r])]
    if stuck:
        where = {r: str(schedules[r][pos[r]]) for r in stuck}
        raise AssertionError(f"pipeline deadlock: ranks waiting at {where}")
    return SimResult(makespan=max(clock), finish=clock, peak_in_flight=peak)


def _match(ch: dict, matched: dict, p2p_time: float = 0.0) -> None:
    """Pair the oldest unmatched send with the oldest unmatched receive of one channel; both are
    done ``p2p_time`` after the later post."""
    while ch["send"] and ch["recv"]:
        (smsg, st, sid), (rmsg, rt, rid) = ch["send"].pop(0), ch["recv"].pop(0)
        assert smsg == rmsg, f"p2p mismatch: sent {smsg}, receiver expected {rmsg}"
        ready = max(st, rt) + p2p_time
        matched[sid] = ready
        matched[rid] = ready


def analytic_bubble_fraction(pp: int, num_microbatches: int, v: int = 1) -> float:
    """Idle share of a step's wall time for 1F1B/GPipe with equal-cost stages.

    Narayanan et al. 2021 §2.2: bubble time = (p − 1)(t_f + t_b) / v against ideal compute
    m(t_f + t_b), i.e. (p − 1)/(v·m) of the compute, and (p − 1)/(v·m + p − 1) of the wall time
    (returned here, comparable with ``pipeline.bubble_fraction``).
    """
    return (pp - 1) / (v * num_microbatches + pp - 1)
