"""Hang detection: every rank records the collective it is in; a thread ends the job when one
lasts longer than --distributed-timeout-minutes, naming the collective, its group and the ranks
that did not arrive.

gloo has no watchdog of its own that says *who* is missing (its timeout raises a bare "timed out"
on whichever rank notices), so meshlm keeps its own, on every backend:

* **Position** (the hot path, no communication): ``enter(name, group)`` before a blocking
  collective and ``leave()`` after it store a tuple (name, group, n, start) in a module slot, where
  n counts the collectives this rank has entered on that group (every rank of a group enters its
  collectives in the same order, so equal n means the same call). About 0.3 µs per collective
  (README "Faults"). ``waited_s()`` sums the seconds spent inside them (stragglers.py reads it).
* **Publishing** (a daemon thread, every ``poll_s`` ≤ 5 s): the position, the per-group counts,
  the iteration and phase go to this rank's key ``meshlm/watch/<rank>`` in the job's c10d store
  (the TCPStore of init_process_group), as JSON.
* **Verdict**: when the current collective has lasted longer than the timeout, the thread reads
  the other ranks of the group (or the p2p peers) from the store and names each by its own state:
  a rank whose count on that group is below n did not arrive (described by its own position: in a
  collective of another group, or busy outside collectives since when; a rank whose key has not
  changed for several polls is "not answering"); a rank that reached call n there but sits in
  another op or call is "in another collective" (the ranks called different collectives), one in
  none "already returned from it"; only
  when every other rank is inside the same one is it called a transport or pairing fault. The
  first rank to reach a verdict (an atomic ``add`` on the store) writes one
  ``meshlm: error: hang: …`` line to stderr (and its log; in a worker ``meshlm pretrain`` started, to
  its log alone, and the launcher prints it) and leaves with exit status 1; the other
  waiting ranks say they saw the same and leave 2 s later, so the launcher reports the first.
* **Heartbeat** (--heartbeat-interval seconds, 0 off): the same thread appends one line to this
  rank's log every interval: the iteration, the seconds since the last step ended, what it is doing.

On CUDA, NCCL collectives return at once and a hang shows up at the next host sync instead; there
NCCL's own watchdog ends the job: ``init_distributed`` sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
(abort the communicators and the process on a timeout or an error) unless it is set.

Test-only: the environment variable MESHLM_DISTRIBUTED_TIMEOUT_S (seconds) replaces the timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

TIMEOUT_ENV = "MESHLM_DISTRIBUTED_TIMEOUT_S"
KEY = "meshlm/watch/"
ERROR_PREFIX = "meshlm: error: "  # launch.py reports a worker's last line with this prefix
STALE_POLLS = 3  # a rank whose key is this many polls old is "not answering"

_now: Optional[tuple] = None  # (name, group, n, monotonic start, peers) of the collective in flight
_counts: dict = {}  # id(group) → collectives entered on it
_waited = [0.0]  # seconds inside collectives, since the process started
_idle_since = [time.monotonic()]  # when the last collective ended
_where = {"iteration": 0, "phase": "starting", "step_end": time.monotonic()}
_failed: list = [None]  # (name, group, n) of the last collective an exception left
_labels: dict = {}  # id(group) → its label, from the last Watchdog started (for lost_peer)
# what gloo and NCCL say when the other end of a connection is gone (its process died, its node was lost)
LOST_PEER = ("reset by peer", "closed by peer", "broken pipe", "remote process exited")
LOST_PEER_LINE = "lost a peer in "  # how lost_peer's line starts (the launcher reports another rank's first)


def enter(name: str, group, peers: Optional[tuple] = None) -> None:
    """This rank is about to block in collective ``name`` over ``group`` (None: the world);
    peers: the global ranks of a point-to-point exchange (else the whole group must arrive)."""
    global _now
    key = id(group)
    n = _counts.get(key, 0) + 1
    _counts[key] = n
    _now, _failed[0] = (name, group, n, time.monotonic(), peers), None


def leave() -> None:
    """The collective entered last has returned."""
    global _now
    now = time.monotonic()
    if _now is not None:
        _waited[0] += now - _now[3]
        if sys.exc_info()[0] is not None:  # called from a finally that an exception passes through
            _failed[0] = _now[:3]
    _idle_since[0] = now
    _now = None


def call(name: str, group, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a blocking torch.distributed call over ``group``) between
    ``enter(name, group)`` and ``leave()``; returns its result."""
    enter(name, group)
    try:
        return fn(*args, **kwargs)
    finally:
        leave()


