"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic save, pickle-free load.

Layout (Megatron's conventions)::

    SAVE/latest_checkpointed_iteration.txt   the iteration number; moved into place LAST
    SAVE/iter_0000100/.metadata, __*_*.distcp DCP: every tensor of every rank
    SAVE/iter_0000100/rank_00003.json        rank 3's non-tensor values and the tree of its state
    SAVE/iter_0000100/checkpoint.json        iteration, layout (world, TP, PP, DP), torch version
    SAVE/iter_0000100/config.json            the run's Config as JSON (for `meshlm generate`)

A state is a nested dict (dict/list/tuple) of tensors and JSON values. Tensors are flattened to
DCP keys ``a/b/c`` (so a top-level key such as ``rng/rank3`` namespaces a subtree); everything
else goes to the rank's JSON file. Identical keys on several ranks are written once by DCP (DP
replicas of the model); the caller makes keys unique where values differ (``model_key``,
``rank_namespace``).

Atomicity: all ranks write into ``iter_XXXXXXX.tmp``; after a barrier rank 0 writes the
manifest, renames the folder to ``iter_XXXXXXX`` and then replaces the tracker through a temp
file + ``os.replace``. A crash at any point leaves the tracker naming the previous complete
checkpoint.

Safe load: DCP unpickles ``.metadata`` with plain ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``. Here ``.metadata`` is read by an unpickler that admits only
DCP's metadata classes, no non-tensor value is stored in DCP, tensors are read with
``weights_only=True`` and non-tensor values come from JSON: loading never unpickles an
arbitrary object.

Damage: any OSError/RuntimeError/ValueError/JSON/pickle error while reading a checkpoint's files
becomes one CheckpointError line (``reading``); before DCP reads tensors, every ``.distcp`` file
they live in is checked to exist and to be long enough (a stat, no read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import shutil
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import config as C
from ..errors import CheckpointError, ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "checkpoint.json"
CONFIG = "config.json"
FORMAT_VERSION = 1


def iteration_dir(root: str, iteration: int) -> str:
    """``root/iter_0000100`` for iteration 100 (Megatron's 7-digit name)."""
    return os.path.join(root, f"iter_{iteration:07d}")


# ----------------------------------------------------------------------------- state <-> (tensors, JSON)

def _flatten(obj: Any, prefix: str, tensors: dict) -> Any:
    """Encode obj as a JSON tree; tensors go to ``tensors[key]`` and appear as {"t": key}."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach()
        return {"t": prefix}
    if isinstance(obj, dict):
        return {"d": [[k, _flatten(v, f"{prefix}/{k}" if prefix else str(k), tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"checkpoint state at {prefix!r}: {type(obj).__name__} is neither a tensor nor JSON")


def _unflatten(tree: dict, tensors: dict) -> Any:
    if "t" in tree:
        return tensors[tree["t"]]
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


# ----------------------------------------------------------------------------- safe DCP reading

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _ForbiddenClass(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's .metadata of a tensor-only checkpoint contains."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _ForbiddenClass(f"{module}.{name} is not allowed in a meshlm checkpoint's .metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by the allow-list unpickler above.

    Raises CheckpointError for a class outside the allow-list; a truncated file raises _Corrupt,
    which ``reading`` reports as damage.
    """

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except _ForbiddenClass as e:
            raise CheckpointError(f"{path}: not a valid meshlm checkpoint metadata file ({e})") from None
        except (EOFError, pickle.UnpicklingError) as e:
            raise _Corrupt(f".metadata is truncated or corrupt ({e})") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorOnlyPlanner(DefaultLoadPlanner):
    """Refuses pickled (BYTE_IO) values instead of torch.load(weights_only=False)-ing them."""

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn!r} is a pickled object; "
                              f"meshlm checkpoints hold tensors only")


# ----------------------------------------------------------------------------- damaged files

_DAMAGE = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError)  # ValueError ⊇ JSON


class _Corrupt(ValueError):
    """A checkpoint file that is truncated or unparsable; the message names the file."""


