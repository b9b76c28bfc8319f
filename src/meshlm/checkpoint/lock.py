"""One run at a time per --save folder: an OS advisory lock that dies with the process holding it.

Two runs saving into one folder would delete each other's in-flight checkpoints (a save first
clears a leftover ``iter_XXXXXXX.tmp``). :func:`hold` takes an exclusive ``fcntl.flock`` on
``SAVE/meshlm.lock`` without waiting and writes who holds it (pid, host, run directory) into the
file; a second run is refused with one line that quotes it. The kernel drops the lock when the
holder exits, however it exits (``kill -9`` included), so a crashed run never leaves a stale lock.

The holder is the process that resolves the config: the ``meshlm pretrain`` launcher, or global
rank 0 under torchrun / Slurm. The lock's file descriptor is not inherited by the workers the
launcher starts (Python opens files non-inheritable).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from ..errors import CheckpointError

LOCK_FILE = "meshlm.lock"


@contextlib.contextmanager
def hold(save: str, run_dir: str | None = None):
    """Hold the lock of the --save folder ``save`` (created if missing) inside the block.

    Raises CheckpointError naming the folder and the running job when another process holds it.
    """
    os.makedirs(save, exist_ok=True)
    with open(os.path.join(save, LOCK_FILE), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise CheckpointError(f"--save {save} is in use by a running job ({holder}); wait for it to "
                                  f"end or give another --save") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}, run directory {run_dir or os.getcwd()}\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
