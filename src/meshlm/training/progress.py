"""A progress bar with ETA for ``meshlm pretrain`` on an interactive terminal.

Shown by the logging rank (the one that prints Megatron's log lines; rank 0 when PP = 1) only
when its stdout is a terminal; otherwise nothing changes and the log lines are all there is.
The bar is drawn with rich on the terminal alone (never into ``rank<R>.log``), on the last line:
every other line the process prints first erases it, then goes through as before (to the
terminal and the rank's log), and the bar is drawn again below it.
"""

from __future__ import annotations

import io
import sys
import time
from typing import Optional


class _AboveBar:
    """A text stream that erases the bar before each write and draws it again after a newline."""

    def __init__(self, stream, bar: "ProgressBar"):
        self._stream, self._bar = stream, bar

    def write(self, text: str) -> int:
        self._bar.erase()
        n = self._stream.write(text)
        if text.endswith("\n"):
            self._stream.flush()
            self._bar.draw()
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


class ProgressBar:
    """``update(iteration, loss)`` after each step; ``close()`` at the end. ETA: the iterations
    left at the mean rate since the first update (the first step, with its warm-up, excluded)."""

    def __init__(self, total: int, start: int, terminal):
        self.total, self.start, self.terminal = total, start, terminal
        self.done, self.loss, self.first = start, None, None
        self.drawn, self.last_draw = False, 0.0
        self.streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _AboveBar(sys.stdout, self), _AboveBar(sys.stderr, self)

    def update(self, iteration: int, loss: Optional[float]) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (iteration, now)
        self.done, self.loss = iteration, loss if loss is not None else self.loss
        if now - self.last_draw > 0.1 or iteration == self.total:
            self.erase()
            self.draw()

    def text(self) -> str:
        """The bar as the terminal shows it (ANSI colours), without a newline."""
        from rich.console import Console
        from rich.progress_bar import ProgressBar as Bar
        from rich.table import Table
        eta = "?"
        if self.first is not None and self.done > self.first[0]:
            rate = (self.done - self.first[0]) / (time.perf_counter() - self.first[1])
            eta = _clock((self.total - self.done) / rate)
        row = Table.grid(padding=(0, 1))
        row.add_row(Bar(total=self.total, completed=self.done, width=32),
                    f"{self.done}/{self.total}", f"{100 * self.done / max(self.total, 1):.0f}%",
                    f"ETA {eta}", "" if self.loss is None else f"lm loss {self.loss:.4g}")
        out = io.StringIO()
        Console(file=out, force_terminal=True, width=100, color_system="standard").print(row, end="")
        return out.getvalue().rstrip("\n")

    def draw(self) -> None:
        self.terminal.write(self.text())
        self.terminal.flush()
        self.drawn, self.last_draw = True, time.perf_counter()

    def erase(self) -> None:
        if self.drawn:
            self.terminal.write("\r\x1b[2K")
            self.terminal.flush()
            self.drawn = False

    def close(self) -> None:
        self.erase()
        sys.stdout, sys.stderr = self.streams


class _NoBar:
    def update(self, iteration: int, loss: Optional[float]) -> None:
        pass

    def close(self) -> None:
        pass


def for_run(is_logging_rank: bool, total: int, start: int, terminal=None):
    """The bar of this rank: a ProgressBar on the logging rank when stdout and ``terminal``
    (default the process's own stdout, sys.__stdout__) are terminals, else a no-op."""
    terminal = terminal or sys.__stdout__
    if not is_logging_rank or terminal is None or not terminal.isatty() or not sys.stdout.isatty():
        return _NoBar()
    return ProgressBar(total, start, terminal)


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