def lost_peer(exc: BaseException) -> Optional[str]:
    """One line for ``exc`` where it left a collective because a peer's connection broke (gloo's
    "Connection reset by peer" or "closed by peer", NCCL's "remote process exited"): another rank
    died (kill -9, out of memory, a lost node) and this one, a survivor, would otherwise end in the
    backend's traceback. None for anything else."""
    text = str(exc).lower()
    cause = next((c for c in LOST_PEER if c in text), None)
    if _failed[0] is None or cause is None or not isinstance(exc, RuntimeError):
        return None
    name, group, n = _failed[0]
    label = _labels.get(id(group))
    return (f"{LOST_PEER_LINE}{name} over {f'the {label} group' if label else 'its group'} (its collective #{n} "
            f"there) at iteration "
            f"{_where['iteration']} ({_where['phase']}): the backend says '{cause}', so another rank of the "
            f"job died first (its log, or the launcher, says why); restart with --load to resume from the "
            f"last checkpoint")


def waited_s() -> float:
    """Seconds this process has spent inside collectives (entered and not yet left, excluded)."""
    return _waited[0]


def at(iteration: int, phase: str, step_ended: bool = False) -> None:
    """Record what the loop is doing (shown by heartbeats and hang reports)."""
    _where["iteration"], _where["phase"] = iteration, phase
    if step_ended:
        _where["step_end"] = time.monotonic()


class Watchdog:
    """The thread of this rank (see module doc). ``groups``: {label: process group} naming every
    group of the ParallelState ("tp", "dp", …); labels get the group's ranks appended."""

    def __init__(self, rank: int, groups: dict, timeout_s: float, heartbeat_s: float = 0.0,
                 log_path: Optional[str] = None):
        self.rank, self.timeout_s, self.heartbeat_s, self.log_path = rank, timeout_s, heartbeat_s, log_path
        self.poll_s = max(0.05, min(5.0, timeout_s / 10, heartbeat_s or 5.0))
        self.labels = {id(None): f"world{list(range(dist.get_world_size()))}"}
        self.ranks = {id(None): list(range(dist.get_world_size()))}
        for kind, g in groups.items():
            if g is not None:
                ranks = dist.get_process_group_ranks(g)
                self.labels[id(g)], self.ranks[id(g)] = f"{kind}{ranks}", ranks
        self.store = dist.distributed_c10d._get_default_store()
        _labels.clear()
        _labels.update(self.labels)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshlm-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1)

    def label(self, group) -> str:
        key = id(group)
        if key not in self.labels:
            ranks = dist.get_process_group_ranks(group)
            self.labels[key], self.ranks[key] = f"group{ranks}", ranks
        return self.labels[key]

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.wait(self.poll_s):
            try:
                self._publish()
            except Exception:  # the store's host may be gone (the job is ending): keep watching
                pass
            now, cur = time.monotonic(), _now
            if cur is not None and now - cur[3] > self.timeout_s:
                self._abort(cur)
            if self.heartbeat_s and now >= next_beat:
                next_beat = now + self.heartbeat_s
                self._heartbeat(now)

    def _position(self) -> dict:
        cur, now = _now, time.monotonic()
        inside = None if cur is None else [cur[0], self.label(cur[1]), cur[2], now - cur[3]]
        counts = {self.labels[k]: n for k, n in list(_counts.items()) if k in self.labels}
        return {"t": time.time(), "iteration": _where["iteration"], "phase": _where["phase"],
                "in": inside, "idle_s": now - _idle_since[0], "counts": counts}

    def _publish(self) -> None:
        self.store.set(f"{KEY}{self.rank}", json.dumps(self._position()))

    def _read(self, rank: int) -> Optional[dict]:
        try:
            key = f"{KEY}{rank}"
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:
            return None

    # ------------------------------------------------------------------ reports
    def _heartbeat(self, now: float) -> None:
        pos = self._position()
        line = (f"heartbeat rank {self.rank}: iteration {pos['iteration']}, "
                f"{now - _where['step_end']:.1f} s since the last step ended, {_doing(pos)}\n")
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(line)

    def verdict(self, cur: tuple) -> str:
        """The hang report for collective ``cur`` (the tuple ``enter`` stored), read from the store.
        It names every other rank of the group (or each p2p peer) by its own state, under one of:
        did not arrive, in another collective (it reached this call on the group but sits in
        another op or call), already returned from it, inside it too; only when every other rank
        is inside it too is the hang put down to a transport or pairing fault."""
        name, group, n, start, peers = cur
        label = self.label(group)
        others = [r for r in (peers or self.ranks[id(group)]) if r != self.rank]
        missing, elsewhere, past, same = [], [], [], []
        for r in others:
            pos = self._read(r)
            if pos is None:
                missing.append(f"rank {r} (never published its position)")
                continue
            inside, age, state = pos["in"], time.time() - pos["t"], f"rank {r} ({_doing(pos)})"
            if peers:  # a p2p peer is there when it is in its own exchange over the group
                arrived = here = inside is not None and inside[1] == label
            else:
                arrived, here = pos["counts"].get(label, 0) >= n, inside is not None and inside[:3] == [name, label, n]
            if here:
                same.append(state if peers else f"rank {r}")
            elif arrived:
                (elsewhere if inside is not None else past).append(state)
            elif age > STALE_POLLS * self.poll_s + 1:
                missing.append(f"rank {r} (not answering: last heard {age:.0f} s ago, then {_doing(pos)})")
            else:
                missing.append(state)
        what = f"{name} over the {label} group (its collective #{n} there)"
        if peers:
            what = f"{name} with rank(s) {list(peers)} over the {label} group"
        who = "".join(f"; {head}: {', '.join(ranks)}" for head, ranks in (
            ("did not arrive", missing), ("in another collective", elsewhere), ("already returned from it", past),
            ("inside it too", same)) if ranks)
        if same and len(same) == len(others):
            who += " (every other rank is in it: a transport or pairing fault)"
        return (f"hang: rank {self.rank} waited {time.monotonic() - start:.1f} s "
                f"(> the {self.timeout_s:g} s of --distributed-timeout-minutes) in {what} at iteration "
                f"{_where['iteration']} ({_where['phase']}){who}; ending the job")

    def _abort(self, cur: tuple) -> None:
        try:
            first = self.store.add(f"{KEY}reported", 1) == 1
        except Exception:
            first = True
        if first:
            message = ERROR_PREFIX + self.verdict(cur)
        else:
            message = f"rank {self.rank}: also stuck in {cur[0]} over the {self.label(cur[1])} group; " \
                      f"ending (another rank reported the hang)"
        _last_words(message)
        if not first:
            time.sleep(2.0)
        os._exit(1)


