"""Can the run write its output folders? Asked of the file system itself, before any worker starts.

Permission bits do not tell (root passes ``os.access`` on a read-only mount's parent, ``/proc``
refuses any new entry, a full disk or a quota refuses files), so :func:`output_folder_problem`
creates the folder's missing parents, writes and deletes a probe file in it and removes again
every folder it created: the file system is left as it was found.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

from .errors import ConfigError

# errno values of a write refused for space: no space left, quota exceeded, file too large
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def missing_top(path: str):
    """The outermost folder of ``path`` that does not exist yet (what makedirs would create
    first), or None when ``path`` exists."""
    path, top = os.path.abspath(path), None
    while not os.path.lexists(path):
        path, top = os.path.dirname(path), path
    return top


def remove_created(path: str, top) -> None:
    """rmdir ``path`` and its parents up to ``top`` (the folders a makedirs created), where empty."""
    path = os.path.abspath(path)
    while top is not None:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == top:
            return
        path = os.path.dirname(path)


def output_folder_problem(flag: str, path: str):
    """None when ``path`` is, or can be created as, a directory this process can write files in;
    else one line naming ``flag``, the path and the reason (the OS's own words)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} is a file, not a directory; give a directory path (it is created if missing)"
    top = missing_top(path)
    if top is not None and os.path.exists(os.path.dirname(top)) and not os.path.isdir(os.path.dirname(top)):
        return f"{flag} {path} cannot be created: {os.path.dirname(top)} is a file; give another path"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        remove_created(path, top)
        return f"{flag} {path} cannot be created ({e.strerror}); give a folder you can write to"
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".meshlm-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{flag} {path} is not writable ({e.strerror}); give a folder you can write to"
    finally:
        remove_created(path, top)
    return None


def new_folder_problem(flag: str, path: str):
    """None when ``path`` is a new or empty folder this process can create and write in (an
    export's output); else one line naming ``flag``. Leaves the file system as it was found."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        return f"{flag} {path} exists and is not an empty folder; give a new folder"
    return output_folder_problem(flag, path)


def not_a_file_problem(flag: str, path: str):
    """One line naming ``flag`` when ``path`` exists as something other than a file or folder (a
    device such as /dev/null, a pipe, a socket), else None: an output is written beside it and moved
    over it, which replaced /dev/null itself with a regular file."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        return (f"{flag} {path} is not a regular file (a device, pipe or socket), and writing the output would "
                f"replace it; give a file path")
    return None


def output_file_problem(flag: str, path: str, example: str = "report.html"):
    """None when ``path`` can be written as a file (its missing folders are created when it is
    written); else one line naming ``flag``, the path and the fix. Writes nothing."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory; give a file path (e.g. {os.path.join(path, example)})"
    special = not_a_file_problem(flag, path)
    if special:
        return special
    folder = os.path.dirname(os.path.abspath(path))
    problem = output_folder_problem(flag, folder)
    if problem:
        return problem.replace(f"{flag} {folder}", f"{flag} {path}: its folder {folder}", 1)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag} {path} is not writable; give a file you can write to"
    return None


def foreign_file_problem(flag: str, path: str, what: str, keys: tuple):
    """None unless ``path`` is a non-empty file other than an earlier output of the command: a JSON
    object holding ``keys`` (``what`` names that output, e.g. "tokenizer.json"); else one line naming
    ``flag``, saying it is refused (an output flag given a corpus, a dataset or a config replaced it)."""
    import json
    if not os.path.isfile(path) or not os.path.getsize(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if isinstance(data, dict) and set(keys) <= set(data):
            return None
    except (OSError, ValueError):
        pass
    return (f"{flag} {path} exists and is not an earlier {what}: refusing to overwrite it; give another file, "
            f"or remove it first")


def write_text_file(path: str, text: str, flag: str = "--output") -> None:
    """Write ``text`` to ``path``, creating its missing folders (checked by output_file_problem),
    through a temporary file: an earlier file at ``path`` stays whole until the new one is. A full
    disk raises ConfigError naming ``flag`` (:func:`space_errors_named`)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    try:
        with space_errors_named(f"{flag} {path}", folder):
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` is a write refused for space: an OSError with ENOSPC/EDQUOT/EFBIG, or a
    library's own exception that carries only the OS's words (tokenizers, safetensors: "os error 28")."""
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return True
    text = str(e)
    return any(f"os error {code}" in text for code in _NO_SPACE) or "No space left on device" in text


@contextlib.contextmanager
def space_errors_named(what: str, folder: str):
    """Turn a write refused for space inside the block into one ConfigError line naming ``what``
    (the flag and path), ``folder``'s free bytes and the fix; the caller removes what it wrote.
    Any other exception passes unchanged."""
    try:
        yield
    except Exception as e:
        if not out_of_space(e):
            raise
        try:
            free = f"{shutil.disk_usage(folder).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        raise ConfigError(f"{what}: no space left in {folder} ({free}; {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}); free space there or choose another folder") from None


@contextlib.contextmanager
def left_as_found(folder: str):
    """On any exception inside the block, remove what the block added to ``folder``: the entries
    that were not there before and the folders a makedirs created for it (an import or export that
    fails leaves no half-written or empty output folder). The exception passes unchanged."""
    top = missing_top(folder)
    before = set(os.listdir(folder)) if top is None and os.path.isdir(folder) else set()
    try:
        yield
    except BaseException:
        if os.path.isdir(folder):
            for name in set(os.listdir(folder)) - before:
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):  # the block's own error is the one to report
                        os.remove(path)
        remove_created(folder, top)
        raise


def read_jsonl(path: str, error, what: str) -> list:
    """The JSON records of a .jsonl file, blank lines skipped. A last line that is not JSON and has
    no newline (the writer was killed mid-line, or is writing it now) is left out, with a note on
    stderr; any other line that is not JSON raises ``error`` (an exception class) naming the file,
    the line and ``what`` the file should be."""
    import json
    import sys
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    # split: a file ending in "\n" gives a last element "", so lines[-1] is unterminated iff non-empty
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                print(f"meshlm: note: {path} line {number} is cut off (a run killed while writing it, or "
                      f"still running): left out", file=sys.stderr, flush=True)
                break
            raise error(f"{path} line {number}: not JSON ({e.msg}); is it {what}?") from None
    return records


def read_yaml_mapping(path: str, error, sections=(), value_problem=None) -> dict:
    """The mapping in a run's config.yaml ({} for an empty file); ``error`` naming the file and line
    when it is not YAML or not a mapping, or naming the key when one of ``sections`` (config.SECTIONS:
    model, training, parallel, …) is not a mapping or ``value_problem`` (config.value_problem) finds
    a value of the wrong kind (read as they are, each was a TypeError/AttributeError traceback)."""
    import yaml
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise error(f"{path}{where}: not YAML ({getattr(e, 'problem', None) or e}); fix or delete the file "
                    f"(it is the config.yaml `meshlm pretrain` wrote)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read ({e}); fix or delete the file") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise error(f"{path}: not a YAML mapping of meshlm settings; fix or delete the file")
    bad = next((k for k in sections if k in loaded and not isinstance(loaded[k], dict)), None)
    if bad:
        raise error(f"{path}: section {bad!r} is {loaded[bad]!r}, not a mapping of its settings; fix or delete the "
                    f"file (it is the config.yaml `meshlm pretrain` wrote)")
    wrong = value_problem(loaded) if value_problem else None
    if wrong:
        raise error(f"{path}: {wrong}; fix or delete the file (it is the config.yaml `meshlm pretrain` wrote)")
    return loaded
