"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic save, pickle-free load.

Layout (Megatron's conventions)::

    SAVE/latest_checkpointed_iteration.txt   the iteration number; moved into place LAST
    SAVE/iter_0000100/.metadata, __*_*.distcp DCP: every tensor of every rank
    SAVE/iter_0000100/rank_00003.json        rank 3's non-tensor values and the tree of its state
    SAVE/iter_0000100/checkpoint.json        iteration, layout (world, TP, PP, DP), torch version,
                                             size and SHA-256 of every other file
    SAVE/iter_0000100/config.json            the run's Config as JSON (for `meshlm generate`)

A state is a nested dict (dict/list/tuple) of tensors and JSON values. Tensors are flattened to
DCP keys ``a/b/c``; everything else goes to the rank's JSON file. A tensor is a plain tensor
(saved whole) or a ``boxes.Boxes`` (the pieces of a global tensor this rank holds: the model
space of model_space.py). DCP writes identical boxes offered by several ranks once (DP
replicas); values that differ between ranks go under rank-unique keys (``rank_key``).

Loading reshards: each rank names the tensors it wants and where they go (``targets``: plain
tensors or Boxes of views into its live model and optimizer state); DCP reads exactly those
boxes, whatever layout wrote them. The values every rank shares (progress, schedule) come from
saved rank 0; a per-rank subtree from the saved rank at the same coordinates (``load``).

Atomicity: all ranks write into ``iter_XXXXXXX.tmp`` and hash what they wrote; rank 0 gathers
the hashes, writes the manifest (sizes and SHA-256 of every file, manifest.py), renames the folder
to ``iter_XXXXXXX``, replaces the tracker through a temp file + ``os.replace``, then prunes to
``--keep-checkpoints`` (``finalize``). A crash at any point leaves the tracker naming a complete
checkpoint. Loading checks the tracker's checkpoint against its manifest and falls back to the
newest older intact one, saying so (``checkpoint_dir``).
--async-save runs the same steps in the background (async_save.py).

Reading the files (allow-listed ``.metadata``, tensors only, damage as one line) is
safe_read.py; what a training state puts into a checkpoint is state.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError, clipped
from ..parallel.agree import all_problems, first_problem
from . import manifest
from .boxes import Boxes
from .hf_config import is_hf_folder
from .lock import LOCK_FILE
from .megatron import convert_first, is_megatron_folder, tracker_problem
from .safe_read import SafeReader, _Corrupt, _TensorOnlyPlanner, _check_storage, _load_json, damaged, reading

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = manifest.MANIFEST_NAME
CONFIG = "config.json"
FORMAT_VERSION = 2  # 2: model space (global names and shapes), per-parameter optimizer state;
                   # the manifest lists every file with its size and SHA-256
_RANK_KEY = re.compile(r"^(.+)/rank(\d+)$")


class TensorMismatch(CheckpointError):
    """The checkpoint lacks some of the targets' tensors or holds them at other shapes (``read_into``);
    ``found``: which, without the rest of the line."""

    def __init__(self, message: str, found: str):
        super().__init__(message)
        self.found = found


def rank_key(name: str, rank: int) -> str:
    """Top-level state key ``name/rank<r>`` of a per-rank subtree (values that differ between
    ranks, e.g. RNG states); ``load`` returns the matching saved rank's subtree as ``tree[name]``."""
    return f"{name}/rank{rank}"


def iteration_dir(root: str, iteration: int) -> str:
    """``root/iter_0000100`` for iteration 100 (Megatron's 7-digit name)."""
    return os.path.join(root, f"iter_{iteration:07d}")


# ----------------------------------------------------------------------------- state <-> (tensors, JSON)

def _flatten(obj: Any, prefix: str, tensors: dict) -> Any:
    """Encode obj as a JSON tree; tensors go to ``tensors[key]`` and appear as {"t": key}."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj if isinstance(obj, Boxes) else obj.detach()
        return {"t": prefix}
    if isinstance(obj, dict):
        return {"d": [[k, _flatten(v, f"{prefix}/{k}" if prefix else str(k), tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"checkpoint state at {prefix!r}: {type(obj).__name__} is neither a tensor nor JSON")


def _unflatten(tree: dict, tensors: dict) -> Any:
    """Inverse of _flatten; a tensor key not in ``tensors`` gives None."""
    if "t" in tree:
        return tensors.get(tree["t"])
    if "d" in tree:
        return {k: _unflatten(v, tensors) for k, v in tree["d"]}
    if "l" in tree:
        return [_unflatten(v, tensors) for v in tree["l"]]
    return tree["v"]


def _tensor_keys(tree: dict) -> list:
    if "t" in tree:
        return [tree["t"]]
    children = [v for _, v in tree["d"]] if "d" in tree else tree.get("l", [])
    return [k for c in children for k in _tensor_keys(c)]


# ----------------------------------------------------------------------------- files

def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by ``root/latest_checkpointed_iteration.txt``; None if there is no tracker.

    Raises CheckpointError when the tracker holds anything but an integer.
    """
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}; "
                              f"write the iteration of a complete iter_XXXXXXX folder into it")
    return int(text)


