"""Reading a Megatron-LM checkpoint's ``common.pt`` without running arbitrary pickle code.

Megatron-LM's torch_dist checkpoint keeps its non-sharded values in ``iter_NNNNNNN/common.pt``
(torch.save): ``args`` (an ``argparse.Namespace`` of every flag, holding megatron enums such as
``ModelType`` and ``AttnBackend``), ``iteration``, ``checkpoint_version`` (3.0),
``opt_param_scheduler``, ``rerun_state_machine``, …

``read_common`` loads it with ``torch.load(weights_only=True)`` and admits, beyond what that
loader already allows (tensors, dtypes, containers, numbers, strings):
- ``argparse.Namespace``, ``types.SimpleNamespace``, ``pathlib`` paths, ``signal.Signals`` (plain
  data: building them runs no code of the file's choosing);
- every class of a ``megatron.`` module as a stub (``MegatronObject``): the stub records the
  class name, its constructor arguments and state, and runs nothing, so no megatron code is
  imported or executed (megatron need not be installed).
Any other global (``os.system``, ``builtins.eval``, a class from elsewhere) is refused, one line
naming it, before anything is unpickled (``torch.serialization.get_unsafe_globals_in_checkpoint``
lists the globals from the pickle opcodes without running them).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import types

import torch

from ..errors import CheckpointError

_PLAIN = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace,
          "pathlib.PosixPath": pathlib.PosixPath, "pathlib.PurePosixPath": pathlib.PurePosixPath,
          "signal.Signals": signal.Signals}


class MegatronObject:
    """A stand-in for an object of a megatron class read from common.pt: ``fqn`` its class,
    ``args`` what its constructor got (an enum's value), ``state`` what was set on it."""

    fqn = "megatron"

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        """An enum's value (its one constructor argument), else None."""
        return self.args[0] if len(self.args) == 1 else None

    def __repr__(self) -> str:
        return f"<{self.fqn}{self.args if self.args else ''}>"


def _stub(fqn: str) -> type:
    return type(fqn.rsplit(".", 1)[-1], (MegatronObject,), {"fqn": fqn, "__module__": fqn.rsplit(".", 1)[0]})


def read_common(path: str) -> dict:
    """The dict saved in a Megatron checkpoint's ``common.pt`` at ``path`` (see the module
    docstring for what is admitted; megatron objects come back as ``MegatronObject`` stubs).

    Raises CheckpointError (one line) for a global outside the allow-list, or a file that is
    not a readable torch.save archive.
    """
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # zipfile / pickle errors of a damaged file
        raise CheckpointError(f"{path}: not a readable Megatron common.pt ({e})") from None
    refused = [g for g in found if g not in _PLAIN and not g.startswith("megatron.")]
    if refused:
        raise CheckpointError(f"{path}: refused to load: it would run {', '.join(refused[:3])} "
                              f"(a Megatron common.pt holds only its args, numbers and megatron enums)")
    allowed = [(_PLAIN[g], g) if g in _PLAIN else (_stub(g), g) for g in found]
    try:
        with torch.serialization.safe_globals(allowed):
            out = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and the like: the file is damaged or foreign
        raise CheckpointError(f"{path}: not a readable Megatron common.pt ({str(e).splitlines()[0]})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: holds a {type(out).__name__}, not Megatron's dict of common values")
    return out