def _last_words(message: str) -> None:
    """Print the line a rank ends the job with: to stderr, or in a worker that ``meshlm pretrain``
    started to its log alone (``sys.stderr.error_log``, set by launch.run_worker), where the launcher
    reads it and prints it once (on the console too it was printed twice); where the log cannot
    take it (a full disk), to the console."""
    log = getattr(sys.stderr, "error_log", None)
    try:
        if log is not None:
            log.write(message + "\n")
            log.flush()
            return
    except (OSError, ValueError):  # ValueError: the tee closed it after a failed write
        pass
    print(message, file=sys.stderr if log is None else sys.__stderr__, flush=True)


def _doing(pos: dict) -> str:
    """What a published position says the rank is doing, in words."""
    if pos["in"] is not None:
        name, label, n, secs = pos["in"]
        return f"inside {name} over {label} (#{n}) for {secs:.1f} s"
    return f"outside collectives for {pos['idle_s']:.1f} s, at iteration {pos['iteration']} ({pos['phase']})"


def timeout_seconds(minutes: float) -> float:
    """The watchdog's timeout: --distributed-timeout-minutes × 60, or MESHLM_DISTRIBUTED_TIMEOUT_S."""
    return float(os.environ.get(TIMEOUT_ENV) or minutes * 60.0)


def start(ps, timeout_minutes: float, heartbeat_s: float = 0.0, log_path: Optional[str] = None):
    """Start this rank's Watchdog for the groups of ParallelState ``ps`` (None without a process group)."""
    if not dist.is_initialized():
        return None
    groups = {kind: getattr(ps, f"{kind}_group") for kind in ("tp", "cp", "dp", "dp_cp", "pp", "mp", "embedding",
                                                                 "ep", "edp")}
    return Watchdog(ps.rank, groups, timeout_seconds(timeout_minutes), heartbeat_s, log_path).start()