def _world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- save / load

def save(root: str, iteration: int, state: dict, *, layout: Optional[dict] = None,
         config: Optional[dict] = None, coords: Optional[dict] = None, keep: Optional[int] = None) -> str:
    """Write ``state`` of every rank to ``root/iter_XXXXXXX`` atomically; return that folder.

    Collective over the default process group: every rank calls it with its own state.
    layout: e.g. {"tp": 2, "pp": 2, "dp": 1}, recorded in checkpoint.json (any layout loads it).
    config: the run's config as a JSON-able dict (rank 0's is written).
    coords: this rank's place in the layout, e.g. {"tp": 0, "pp": 1, "dp": 0}, recorded in its
    rank JSON (``load`` picks per-rank subtrees by it).
    keep: after this save becomes the latest, keep only the newest ``keep`` complete checkpoints
    (``--keep-checkpoints``); None keeps all. Folders left by crashed saves (``iter_*.tmp``,
    ``iter_*.old``) are removed first.
    The steps (``make_temp_dir``, ``write``, ``gather_files``, ``finalize``) are also run one by one
    by a background save (async_save.py).
    """
    rank, world = _world()
    tmp, written = temp_dir(root, iteration), []
    agree = first_problem if world > 1 else (lambda problem: problem)  # a barrier too
    problem = agree(attempt(lambda: make_temp_dir(root, iteration)) if rank == 0 else None)
    if problem is None:  # DCP's own errors reach every rank; the rank JSON's, this rank's alone: agreed
        problem = agree(attempt(lambda: written.append(write(tmp, state, coords=coords))))
    if problem is None:
        files = gather_files(written[0])
        problem = agree(attempt(lambda: finalize(root, iteration, files, world_size=world, layout=layout,
                                                 config=config, keep=keep)) if rank == 0 else None)
    if problem is not None:
        if rank == 0:  # a full disk gets its space back; the tracker still names the previous save
            shutil.rmtree(tmp, ignore_errors=True)
        free = agree(free_space(root)) or ""  # rank 0's reading: the same line on every rank
        raise CheckpointError(f"--save {root}: the checkpoint of iteration {iteration} was not saved "
                              f"({problem}{free}); {TRACKER} still names the previous one (if any); "
                              f"free space or give a --save folder you can write to")
    return iteration_dir(root, iteration)


def one_line(e: BaseException) -> str:
    """What failed, in one line naming the failing rank (DCP's CheckpointException: the first
    failing rank it reports)."""
    failures = getattr(e, "failures", None)  # DCP: {rank: (exception, traceback)}
    if failures:
        rank, (e, _) = min(failures.items(), key=lambda item: item[0])
    else:
        rank = _world()[0]
    return f"rank {rank}: {type(e).__name__}: {clipped(str(e), 300) or 'no message'}"


def attempt(step) -> Optional[str]:
    """None if ``step()`` succeeds, else ``one_line`` of its exception (an interrupt is not caught)."""
    try:
        step()
        return None
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        return one_line(e)