def _load_json(file: str) -> Any:
    """json.load of ``file``; _Corrupt naming the file when it is not JSON."""
    with open(file) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise _Corrupt(f"{os.path.basename(file)} is not valid JSON ({e.msg} at line {e.lineno})") from None


def _reason(e: BaseException) -> str:
    """A short phrase for what was wrong with a checkpoint file."""
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{os.path.basename(str(e.filename))} is missing"
    if isinstance(e, KeyError):
        return f"entry {e} is missing"
    text = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:120]
    return text if isinstance(e, _Corrupt) else f"{type(e).__name__}: {text}" if text else type(e).__name__


def damaged(folder: str, e: BaseException, load: Optional[str] = None) -> CheckpointError:
    """The one-line CheckpointError for a checkpoint folder whose files could not be read.

    load: the --load argument to name (default: the folder's parent, the --save directory).
    """
    load = load or os.path.dirname(os.path.normpath(folder))
    return CheckpointError(f"--load {load}: checkpoint {os.path.basename(os.path.normpath(folder))} is damaged "
                           f"or incomplete ({_reason(e)}); load an earlier iteration or re-save")


@contextlib.contextmanager
def reading(folder: str, load: Optional[str] = None) -> Iterator[None]:
    """Turn any error of reading ``folder``'s files (OSError, RuntimeError, ValueError incl. JSON,
    KeyError, truncated pickle; DCP wraps them in CheckpointException) into ``damaged(...)``.
    A CheckpointError raised inside passes through unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as e:  # DCP's wrapper (a BaseException) of each rank's failure
        inner = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(inner, CheckpointError):
            raise inner from None
        if not isinstance(inner, FileNotFoundError):
            inner = _Corrupt(f"a .distcp file is unreadable: {_reason(inner)}")
        raise damaged(folder, inner, load) from None
    except _DAMAGE as e:
        raise damaged(folder, e, load) from None


def _check_storage(path: str, metadata, keys) -> None:
    """Raise FileNotFoundError / _Corrupt when a .distcp file holding one of ``keys`` is missing
    or shorter than the byte range .metadata gives for it (a stat per file, no read)."""
    wanted, sizes = set(keys), {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in wanted:
            continue
        file = os.path.join(path, info.relative_path)
        if file not in sizes:
            if not os.path.isfile(file):
                raise FileNotFoundError(errno.ENOENT, "No such file", file)
            sizes[file] = os.path.getsize(file)
        if sizes[file] < info.offset + info.length:
            raise _Corrupt(f"{info.relative_path} is truncated ({sizes[file]} bytes, "
                             f"its tensors need {info.offset + info.length})")


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


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ----------------------------------------------------------------------------- save / load

def save(root: str, iteration: int, state: dict, *, layout: Optional[dict] = None,
         config: Optional[dict] = None, coords: Optional[dict] = None) -> str:
    """Write ``state`` of every rank to ``root/iter_XXXXXXX`` atomically; return that folder.

    Collective over the default process group: every rank calls it with its own state.
    layout: e.g. {"tp": 2, "pp": 2, "dp": 1} recorded in checkpoint.json (checked on load).
    config: the run's config as a JSON-able dict (rank 0's is written).
    coords: this rank's place in the layout, e.g. {"tp": 0, "pp": 1, "dp": 0} (lets ``load``
    find the state of the rank at the same place when the world size changed).
    """
    rank, world = _world()
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left over from a crashed save of this iteration
        os.makedirs(tmp)
    _barrier()
    tensors: dict = {}
    tree = _flatten(state, "", tensors)
    _write_json(os.path.join(tmp, f"rank_{rank:05d}.json"), {"rank": rank, "coords": coords, "state": tree})
    with warnings.catch_warnings():  # DCP warns that a world of one is "assumed" single-process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=False),
                 no_dist=world == 1)
    _barrier()
    if rank == 0:
        _write_json(os.path.join(tmp, MANIFEST), {
            "format_version": FORMAT_VERSION, "iteration": iteration, "world_size": world,
            "layout": layout or {}, "torch_version": torch.__version__})
        if config is not None:
            _write_json(os.path.join(tmp, CONFIG), config)
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving an iteration: swap the old folder out first
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
    _barrier()
    return final


def checkpoint_dir(root: str, iteration: Optional[int] = None) -> str:
    """The complete checkpoint folder to load: ``iteration``'s, else the tracker's.

    Raises CheckpointError naming the folder when there is no tracker, or the folder lacks its
    manifest or DCP metadata (an interrupted save).
    """
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"--load {root}: no {TRACKER}; point --load at a folder written by --save")
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {root}: {TRACKER} names iteration {iteration} but {path} does not "
                              f"exist; write the iteration of a complete iter_XXXXXXX folder into it")
    for name in (MANIFEST, ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete ({name} not found); "
                                  f"load another iteration or start without --load")
    return path


def check_loadable(load: Optional[str], save: Optional[str] = None) -> list:
    """Problems with ``--load load`` found from the file system alone (no tensor is read), one line
    each; [] when it can be loaded, or when it is the --save directory without a checkpoint yet
    (a fresh start). A --load that does not exist is left to config.validate.

    Meant to run before workers start (config.validate) and again in the trainer.
    """
    if not load or not os.path.isdir(load):
        return []
    try:
        iteration = read_tracker(load)
    except (CheckpointError, OSError) as e:
        return [str(e) if isinstance(e, CheckpointError) else f"--load {load}: {TRACKER} unreadable ({e})"]
    if iteration is None:
        if os.path.isfile(os.path.join(load, MANIFEST)):
            return [f"--load {load} is one checkpoint's folder; point --load at its parent "
                    f"{os.path.dirname(os.path.normpath(load))} (the run's --save directory)"]
        if save and os.path.abspath(load) == os.path.abspath(save):
            return []
        what = "is empty" if not os.listdir(load) else "is not a meshlm checkpoint directory"
        return [f"--load {load} {what} (no {TRACKER}); point --load at a run's --save directory, "
                f"or give --save {load} too to start fresh there"]
    try:
        checkpoint_dir(load, iteration)
    except CheckpointError as e:
        return [str(e)]
    return []


def read_manifest(path: str) -> dict:
    """checkpoint.json of a checkpoint folder (iteration, world_size, layout)."""
    return _load_json(os.path.join(path, MANIFEST))


def read_config(path: str) -> dict:
    """config.json of a checkpoint folder; CheckpointError if it was saved without one."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} not found: the checkpoint was saved without its config")
    return _load_json(file)


