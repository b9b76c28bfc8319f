"""Output files of the data commands: checked before the work, written under a temporary name.

:func:`check_output_file` fails in a second, naming the flag, where writing would otherwise fail
only after minutes of work; :func:`replacing` makes a file appear complete or not at all, and
removes its temporary file on every error (KeyboardInterrupt included).
"""

from __future__ import annotations

import contextlib
import os

from ..errors import ConfigError

TMP_SUFFIX = ".tmp"


def check_output_file(path: str, what: str, inputs=()) -> None:
    """Make sure ``path`` can be written as a file (missing folders are created) that is none of
    the files ``inputs`` (the --input files the command reads) nor a device, pipe or socket.

    what: the flag and the value the user gave (e.g. ``"--output tok.json"``), which every message
    starts with. Raises ConfigError when path is a directory, one of the inputs (writing it would
    replace the text being read: `tokenizer train --output corpus.jsonl` did), a part of its folder
    is a file, or a file cannot be created there.
    """
    if os.path.isdir(path):
        raise ConfigError(f"{what}: {path} is a directory; give the path of a file")
    from ..folders import not_a_file_problem
    special = not_a_file_problem(what, path)
    if special:  # /dev/null would be replaced by the file
        raise ConfigError(special.replace(f"{what} {path} is", f"{what}: {path} is", 1))
    same = [i for i in inputs if os.path.exists(path) and os.path.exists(i) and os.path.samefile(path, i)]
    if same:
        raise ConfigError(f"{what}: {path} is the --input {same[0]}; writing it would replace the text it reads: "
                          f"give another path")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what}: {existing} is a file, not a folder; choose another path")
    probe = path + TMP_SUFFIX
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write {e.filename or probe} ({e.strerror}); "
                          f"choose a path in a writable folder") from None


@contextlib.contextmanager
def replacing(path: str):
    """Yield a temporary name beside ``path``; on success the file written there becomes ``path``,
    on any error (KeyboardInterrupt included) it is removed."""
    tmp = path + TMP_SUFFIX
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