def free_space(root: str) -> str:
    """"; N bytes free there" for a save's message (a full disk shows in torch's words only as
    e.g. "unexpected pos 704 vs 598"), or "" when the file system cannot be asked."""
    try:
        return f"; {shutil.disk_usage(root).free:,} bytes free there without the partial save"
    except OSError:
        return ""


def temp_dir(root: str, iteration: int) -> str:
    """``root/iter_0000100.tmp``: where every rank writes iteration 100's files until ``finalize``."""
    return iteration_dir(root, iteration) + ".tmp"


def make_temp_dir(root: str, iteration: int) -> str:
    """Create a fresh, empty ``temp_dir``, first removing the folders crashed saves left
    (``iter_*.tmp``, ``iter_*.old``); rank 0 calls it before any rank writes (a background save
    only once the previous one is finished, so no folder in use is removed)."""
    os.makedirs(root, exist_ok=True)
    _remove_leftovers(root)
    tmp = temp_dir(root, iteration)
    os.makedirs(tmp)
    return tmp


def write(tmp: str, state: dict, *, coords: Optional[dict] = None, group=None) -> dict:
    """Write this rank's ``state`` into the folder ``tmp``: its tensors through DCP (collective over
    ``group``, default the whole job: every rank calls it; an error on any rank raises DCP's
    CheckpointException on all of them), then its rank JSON (local: an error there must not keep
    this rank from DCP's collective, where the others would wait for it). Returns the files this
    rank wrote as {name: {"bytes", "sha256"}} (manifest.describe), for ``gather_files``."""
    rank, world = _world()
    tensors: dict = {}
    tree = _flatten(state, "", tensors)
    with warnings.catch_warnings():  # DCP warns that a world of one is "assumed" single-process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=False),
                 process_group=group, no_dist=world == 1)
    _write_json(os.path.join(tmp, f"rank_{rank:05d}.json"), {"rank": rank, "coords": coords, "state": tree})
    return manifest.describe(tmp, manifest.own_files(tmp, rank))


def gather_files(files: dict, group=None) -> Optional[dict]:
    """Every rank's ``write`` result merged on rank 0 (None on the others); collective over
    ``group`` (default the whole job)."""
    rank, world = _world()
    if world == 1:
        return files
    parts = [None] * world if rank == 0 else None
    dist.gather_object(files, parts, dst=0, group=group)
    return {name: entry for part in parts for name, entry in part.items()} if rank == 0 else None