def read_tensors(path: str, keys: list) -> dict:
    """Load the tensors ``keys`` of a checkpoint folder into new CPU tensors, without collectives.

    Shapes and dtypes come from the DCP metadata (read with the allow-list unpickler).
    Raises CheckpointError naming the first key the checkpoint does not hold; damaged files raise
    their own errors (FileNotFoundError, _Corrupt, RuntimeError...), for ``reading`` to report.
    """
    metadata = SafeReader(path).read_metadata()
    out = {}
    for key in keys:
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {key!r}")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    _check_storage(path, metadata, keys)
    if out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, storage_reader=SafeReader(path), planner=_TensorOnlyPlanner(), no_dist=True)
    return out


def _rank_file(path: str, world_saved: int, coords: Optional[dict]) -> str:
    """The rank JSON to read: this rank's, or (coords given) the saved rank at the same coords,
    preferring an exact match and otherwise ignoring "dp" (a resume at another DP size)."""
    rank, world = _world()
    if coords is None:
        if world_saved != world:
            raise CheckpointError(f"checkpoint {path} was saved by {world_saved} ranks, this run has {world}")
        return os.path.join(path, f"rank_{rank:05d}.json")
    loose = {k: v for k, v in coords.items() if k != "dp"}
    fallback = None
    for name in sorted(os.listdir(path)):
        if name.startswith("rank_") and name.endswith(".json"):
            saved = _load_json(os.path.join(path, name)).get("coords") or {}
            if saved == coords:
                return os.path.join(path, name)
            if fallback is None and {k: v for k, v in saved.items() if k != "dp"} == loose:
                fallback = os.path.join(path, name)
    if fallback is None:
        raise CheckpointError(f"checkpoint {path} has no rank at {loose}")
    return fallback


