"""Can the run write its output folders? Asked of the file system itself, before any worker starts.

Permission bits do not tell (root passes ``os.access`` on a read-only mount's parent, ``/proc``
refuses any new entry, a full disk or a quota refuses files), so :func:`output_folder_problem`
creates the folder's missing parents, writes and deletes a probe file in it and removes again
every folder it created: the file system is left as it was found.
"""

from __future__ import annotations

import os
import tempfile


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
