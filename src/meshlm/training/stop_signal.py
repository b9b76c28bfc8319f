"""``--exit-signal-handler``: a signal asks for a graceful stop instead of killing the worker.

As Megatron's ``DistributedSignalHandler`` (megatron/training/dist_signal_handler.py), the handler
only records that the signal came; the training loop asks :attr:`SignalFlag.received` after each
iteration and every rank agrees on it (a MAX over ranks, in trainer.py's early-exit check), so all
ranks save the same iteration and exit with status 0. Processes forked after installation (the
``--num-workers`` data-loader workers) inherit the handler, so a signal sent to a whole process
group (torchrun, Slurm) does not kill them under the training process either.
"""

from __future__ import annotations

import signal


class SignalFlag:
    """Record the arrival of ``name`` (e.g. "SIGTERM") in this process from installation on.

    Use as a context manager (or call :meth:`release`) to put the previous handler back. Must be
    created in the main thread (Python's rule for signal.signal; ValueError otherwise).
    """

    def __init__(self, name: str):
        self.signal = signal.Signals[name]
        self.received = False
        self._released = False
        previous = signal.signal(self.signal, self._handle)
        self._previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python

    def _handle(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        """Restore the handler that was installed before this one (once)."""
        if not self._released:
            signal.signal(self.signal, self._previous)
            self._released = True

    def __enter__(self) -> "SignalFlag":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
