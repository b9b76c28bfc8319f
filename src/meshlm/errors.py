"""User-facing errors: one line that names the flag or file and the fix.

The CLI prints a MeshlmError as a single line (no traceback) and exits with status 2.
Anything else that escapes is a bug in meshlm and keeps its traceback.
"""


class MeshlmError(Exception):
    """Base class of every error caused by the user's input (flags, files, data)."""


class ConfigError(MeshlmError):
    """Invalid flags or YAML config; the message lists every problem found, one per line."""

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if len(self.problems) == 1
                         else f"{len(self.problems)} config errors:\n  - " + "\n  - ".join(self.problems))


class DataError(MeshlmError):
    """A data, tokenizer or index file is missing, malformed or inconsistent with the config."""


class CheckpointError(MeshlmError):
    """A checkpoint directory is missing, incomplete or incompatible with the run."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint folder whose files could not be read (missing, truncated, unparsable bytes);
    ``damage``: what is wrong, without the fix (e.g. "checkpoint iter_0000004 is damaged or
    incomplete (…)")."""

    def __init__(self, message: str, damage: str):
        super().__init__(message)
        self.damage = damage


class TrainingError(MeshlmError):
    """The run cannot go on (NaN/inf loss, exhausted loss scale); the message names the iteration."""


def clipped(text: str, limit: int) -> str:
    """``text`` on one line, cut at the last word boundary within ``limit`` characters, "…" marking the
    cut: a library's message quoted inside one of ours stays readable (never cut mid-word)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return head.rstrip(" ,;:") + " …"

