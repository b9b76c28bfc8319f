"""Reading a DCP checkpoint folder without unpickling, and naming its damage in one line.

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
import enum
import errno
import functools
import json
import os
import pickle
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import CheckpointError, DamagedCheckpoint, clipped

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _ForbiddenClass(pickle.UnpicklingError):
    pass


# megatron-core's .metadata adds entries of pickled values (never read) and the save plans of
# every rank (``all_local_plans``): plain DCP data classes
_MEGATRON = {(_DCP_METADATA, "BytesStorageMetadata")} | {
    ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")}


def _enum_member(allowed: set, cls, name):
    """``getattr`` as an unpickler may call it: only for a member of an allowed enum. Some Pythons
    (Debian bookworm's 3.11.2) pickle an enum member as getattr(Enum, "NAME") instead of Enum(value)."""
    if isinstance(cls, enum.EnumMeta) and (cls.__module__, cls.__name__) in allowed and \
            isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise _ForbiddenClass(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not allowed "
                          f"in a meshlm checkpoint's .metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's .metadata of a tensor-only checkpoint contains (with
    ``megatron``, also the DCP classes megatron-core's .metadata adds), and their enum members by
    name (``_enum_member``)."""

    def __init__(self, fh, megatron: bool = False):
        super().__init__(fh)
        self.megatron = megatron

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return functools.partial(_enum_member, _ALLOWED | (_MEGATRON if self.megatron else set()))
        if self.megatron and (module, name) in _MEGATRON:
            return super().find_class(module, name)
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _ForbiddenClass(f"{module}.{name} is not allowed in a meshlm checkpoint's .metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by the allow-list unpickler above.

    Raises CheckpointError for a class outside the allow-list; a truncated file raises _Corrupt,
    which ``reading`` reports as damage. megatron: admit the DCP classes of a megatron-core
    folder's .metadata (entries of its pickled ``_extra_state`` values, which the planner still
    refuses to read, and the save plans).
    """

    def __init__(self, path, megatron: bool = False):
        super().__init__(path)
        self.megatron = megatron

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh, self.megatron).load()
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
    text = clipped((str(e).strip().splitlines() or [""])[0].split(". ")[0], 120)
    return text if isinstance(e, _Corrupt) else f"{type(e).__name__}: {text}" if text else type(e).__name__


def damaged(folder: str, e: BaseException, load: Optional[str] = None, flag: str = "--load") -> DamagedCheckpoint:
    """The one-line DamagedCheckpoint (a CheckpointError) for a checkpoint folder whose files could not be read.

    load: the argument to name (default: the folder's parent, the --save directory); flag: the flag
    that gave it (``--from-megatron`` for a Megatron-LM folder being converted).
    """
    load = load or os.path.dirname(os.path.normpath(folder))
    damage = f"{flag} {load}: checkpoint {os.path.basename(os.path.normpath(folder))} is damaged or incomplete " \
             f"({_reason(e)})"
    fix = "load an earlier iteration or re-save" if flag == "--load" else \
        f"give {flag} an earlier iteration's folder (iter_NNNNNNN) or re-save"
    return DamagedCheckpoint(f"{damage}; {fix}", damage)


@contextlib.contextmanager
def reading(folder: str, load: Optional[str] = None, flag: str = "--load") -> Iterator[None]:
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
        raise damaged(folder, inner, load, flag) from None
    except _DAMAGE as e:
        raise damaged(folder, e, load, flag) from None


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

