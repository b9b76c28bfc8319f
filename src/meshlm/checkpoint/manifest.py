"""The file list of a checkpoint's manifest: every file's size and SHA-256, and checking them.

At save, each rank describes the files it wrote (:func:`own_files`: DCP's ``__<rank>_*.distcp``
and its ``rank_<rank>.json``; rank 0 also DCP's ``.metadata``), hashing them as a stream
(:func:`describe`); rank 0 gathers the lists into checkpoint.json's ``"files"`` before the folder
is renamed into place (checkpoint/dist.py). So no rank reads more than it wrote.

At load, :func:`problems` compares the folder with that list: every file present with its size
(a stat per file), and on request its SHA-256 (Megatron's ``--verify-integrity``: the ranks share
the files out, so the checkpoint is read once in all, not once per rank). A problem is a short phrase naming the file, e.g. ``__1_0.distcp is truncated (10 bytes,
checkpoint.json says 4096)``.
"""

from __future__ import annotations

import hashlib
import os

CHUNK_BYTES = 1 << 20  # read size while hashing
MANIFEST_NAME = "checkpoint.json"  # the file that holds the list (never listed itself)


def sha256_file(path: str) -> str:
    """Hex SHA-256 of the file at ``path``, read in CHUNK_BYTES pieces (no whole-file buffer)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def own_files(folder: str, rank: int) -> list:
    """Names of the files in ``folder`` that ``rank`` wrote during a save, sorted: its DCP data
    files ``__<rank>_<i>.distcp`` (DCP's FileSystemWriter prefix), its ``rank_<rank:05d>.json``,
    and for rank 0 (DCP's coordinator) ``.metadata``."""
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".distcp")
             or n == f"rank_{rank:05d}.json" or (rank == 0 and n == ".metadata")]
    return sorted(names)


def describe(folder: str, names) -> dict:
    """{name: {"bytes": size, "sha256": hex digest}} of the files ``names`` in ``folder``."""
    return {n: {"bytes": os.path.getsize(os.path.join(folder, n)),
                "sha256": sha256_file(os.path.join(folder, n))} for n in names}


def problems(folder: str, files: dict, *, checksums: bool = False, share: tuple = (0, 1)) -> list:
    """What is wrong with ``folder`` against its manifest's ``files`` ({name: {"bytes", "sha256"}}),
    one phrase per file: missing, of another size, or (checksums=True) of another SHA-256.
    [] when every file matches. Files the list does not name are not looked at.

    ``share`` = (i, n): hash only every n-th listed file from the i-th (sorted by name), so n ranks
    that combine their answers read the checkpoint once between them; every size is still checked.
    """
    found = []
    mine, every = share
    for k, (name, want) in enumerate(sorted(files.items())):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            found.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            how = "is truncated" if size < want["bytes"] else "is longer than saved"
            found.append(f"{name} {how} ({size} bytes, {MANIFEST_NAME} says {want['bytes']})")
        elif checksums and k % every == mine and sha256_file(path) != want["sha256"]:
            found.append(f"{name} does not match its SHA-256 in {MANIFEST_NAME}")
    return found