def load(root: str, *, layout: Optional[dict] = None, coords: Optional[dict] = None,
         iteration: Optional[int] = None) -> tuple:
    """Read this rank's state from the checkpoint the tracker (or ``iteration``) names.

    Returns (iteration, state) with state the nested dict the matching rank passed to ``save``
    (tensors on CPU). Without ``coords`` that is the rank with this rank's number (same world size
    required); with ``coords``, the saved rank at the same place (see ``_rank_file``). Each rank
    reads only what it needs (no collective). Raises CheckpointError if the checkpoint is missing,
    incomplete or damaged (one line, see ``reading``), or any key of ``layout`` differs from the
    saved layout (resharding to another TP/PP layout is not supported yet).
    """
    path = checkpoint_dir(root, iteration)
    with reading(path, root):
        manifest = read_manifest(path)
        saved = manifest.get("layout", {})
        if layout is not None and {k: saved.get(k) for k in layout} != layout:
            raise CheckpointError(f"checkpoint {path} was saved with layout {saved}; this run has {layout}: "
                                  f"resume with the saved layout (resharding on load is not supported yet)")
        tree = _load_json(_rank_file(path, manifest["world_size"], coords))["state"]
        tensors = read_tensors(path, _tensor_keys(tree))
        return manifest["iteration"], _unflatten(tree, tensors)


# ----------------------------------------------------------------------------- model config

def _architecture(m: C.ModelConfig) -> dict:
    """{field name: effective value} of the ModelConfig fields that decide the model's function and
    tensor shapes (defaults resolved, e.g. --ffn-hidden-size None → 4h). Dropout, init, sequence
    length (except as the learned position table size) may change on resume and are left out."""
    arch = {name: getattr(m, name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "normalization", "swiglu",
        "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
        "vocab_size", "make_vocab_size_divisible_by")}
    arch.update(num_query_groups=C.query_groups(m), ffn_hidden_size=C.ffn_hidden(m), kv_channels=C.head_dim(m))
    if m.position_embedding_type == "rope":
        arch["rotary_base"] = m.rotary_base
    else:
        arch["max_position_embeddings"] = C.max_positions(m)
    return arch


def check_model_config(path: str, model: C.ModelConfig, load: Optional[str] = None) -> None:
    """Compare ``model`` with the model section of the checkpoint folder's config.json.

    Raises CheckpointError, one line listing every differing architecture field as
    ``--flag saved=X now=Y`` (``--disable-bias-linear`` shown as the flag's own sense), or
    ``damaged`` when config.json is missing or unreadable.
    """
    with reading(path, load):
        if not os.path.isfile(os.path.join(path, CONFIG)):
            raise FileNotFoundError(errno.ENOENT, "No such file", os.path.join(path, CONFIG))
        try:
            saved_model = C.Config.from_dict({"model": read_config(path)["model"]}).model
        except ConfigError as e:
            raise ValueError(f"{CONFIG}: {e}") from None
    saved, now = _architecture(saved_model), _architecture(model)
    fields = {f.name: f for f in dataclasses.fields(C.ModelConfig)}
    diffs = []
    for name in (n for n in now if n in saved):  # position fields differ with the position type
        a, b = saved[name], now[name]
        if a != b:
            f = fields[name]
            if f.metadata.get("action") == "store_false":
                a, b = not a, not b
            diffs.append(f"{C.flag_of(f)} saved={a} now={b}")
    if diffs:
        raise CheckpointError(f"--load {load or os.path.dirname(os.path.normpath(path))}: checkpoint "
                              f"{os.path.basename(os.path.normpath(path))} is of another model: {', '.join(diffs)}; "
                              f"pass the saved values or start without --load")


# ----------------------------------------------------------------------------- RNG states

