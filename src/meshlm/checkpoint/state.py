"""What a training state puts into a checkpoint: model tensors (with their TP shard index), RNG
states, and the model architecture a resume must match.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Optional

import torch

from .. import config as C
from ..dtypes import at_least_fp32
from ..errors import CheckpointError, ConfigError
from .dist import CONFIG, _tensor_keys, _unflatten, read_config, read_tensors
from .safe_read import _load_json, reading

# ----------------------------------------------------------------------------- model config

def _architecture(m: C.ModelConfig) -> dict:
    """{field name: effective value} of the ModelConfig fields that decide the model's function and
    tensor shapes (defaults resolved, e.g. --ffn-hidden-size None → 4h). Dropout, init, sequence
    length (except as the learned position table size) may change on resume and are left out."""
    arch = {name: getattr(m, name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "normalization", "swiglu", "openai_gelu",
        "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
        "vocab_size", "make_vocab_size_divisible_by")}
    arch.update(num_query_groups=C.query_groups(m), ffn_hidden_size=C.ffn_hidden(m), kv_channels=C.head_dim(m))
    if m.position_embedding_type == "rope":
        arch.update(rotary_base=m.rotary_base, rotary_percent=m.rotary_percent)
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
        name, t = key.split("@tp")[0], at_least_fp32(t)
        if key not in shards:
            full[name] = t
            continue
        dim, size, idx = shards[key]["dim"], shards[key]["full_size"], shards[key]["index"]
        if name not in full:
            shape = list(t.shape)
            shape[dim] = size
            full[name] = torch.zeros(shape, dtype=t.dtype)
        keep = idx < size
        full[name].index_copy_(dim, idx[keep], t.index_select(dim, keep.nonzero().squeeze(1)))
    return full
