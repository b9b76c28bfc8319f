"""What a training state puts into a checkpoint: the model and the optimizer's per-parameter state
in model space (model_space.py: global names and shapes, so any TP/PP/DP layout loads any other),
RNG states, and the model architecture a resume must match.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

import torch

from .. import config as C
from ..dtypes import at_least_fp32
from ..errors import CheckpointError, ConfigError
from .architecture import architecture, difference, differs
from .dist import CONFIG, _check_format, _unflatten, rank_trees, read_config, read_manifest, read_tensors
from .model_space import ModelSpace
from .safe_read import SafeReader, reading

# ----------------------------------------------------------------------------- model config

WORD_EMBEDDING = "model/embedding.word_embeddings.weight"  # its DCP key: [vocabulary, hidden]

def check_model_config(path: str, model: C.ModelConfig, load: Optional[str] = None,
                       vocab_size: Optional[int] = None) -> None:
    """Compare ``model`` with the model section of the checkpoint folder's config.json.

    vocab_size: this run's vocabulary (its tokenizer's), compared where --vocab-size is unset; a
    saved config that left it to the tokenizer is compared by its word embedding's rows.

    Raises CheckpointError, one line listing every differing architecture field as
    ``--flag saved=X now=Y`` (``--disable-bias-linear`` shown as the flag's own sense), or
    ``damaged`` when config.json is missing or unreadable.
    """
    diffs = model_config_differences(path, model, load, vocab_size)
    if diffs:
        raise CheckpointError(f"--load {load or os.path.dirname(os.path.normpath(path))}: checkpoint "
                              f"{os.path.basename(os.path.normpath(path))} is of another model: {', '.join(diffs)}; "
                              f"pass the saved values or start without --load")


def model_config_differences(path: str, model: C.ModelConfig, load: Optional[str] = None,
                             vocab_size: Optional[int] = None) -> list:
    """``check_model_config``'s differing fields (``--flag saved=X now=Y``), [] when none; raises
    as it does for a missing or unreadable config.json."""
    with reading(path, load):
        if not os.path.isfile(os.path.join(path, CONFIG)):
            raise FileNotFoundError(errno.ENOENT, "No such file", os.path.join(path, CONFIG))
        try:
            saved_model = C.Config.from_dict({"model": read_config(path)["model"]}).model
        except ConfigError as e:
            raise ValueError(f"{CONFIG}: {e}") from None
    saved, now = architecture(saved_model), architecture(model)
    now["vocab_size"] = now["vocab_size"] or vocab_size
    saved["vocab_size"] = saved["vocab_size"] or _saved_vocab(path)
    if saved["vocab_size"] is None or now["vocab_size"] is None:
        del saved["vocab_size"]
    return [difference(name, saved[name], now[name], ("saved", "now"))  # position fields: with the position type
            for name in now if name in saved and differs(name, saved[name], now[name])]


def unused_model_tensors(path: str, read: set) -> list:
    """The model tensors the checkpoint folder holds that no rank read (``read``: the model-space
    names every rank's model loaded, together), sorted: weights a --finetune would drop."""
    with reading(path):
        keys = SafeReader(path).read_metadata().state_dict_metadata
    return sorted(k[len("model/"):] for k in keys if k.startswith("model/") and k[len("model/"):] not in read)


def _saved_vocab(path: str) -> Optional[int]:
    """The rows of the checkpoint's word embedding (its unpadded vocabulary, as model space saves
    it), read from the DCP metadata; None where that cannot be read (the load reports the damage)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        meta = SafeReader(path).read_metadata().state_dict_metadata.get(WORD_EMBEDDING)
    except Exception:  # noqa: BLE001 - any damage here is the load's to report, in its own words
        return None
    return int(meta.size[0]) if isinstance(meta, TensorStorageMetadata) else None


def changed_tokenizer(data: C.DataConfig, ids: int, rows: int) -> Optional[str]:
    """The one line saying the tokenizer a checkpoint's config names (by the run's path) is not the
    one it trained with — it gives ``ids`` ids where the checkpoint's word embedding has ``rows`` —
    or None when they agree. A replaced file would otherwise sample (generate) or export (convert
    --to-hf) through another vocabulary: the padding rows up to --make-vocab-size-divisible-by
    hide the difference from the weights' shapes."""
    if ids == rows:
        return None
    name = data.tokenizer_model or data.vocab_file or "the run's tokenizer"
    return (f"the tokenizer file {name} gives {ids:,} ids but the checkpoint's vocabulary has {rows:,}: the "
            f"file was changed since the run; put the run's tokenizer back there")


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


# ----------------------------------------------------------------------------- model and optimizer state

def model_state(space: ModelSpace, *, load: bool = False, shards: tuple = ((), ())) -> dict:
    """{"model": {key: Boxes}, "model_fused": {fused name: {"dim", "parts"}}}: views of this rank's
    model tensors in model space — what it writes, or (load) what it reads (TP-replicated
    tensors too). Loading writes straight into the model. shards: ZeRO-3's (sharded params,
    [(param, p_lo, view)] of this rank's pieces) (``DistributedDataParallel.shard_pieces``): those
    params are placed from their shards, as the optimizer's state is, so neither a save nor a load
    gathers the weights."""
    sharded, pieces = shards
    placed = {key: kinds["weight"] for key, kinds in
              space.state([(p, lo, {"weight": view}) for p, lo, view in pieces], writing=not load).items()}
    model = space.model(writing=not load, skip=sharded)
    assert not placed.keys() & model.keys(), "a tensor both whole and sharded"
    return {"model": {**model, **placed}, "model_fused": space.fused}


def optimizer_state(opt, space: ModelSpace, *, load: bool = False) -> dict:
    """The optimizer's scalars (``opt.state_dict()``) and ``"params": {key: {"master", "exp_avg",
    "exp_avg_sq": Boxes}}``: views of this rank's fp32 state (its ZeRO-1 shard, or all of it) in
    model space, so the state reshards over DP, TP and PP and nothing is gathered; loading writes
    straight into the optimizer (then call ``opt.load_state_dict`` with the scalars)."""
    return {**opt.state_dict(), "params": space.state(opt.state_pieces(), writing=not load)}


def full_model_state(path: str, load: Optional[str] = None) -> dict:
    """{global name: full (TP=1) fp32 tensor} of a checkpoint folder, named as a TP=1/PP=1 model's
    state_dict (fused tensors put back together; a tied output layer has no entry of its own).

    Works for any layout the checkpoint was saved with (the model space has global shapes).
    Reads the rank JSONs and the model tensors only (no collective). Damaged files raise
    ``damaged(path, e, load)``, one line naming ``load`` (the --load argument; default the
    folder's parent).
    """
    with reading(path, load):
        _check_format(path, read_manifest(path))
        keys = [k for k in SafeReader(path).read_metadata().state_dict_metadata if k.startswith("model/")]
        full = {k[len("model/"):]: at_least_fp32(t) for k, t in read_tensors(path, keys).items()}
        for tree in rank_trees(path).values():
            fused = dict(tree["state"]["d"]).get("model_fused")
            for name, spec in (_unflatten(fused, {}) if fused else {}).items():
                if name not in full:
                    full[name] = torch.cat([full.pop(key) for key, _ in spec["parts"]], spec["dim"])
        return dict(sorted(full.items()))