def rng_state() -> dict:
    """This process's RNG states (python, numpy, torch CPU, CUDA) as tensors and JSON values."""
    import random

    import numpy as np
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned (after a save/load round trip)."""
    import random

    import numpy as np
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["mt"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------- model state

def _model_key(name: str, t: torch.Tensor, ps) -> str:
    """Checkpoint key of a model tensor: its global name (``layers.<global index>.…``, the same
    in every layout), suffixed ``@tp<rank>of<tp>`` when the tensor is split over TP."""
    if getattr(t, "tensor_model_parallel", False):
        return f"{name}@tp{ps.tp_rank}of{ps.tp}"
    return name


def model_state(chunks, ps) -> dict:
    """This rank's model tensors for ``save``: {"model": {key: tensor}, "model_shards": {key:
    {"dim", "full_size", "index"}}} — for each TP-split tensor, which rows/columns of the full
    weight it holds (parallel/tensor.py's partition_index), so a full weight can be rebuilt."""
    params, shards = {}, {}
    for chunk in chunks:
        for name, t in chunk.state_dict(keep_vars=True).items():
            key = _model_key(name, t, ps)
            params[key] = t.detach()
            if getattr(t, "tensor_model_parallel", False):
                shards[key] = {"dim": t.partition_dim, "full_size": t.full_size,
                               "index": t.partition_index.detach().cpu()}
    return {"model": params, "model_shards": shards}


@torch.no_grad()
def load_model_state(chunks, ps, params: dict) -> None:
    """Copy ``params`` (the "model" subtree of a loaded state) into the chunks in place.

    Raises CheckpointError, before copying anything, when the checkpoint lacks a tensor the model
    has, holds one the model does not use, or holds one of another shape (names the first few).
    """
    targets = {_model_key(name, t, ps): t for chunk in chunks for name, t in chunk.state_dict(keep_vars=True).items()}
    missing = [k for k in targets if k not in params]
    unexpected = [k for k in params if k not in targets]
    shapes = [f"{k} {tuple(params[k].shape)} vs {tuple(t.shape)}" for k, t in targets.items()
              if k in params and params[k].shape != t.shape]
    problems = [f"{what} {len(keys)}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
                for what, keys in (("missing", missing), ("not used by the model", unexpected),
                                   ("of another shape (saved vs model)", shapes)) if keys]
    if problems:
        raise CheckpointError(f"checkpoint model tensors do not match the model ({'; '.join(problems)}): "
                              f"was it saved with another model config?")
    for key, t in targets.items():
        t.copy_(params[key])


def full_model_state(path: str, load: Optional[str] = None) -> dict:
    """{global name: full (TP=1) fp32 tensor} rebuilt from every rank of a checkpoint folder.

    Works for any TP/PP layout the checkpoint was saved with: TP shards are put back with their
    saved partition index (vocabulary padding dropped), PP stages hold disjoint global names.
    Reads rank JSONs and tensors only (no collective). Damaged files raise ``damaged(path, e,
    load)``, one line naming ``load`` (the --load argument; default the folder's parent).
    """
    with reading(path, load):
        return _full_model_state(path)


def _full_model_state(path: str) -> dict:
    trees = []
    for name in sorted(os.listdir(path)):
        if name.startswith("rank_") and name.endswith(".json"):
            tree = dict(_load_json(os.path.join(path, name))["state"]["d"])
            trees.append({"model": tree["model"], "model_shards": tree.get("model_shards", {"d": []})})
    keys = sorted({k for tree in trees for sub in tree.values() for k in _tensor_keys(sub)})
    tensors = read_tensors(path, keys)
    params, shards = {}, {}
    for tree in trees:
        params.update(_unflatten(tree["model"], tensors))
        shards.update(_unflatten(tree["model_shards"], tensors))
    full = {}
    for key, t in sorted(params.items()):
        name, t = key.split("@tp")[0], t.float()
        if key not in shards:
            full[name] = t
            continue
        dim, size, idx = shards[key]["dim"], shards[key]["full_size"], shards[key]["index"]
        if name not in full:
            shape = list(t.shape)
            shape[dim] = size
            full[name] = torch.zeros(shape)
        keep = idx < size
        full[name].index_copy_(dim, idx[keep], t.index_select(dim, keep.nonzero().squeeze(1)))
    return full