def finalize(root: str, iteration: int, files: dict, *, world_size: int, layout: Optional[dict] = None,
             config: Optional[dict] = None, keep: Optional[int] = None) -> str:
    """Rank 0's end of a save, once every rank's files are in ``root/iter_XXXXXXX.tmp``: write
    config.json and the manifest (iteration, layout, sizes and SHA-256 of every file), rename the
    folder into place, make it the tracker's iteration, then prune to the newest ``keep``.

    files: {name: {"bytes", "sha256"}} of every rank's files (manifest.describe). Each step is
    durable (fsync) before the next, so a crash at any point leaves the tracker naming a complete
    checkpoint. Returns the final folder. Not collective: a background save calls it when all
    ranks are done.
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    files = dict(files)
    if config is not None:
        _write_json(os.path.join(tmp, CONFIG), config)
        files.update(manifest.describe(tmp, [CONFIG]))
    _write_json(os.path.join(tmp, MANIFEST), {
        "format_version": FORMAT_VERSION, "iteration": iteration, "world_size": world_size,
        "layout": layout or {}, "torch_version": torch.__version__, "files": dict(sorted(files.items()))})
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving an iteration the tracker may name: swap the old folder out
        old = final + ".old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as fh:
        fh.write(f"{iteration}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)
    if keep is not None:
        prune(root, iteration, keep)
    return final


def _remove_leftovers(root: str) -> None:
    """Delete ``iter_*.tmp`` / ``iter_*.old`` folders of crashed saves and prunes (never the
    tracker's checkpoint: that is always a plain ``iter_XXXXXXX``)."""
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith((".tmp", ".old")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prune(root: str, latest: int, keep: int) -> list:
    """Delete the complete checkpoints older than ``latest`` beyond the newest ``keep`` (``latest``
    counted); return their iterations. Newer folders (another history) are left alone. Each is
    first renamed to ``iter_XXXXXXX.tmp``, so a crash mid-delete leaves a leftover, never a
    half-deleted checkpoint that looks complete."""
    older = [it for it in complete_iterations(root) if it < latest]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for it in doomed:
        path = iteration_dir(root, it)
        os.replace(path, path + ".tmp")
        shutil.rmtree(path + ".tmp")
    return doomed


# ----------------------------------------------------------------------------- which checkpoint to load

def _folder_problem(path: str, checksums: bool) -> Optional[str]:
    """Why the checkpoint folder ``path`` (an ``iter_XXXXXXX``) cannot be loaded (a short phrase), or
    None: it must exist, have a readable manifest of its own iteration and .metadata, and hold every
    file the manifest lists at its size (and SHA-256 when ``checksums``)."""
    if not os.path.isdir(path):
        return "does not exist"
    try:
        saved = read_manifest(path)
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as e:  # _Corrupt (bad JSON) is a ValueError
        return str(e)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return ".metadata is missing"
    named = int(os.path.basename(os.path.normpath(path))[len("iter_"):])
    if isinstance(saved, dict) and saved.get("iteration") != named:  # loading it would read iteration_dir(its own)
        return f"{MANIFEST} says iteration {saved.get('iteration')!r}, not {named}: was the folder renamed?"
    listed = saved.get("files") if isinstance(saved, dict) else None
    if listed is None and isinstance(saved, dict) and saved.get("format_version") == 1:
        return None  # saved before manifests listed files: nothing more to compare
    try:
        found = manifest.problems(path, listed, checksums=checksums, share=_world() if checksums else (0, 1))
    except (AttributeError, KeyError, TypeError):
        return f"{MANIFEST} has no valid file list"
    if checksums:  # each rank hashed its share of the files: every rank learns all the findings
        found = sorted(set(all_problems(found)))
    return found[0] if found else _metadata_problem(path)


def _metadata_problem(path: str) -> Optional[str]:
    """Why DCP's .metadata (a small pickle, read whole by every load) cannot be read, or None: a
    flipped byte keeps its size, so only reading it shows the damage without --verify-integrity.
    A pickle naming a class no checkpoint holds is not damage: its CheckpointError is raised."""
    try:
        SafeReader(path).read_metadata()
    except _Corrupt as e:
        return str(e)
    except OSError as e:
        return f".metadata unreadable ({e.strerror})"
    return None


def _choose(root: str, iteration: Optional[int], checksums: bool) -> tuple:
    """(folder, notes): the checkpoint to load and what was skipped to get there (one line, or "").

    ``iteration`` given: that one or CheckpointError. Else the tracker's, or when it is missing or
    damaged the newest older complete checkpoint that is intact. CheckpointError when none is, or
    when ``root`` is a Megatron-LM save (naming the conversion).
    """
    if iteration is None:
        if not os.path.isdir(root):
            what = "a file, not a directory" if os.path.exists(root) else "no such directory"
            raise CheckpointError(f"--load {root}: {what}; point --load at a folder written by --save")
        if is_megatron_folder(root):  # its tracker names an iter_ folder without our manifest: not damage
            raise CheckpointError(check_loadable(root, fresh=False)[0])
        iteration = read_tracker(root)
        if iteration is None:
            problems = check_loadable(root, fresh=False)  # loading now: no fresh start to suggest
            raise CheckpointError(problems[0] if problems else
                                  f"--load {root}: no {TRACKER}; point --load at a folder written by --save")
        candidates = [iteration] + [it for it in reversed(complete_iterations(root)) if it < iteration]
    else:
        candidates = [iteration]
    skipped = []
    for it in candidates:
        path = iteration_dir(root, it)
        problem = _folder_problem(path, checksums)
        if problem is None:
            return path, _fallback_note(root, skipped, path)
        skipped.append((path, problem))
    path, problem = skipped[0]
    if problem == "does not exist":
        raise CheckpointError(f"--load {root}: {TRACKER} names iteration {candidates[0]} but {path} does not "
                              f"exist; write the iteration of a complete iter_XXXXXXX folder into it")
    raise damaged(path, _Corrupt(problem), root)


def _fallback_note(root: str, skipped: list, chosen: str) -> str:
    if not skipped:
        return ""
    name = os.path.basename
    (latest, why), *more = skipped
    also = "".join(f"; {name(p)} too ({w})" for p, w in more)
    return (f"--load {root}: the latest checkpoint {name(latest)} is damaged or incomplete ({why}{also}); "
            f"loading {name(chosen)} instead")


def checkpoint_dir(root: str, iteration: Optional[int] = None, *, checksums: bool = False,
                   quiet: bool = False) -> str:
    """The checkpoint folder to load: ``iteration``'s, else the tracker's — or, when that one is
    missing, incomplete or damaged, the newest older complete one that is intact (rank 0 prints
    one line naming both: what is wrong with the latest, which one is loaded instead).

    Intact: the manifest, .metadata and every file the manifest lists, at its size (a stat each);
    checksums=True (``--verify-integrity``) also compares each file's SHA-256: the ranks share the files
    out (each hashes every world-th one) and combine their findings, so all ranks must call it.
    Raises CheckpointError naming the folder when there is no tracker, or no candidate is intact
    (the latest's problem, as ``damaged``'s one line), or ``iteration`` is given and not intact.
    quiet: print nothing (a look before the load, which then says it).
    """
    path, note = _choose(root, iteration, checksums)
    if note and not quiet and _world()[0] == 0:
        print(f"note: {note}", flush=True)
    return path


def _other_latest(parent: str, folder: str) -> str:
    """For the hint of a --load naming one checkpoint's folder: what its parent resumes from
    instead, when that is another checkpoint ('' when it is this one or unknown)."""
    try:
        latest = read_tracker(parent)
    except (CheckpointError, OSError):
        return ""
    if latest is None or os.path.basename(os.path.normpath(folder)) == os.path.basename(iteration_dir(parent, latest)):
        return ""
    return (f", which resumes from its latest, {os.path.basename(iteration_dir(parent, latest))}, not this one "
            f"(Megatron's --ckpt-step is not supported: to resume from {os.path.basename(os.path.normpath(folder))}, "
            f"copy it into a new folder and write its iteration into {TRACKER} there)")


def complete_iterations(root: str) -> list:
    """Iterations of the complete checkpoints (``iter_XXXXXXX`` folders with a manifest, i.e.
    saves that reached the rename) in root, ascending; [] when root is not a directory."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        digits = name[len("iter_"):]
        if name.startswith("iter_") and digits.isdigit() and \
                os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append(int(digits))
    return sorted(found)


def check_loadable(load: Optional[str], save: Optional[str] = None, fresh: bool = True) -> list:
    """Problems with ``--load load`` found from the file system alone (no tensor is read), one line
    each; [] when it can be loaded (possibly from an older checkpoint than the tracker's, see
    ``checkpoint_dir``), or when it is the --save directory without a checkpoint yet (a fresh
    start). A --load that does not exist is left to meshlm.validate. fresh: whether the hint for a
    folder that is no checkpoint may suggest --save (pretrain's; False when only loading).

    Meant to run before workers start (meshlm.validate) and again in the trainer.
    """
    if not load or not os.path.isdir(load):
        return []
    if is_megatron_folder(load):
        return [convert_first(f"--load {load}", load)]
    stale = tracker_problem(load)
    if stale:
        return [convert_first(f"--load {load}", load) + f" ({stale})"]
    try:
        iteration = read_tracker(load)
    except (CheckpointError, OSError) as e:
        return [str(e) if isinstance(e, CheckpointError) else f"--load {load}: {TRACKER} unreadable ({e})"]
    if iteration is None:
        if os.path.isfile(os.path.join(load, MANIFEST)):
            parent = os.path.dirname(os.path.normpath(load)) or "."
            return [f"--load {load} is one checkpoint's folder; point --load at its parent {parent} (the run's "
                    f"--save directory){_other_latest(parent, load)}"]
        saved = complete_iterations(load)
        if saved:
            last = saved[-1]
            return [f"--load {load} holds {os.path.basename(iteration_dir(load, last))} but no {TRACKER}: "
                    f"to resume from it, write {last} into {os.path.join(load, TRACKER)}; to start afresh, "
                    f"use another --save directory"]
        if save and os.path.abspath(load) == os.path.abspath(save):
            return []
        inner = save_folder_in(load)
        if inner:
            return [f"--load {load} is not a checkpoint directory, but {inner} is: give --load {inner}"]
        empty = not [name for name in os.listdir(load) if name != LOCK_FILE]
        unfinished = sorted(n for n in os.listdir(load) if n.startswith("iter_") and n.endswith(".tmp"))
        what = "is empty" if empty else f"holds only the unfinished save {unfinished[-1]} (its run stopped while " \
            f"writing it)" if unfinished else "is not a meshlm checkpoint directory"
        if is_hf_folder(load) and not fresh:
            return [f"--load {load} is a Hugging Face folder, not a meshlm checkpoint; convert it first: "
                    f"meshlm convert --from-hf {load} --save CKPT_DIR, then --load CKPT_DIR"]
        hint = f", or give --save {load} too to start fresh there" if fresh else ""
        return [f"--load {load} {what} (no {TRACKER}); point --load at a run's --save directory{hint}"]
    try:
        _choose(load, None, False)
    except CheckpointError as e:
        return [str(e)]
    return []


def folder_kind(path: str) -> str:
    """The end of a converter's refusal of ``path`` (a folder of another kind than the one it reads):
    "; it is …: <the command that reads it>", or "" when no kind is recognised."""
    if is_hf_folder(path):
        return "; it is a Hugging Face model folder: meshlm convert --from-hf reads it"
    if is_megatron_folder(path):
        return "; it is a Megatron-LM checkpoint: meshlm convert --from-megatron reads it"
    if os.path.isfile(os.path.join(path, TRACKER)):
        return "; it is a meshlm checkpoint already: give it to --load (pretrain, generate, convert --to-hf)"
    return ""


def save_folder_in(folder: str) -> Optional[str]:
    """The first subfolder of ``folder`` holding a tracker (a --save folder), or None: a run
    directory given for its checkpoints (the embedded default saves into its checkpoints/)."""
    return next((os.path.join(folder, n) for n in sorted(os.listdir(folder))
                 if os.path.isfile(os.path.join(folder, n, TRACKER))), None)


def read_manifest(path: str) -> dict:
    """checkpoint.json of a checkpoint folder (iteration, world_size, layout)."""
    return _load_json(os.path.join(path, MANIFEST))


def read_config(path: str) -> dict:
    """config.json of a checkpoint folder; CheckpointError if it was saved without one."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} not found: the checkpoint was saved without its config")
    return _load_json(file)


def read_into(path: str, targets: dict) -> None:
    """Load the checkpoint folder's tensors into ``targets`` {DCP key: tensor or Boxes} in place,
    without collectives: each target reads the boxes it covers from whatever pieces were saved.

    Raises TensorMismatch (a CheckpointError), before reading anything, naming the keys the checkpoint
    lacks or holds at another global shape; damaged files raise their own errors (FileNotFoundError, _Corrupt,
    RuntimeError...), for ``reading`` to report.
    """
    if not targets:
        return
    everything = SafeReader(path).read_metadata()
    metadata = everything.state_dict_metadata
    missing = [k for k in targets if not isinstance(metadata.get(k), TensorStorageMetadata)]
    shapes = [f"{k} {tuple(metadata[k].size)} vs {tuple(t.shape)}" for k, t in targets.items()
              if k not in missing and tuple(metadata[k].size) != tuple(t.shape)]
    problems = [f"{what} {len(keys)}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
                for what, keys in (("has no tensor", missing), ("has another shape (saved vs now)", shapes)) if keys]
    if problems:
        found = "; ".join(problems)
        raise TensorMismatch(f"checkpoint {path} does not fit this run ({found}): was it saved with another "
                             f"model config?", found)
    _check_storage(path, everything, targets)
    with warnings.catch_warnings():  # a world of one is "assumed" single-process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=SafeReader(path), planner=_TensorOnlyPlanner(), no_dist=True)


def read_tensors(path: str, keys: list) -> dict:
    """The tensors ``keys`` of a checkpoint folder, whole (global shape and dtype from the DCP
    metadata), as new CPU tensors; errors as ``read_into``."""
    metadata = SafeReader(path).read_metadata().state_dict_metadata
    for key in keys:
        if not isinstance(metadata.get(key), TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {key!r}")
    out = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    read_into(path, out)
    return out


def rank_trees(path: str) -> dict:
    """{saved rank: {"coords", "state"}} of a checkpoint folder: every rank JSON (the state as the
    flattened tree of ``_flatten``)."""
    return {int(name[5:-5]): _load_json(os.path.join(path, name)) for name in sorted(os.listdir(path))
            if name.startswith("rank_") and name.endswith(".json")}


def shared_value(path: str, key: str) -> Any:
    """The value ``key`` of a checkpoint folder's state that every rank saves alike and that holds no
    tensor (e.g. "scheduler"), from rank 0's JSON alone, as ``load`` takes the shared values; None when
    absent. OSError / ValueError (not JSON) as the file system and json give them."""
    tree = dict(_load_json(os.path.join(path, "rank_00000.json"))["state"]["d"]).get(key)
    return None if tree is None else _unflatten(tree, {})


def _check_format(path: str, manifest: dict) -> None:
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {version}, this meshlm reads format {FORMAT_VERSION} "
                              f"(the model space); load it with the meshlm that saved it and export it, or re-train")


def _matching_rank(trees: dict, coords: Optional[dict]) -> Optional[int]:
    """The saved rank at ``coords`` (None: the rank with this rank's number), or None if there is none."""
    if coords is None:
        rank = _world()[0]
        return rank if rank in trees else None
    return next((r for r, t in sorted(trees.items()) if t.get("coords") == coords), None)


def load(root: str, targets: Optional[dict] = None, *, coords: Optional[dict] = None,
         iteration: Optional[int] = None) -> tuple:
    """Read a rank's state from the checkpoint the tracker (or ``iteration``) names, at any layout.

    targets: a nested dict like the state given to ``save``; its tensor leaves (plain tensors or
    Boxes) are loaded in place from the checkpoint's tensors of the same keys (resharded, see
    ``read_into``); its other leaves are ignored. None: every tensor of the returned tree is read
    whole instead.
    Returns (iteration, tree): the state saved by rank 0 (the values every rank shares), with each
    tensor leaf the target loaded into it (None when targets do not name it), and each per-rank
    subtree ``rank_key(name, r)`` replaced by ``tree[name]``: the subtree (tensors read whole) of the
    saved rank at the same ``coords`` (None: the same rank number), or None when no saved rank
    is at this rank's place. No collective: each rank reads only what it needs.
    Raises CheckpointError if the checkpoint is missing, incomplete, damaged (one line, see
    ``reading``), of another format, or does not hold the targets at their global shapes.
    """
    path = checkpoint_dir(root, iteration)
    with reading(path, root):
        manifest = read_manifest(path)
        _check_format(path, manifest)
        trees = rank_trees(path)
        own = _matching_rank(trees, coords)
        common = {"d": [[k, v] for k, v in trees[0]["state"]["d"] if not _RANK_KEY.match(k)]}
        names = [m.group(1) for k, _ in trees[0]["state"]["d"] if (m := _RANK_KEY.match(k))]
        mine = dict(trees[own]["state"]["d"]) if own is not None else {}
        per_rank = {name: mine.get(rank_key(name, own)) for name in names}
        flat: dict = {}
        if targets is not None:
            _flatten(targets, "", flat)
            read_into(path, flat)
        whole = [k for sub in per_rank.values() if sub for k in _tensor_keys(sub)]
        if targets is None:
            whole += _tensor_keys(common)
        tensors = {**read_tensors(path, whole), **flat}
        state = _unflatten(common, tensors)
        state.update({name: _unflatten(sub, tensors) if sub else None for name, sub in per_rank.items()})
        return manifest["iteration"], state
