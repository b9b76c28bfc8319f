"""One run at a time per folder (--save, --run-dir, the log folder): an OS advisory lock that dies with
its holder.

Two runs saving into one folder would delete each other's in-flight checkpoints (a save first
clears a leftover ``iter_XXXXXXX.tmp``); two runs in one run directory would interleave their
``logs/metrics.jsonl``, rank logs and ``config.yaml`` (a --log-dir naming another run's log folder, which
a fresh run would set aside, too). :func:`hold` takes an exclusive
``fcntl.flock`` on ``FOLDER/meshlm.lock`` without waiting and writes who holds it (pid, host, run
directory) into the file; a second run is refused with one line that quotes it. The kernel drops
the lock when the holder exits, however it exits (``kill -9`` included), so a crashed run never
leaves a stale lock.

The holder is the process that resolves the config: the ``meshlm pretrain`` launcher, or global
rank 0 under torchrun / Slurm. The lock's file descriptor is not inherited by the workers the
launcher starts (Python opens files non-inheritable).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from ..errors import CheckpointError, ConfigError
from ..folders import missing_top, remove_created

LOCK_FILE = "meshlm.lock"


def _open_lock(folder: str, flag: str):
    """Create ``folder`` if missing and open its lock file; an OSError becomes one line."""
    try:
        os.makedirs(folder, exist_ok=True)
        return open(os.path.join(folder, LOCK_FILE), "a+")
    except OSError as e:
        raise ConfigError(f"{flag} {folder} cannot be used ({e.strerror}); give a folder you can write to") \
            from None


@contextlib.contextmanager
def hold(folder: str, run_dir: str | None = None, flag: str = "--save"):
    """Hold the lock of ``folder`` (given as ``flag``; created if missing) inside the block.

    Raises CheckpointError naming the folder and the running job when another process holds it,
    ConfigError when the folder cannot be created or locked. When the block ends with an exception
    and the folder holds nothing but the lock, the folders this call created are removed again, so
    a refused run leaves no trace.
    """
    top = missing_top(folder)
    fh = _open_lock(folder, flag)
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise CheckpointError(f"{flag} {folder} is in use by a running job ({holder}); wait for it to "
                                  f"end or give another {flag}") from None
        except OSError as e:
            raise ConfigError(f"{flag} {folder} cannot be locked ({e.strerror}); give a folder on a file "
                              f"system that supports locks") from None
        fh.seek(0)
        fh.truncate()
        holder = f"pid {os.getpid()} on {socket.gethostname()}, run directory {run_dir or os.getcwd()}\n"
        with contextlib.suppress(OSError):  # a full disk: the lock holds without its note of who holds it
            os.write(fh.fileno(), holder.encode())
        try:
            yield
        except BaseException:
            if top is not None and os.listdir(folder) == [LOCK_FILE]:  # unlinked while still held
                os.unlink(os.path.join(folder, LOCK_FILE))
                remove_created(folder, top)
            raise
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
