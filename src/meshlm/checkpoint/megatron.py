"""Megatron-LM torch_dist checkpoints ↔ meshlm's full weights (GPT, Llama-style, MoE).

A Megatron-LM checkpoint folder (``--save`` of pretrain_gpt.py, ``--ckpt-format torch_dist``)::

    SAVE/latest_checkpointed_iteration.txt   the iteration (or ``release``)
    SAVE/iter_0000100/metadata.json          {"sharded_backend": "torch_dist", ...}
    SAVE/iter_0000100/common.pt              args (Namespace), iteration, ... (megatron_common.py)
    SAVE/iter_0000100/.metadata, __R_W.distcp  DCP: every sharded tensor at its full size

Tensors are stored at their global (TP=1, PP=1, EP=1) size whatever layout saved them, the
per-layer ones stacked on a leading layer axis ``[L, …]`` (``decoder.layers.…``), so reading
needs no knowledge of the saving layout. Names are Transformer Engine's (the local spec maps its
own to them): a layer's input norm is ``self_attention.linear_qkv.layer_norm_weight``, the MLP's
norm ``mlp.linear_fc1.layer_norm_weight`` (TE's MoE layers: ``pre_mlp_layernorm.weight``).

Layouts that differ from meshlm's (``parallel.tensor``'s full weights):
- QKV rows are interleaved per query group: for each group j of g, [its a/g query heads; its key
  head; its value head], each head d rows; meshlm's are [Q (a·d); K (g·d); V (g·d)].
- SwiGLU fc1 is [gate; up] as meshlm's; with ``singleton_local_shards`` it is split into
  ``…weight_w`` (gate) and ``…weight_v`` (up).
- Routed experts are stacked ``mlp.experts.experts.linear_fc1.weight [L, E, …]`` (SequentialMLP,
  GroupedMLP and TEGroupedMLP all save this), or, under megatron-core's ``singleton_local_shards``
  (the other layout), one key per layer and expert: ``decoder.layers.{i}.mlp.experts.experts.{e}.
  linear_fc1.weight_w`` … (every per-layer tensor then has its own ``decoder.layers.{i}.`` key).
- The vocabulary is padded (``--make-vocab-size-divisible-by`` × TP); meshlm keeps the unpadded
  rows.
``_extra_state`` entries (pickled bytes, TE's FP8 state) are never read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import torch

from .. import config as C
from ..errors import CheckpointError, ConfigError
from .architecture import architecture

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
COMMON = "common.pt"
_STACK = "decoder.layers."


# ----------------------------------------------------------------------------- the folder

def iteration_folder(path: str) -> Optional[str]:
    """The ``iter_NNNNNNN`` (or ``release``) folder of a Megatron torch_dist checkpoint: ``path``
    itself, or the one its tracker names; None when ``path`` is no Megatron checkpoint."""
    if not path or not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, METADATA)) and os.path.isfile(os.path.join(path, COMMON)):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as fh:
        text = fh.read().strip()
    folder = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "")
    return folder if os.path.isfile(os.path.join(folder, METADATA)) else None


def saved_iterations(path: str) -> list:
    """The ``iter_NNNNNNN`` folders in ``path`` that hold a Megatron iteration (metadata.json and
    common.pt), oldest first."""
    names = sorted(n for n in os.listdir(path) if re.fullmatch(r"iter_\d{7}", n))
    return [n for n in names if os.path.isfile(os.path.join(path, n, METADATA))
            and os.path.isfile(os.path.join(path, n, COMMON))]


def tracker_problem(path: str) -> Optional[str]:
    """The line for a Megatron save folder whose tracker names an iteration it does not hold (a copy
    without the newest iteration, a save stopped while writing it) beside ones it does; else None."""
    tracker = os.path.join(path, TRACKER)
    if not os.path.isdir(path) or not os.path.isfile(tracker) or iteration_folder(path) is not None:
        return None
    saved = saved_iterations(path)
    if not saved:
        return None
    with open(tracker) as fh:
        named = fh.read().strip()
    last = saved[-1]
    return (f"{tracker} names iteration {named!r}, which {path} does not hold (no complete folder with "
            f"{METADATA} and {COMMON}); it holds {', '.join(saved)}: give the folder {os.path.join(path, last)} "
            f"itself, or write {int(last[5:])} into {tracker}")


def is_megatron_folder(path: Optional[str]) -> bool:
    """True when ``path`` is a Megatron-LM checkpoint (its save folder or one iteration)."""
    return iteration_folder(path) is not None


def convert_first(named: str, save: str) -> str:
    """The line for a Megatron-LM checkpoint given where a meshlm one is wanted: ``named`` as the
    message calls it (``--load DIR``, or DIR), ``save`` the save folder `meshlm convert` reads."""
    return (f"{named} is a Megatron-LM checkpoint, not a meshlm one; convert it first: meshlm convert "
            f"--from-megatron {save} --output CKPT_DIR, then --load CKPT_DIR")


def check_backend(folder: str) -> None:
    """Raise CheckpointError unless metadata.json says torch_dist (the only format read)."""
    try:
        with open(os.path.join(folder, METADATA)) as fh:
            backend = json.load(fh).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{folder}/{METADATA}: unreadable ({e})") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{folder}: sharded_backend {backend!r}; meshlm reads torch_dist checkpoints: "
                              f"convert it with Megatron-LM's tools/checkpoint (--ckpt-convert-format torch_dist)")


# ----------------------------------------------------------------------------- flags

# Megatron-LM args that change the model's function in a way meshlm's model cannot compute, with
# the values besides None and False that leave it unchanged (an arg a Megatron version lacks is fine).
_REFUSED = {"rotary_interleaved": (), "multi_latent_attention": (), "squared_relu": (),
            "quick_geglu": (), "moe_shared_expert_gate": (), "num_experts_per_group": (),
            "apply_residual_connection_post_layernorm": (), "use_rope_scaling": (),
            "rotary_seq_len_interpolation_factor": (1,), "no_rope_freq": (), "window_size": (),
            "softmax_type": ("vanilla",), "qk_l2_norm": (), "attention_output_gate": (), "glu_linear_offset": (0,),
            "activation_func_clamp_value": (), "experimental_attention_variant": (), "linear_attention_freq": (),
            "heterogeneous_layers_config_path": (), "enable_mhc_connections": (),
            "moe_router_topk_scaling_factor": (1,), "moe_router_group_topk": (0,),
            "moe_router_topk_limited_devices": (0,), "moe_apply_probs_on_input": (), "moe_latent_size": ()}
# meshlm field ← the TransformerConfig field Megatron-LM saves it under since its args are generated
# from TransformerConfig (2026-01, megatron/training/argument_utils.py: dest = the field's name);
# earlier versions saved meshlm's names
_RENAMED = {"norm_epsilon": "layernorm_epsilon", "apply_layernorm_1p": "layernorm_zero_centered_gamma"}


def model_from_args(args) -> C.ModelConfig:
    """The ModelConfig of a Megatron-LM run's ``args`` (common.pt's Namespace): every field meshlm
    shares with Megatron-LM (the same names and meanings, --bias-gelu-fusion included; --norm-epsilon
    and --apply-layernorm-1p under either version's name, ``_RENAMED``) taken from it.

    Raises CheckpointError naming the first arg whose function meshlm lacks (an interleaved or
    scaled rotary, MLA, squared ReLU, sliding-window attention, post-layernorm
    residuals, …), or a choice meshlm's model lacks (--position-embedding-type yarn, --normalization
    L2Norm, …). A setting of how the run ran that meshlm does not take (--cp-comm-type a2a) is left out.
    """
    for name, fine in _REFUSED.items():
        value = getattr(args, name, None)
        if value is not None and value is not False and value not in fine:
            raise CheckpointError(f"the Megatron checkpoint was trained with --{name.replace('_', '-')} "
                                  f"({value}); meshlm's model has no such option")
    fields = {}
    for f in dataclasses.fields(C.ModelConfig):
        value = getattr(args, f.name, None)
        if f.name in _RENAMED and getattr(args, _RENAMED[f.name], None) is not None:
            value = getattr(args, _RENAMED[f.name])
        if value is not None:
            fields[f.name] = value
    if isinstance(fields.get("moe_layer_freq"), (int, list)):
        freq = fields["moe_layer_freq"]
        fields["moe_layer_freq"] = str(freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"
    for name in ("moe_aux_loss_coeff", "cp_comm_type"):
        if isinstance(fields.get(name), list):
            fields[name] = fields[name][0]
    if not getattr(args, "num_experts", None):
        fields.pop("num_experts", None)
    if fields.get("cp_comm_type") == "allgather":  # Megatron's spelling of meshlm's all_gather
        fields["cp_comm_type"] = "all_gather"
    function = set(architecture(C.ModelConfig())) | set(architecture(C.ModelConfig(
        num_experts=2, use_mup=True, position_embedding_type="rope")))
    for f in [f for f in dataclasses.fields(C.ModelConfig) if f.name in fields]:
        try:  # meshlm's type and choices: config.json is read back by every later command
            fields[f.name] = C._coerce(f, fields[f.name], "common.pt")
        except ConfigError:
            if f.name in function:
                choices = ", ".join(f.metadata.get("choices") or []) or "other values"
                raise CheckpointError(f"the Megatron checkpoint was trained with {C.flag_of(f)} {fields[f.name]}; "
                                      f"meshlm's model computes {choices}") from None
            # how it ran, not what it computes (--cp-comm-type a2a, --moe-router-dtype fp64): the run's own
            # flags decide; kept, it made the converted checkpoint's config.json unreadable
            del fields[f.name]
    return C.ModelConfig(**fields)


def data_from_args(args) -> dict:
    """The tokenizer fields of meshlm's DataConfig that a Megatron run's ``args`` names."""
    kind = getattr(args, "tokenizer_type", None)
    if kind not in C.TOKENIZER_TYPES:
        return {}
    out = {"tokenizer_type": kind}
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, name, None):
            out[name] = str(getattr(args, name))
    return out


# ----------------------------------------------------------------------------- names

def _qkv_from_megatron(t: torch.Tensor, a: int, g: int, d: int) -> torch.Tensor:
    """[g·(a/g + 2)·d, …] per-query-group rows → meshlm's [Q (a·d); K (g·d); V (g·d)]."""
    rest, r = t.shape[1:], a // g
    x = t.reshape(g, r + 2, d, *rest)
    return torch.cat([x[:, :r].reshape(a * d, *rest), x[:, r].reshape(g * d, *rest),
                      x[:, r + 1].reshape(g * d, *rest)])


def _qkv_to_megatron(t: torch.Tensor, a: int, g: int, d: int) -> torch.Tensor:
    """The inverse of ``_qkv_from_megatron``."""
    rest, r = t.shape[1:], a // g
    q, k, v = t.split([a * d, g * d, g * d])
    return torch.cat([q.reshape(g, r, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)],
                     1).reshape(t.shape)


_LAYER = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
          "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
          "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
          "pre_mlp_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias")}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def _sources(name: str, keys: set) -> list:
    """Where the meshlm full tensor ``name`` lies in a Megatron checkpoint with DCP ``keys``:
    [(key, index into the stacked tensor)] (two: singleton_local_shards' w and v halves of a
    SwiGLU fc1, joined on the row axis), the first candidate whose keys exist; [] when none does."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m:
        key = {"final_layernorm.weight": "decoder.final_layernorm.weight",
               "final_layernorm.bias": "decoder.final_layernorm.bias"}.get(name, name)
        return [(key, ())] if key in keys else []
    i, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e:
        expert, mod, kind = e.groups()
        local = [(f"mlp.experts.experts.{mod}.{kind}", (int(expert),)),  # stacked on the expert axis
                 (f"mlp.experts.experts.{expert}.{mod}.{kind}", ())]
    else:
        local = [(k, ()) for k in _LAYER.get(rest, (rest,))]
    # stacked on the layer axis, or (singleton_local_shards) one key per layer
    candidates = [(_STACK + k, (i,) + index) for k, index in local] + \
        [(f"{_STACK}{i}.{k}", index) for k, index in local]
    for key, index in candidates:
        if key in keys:
            return [(key, index)]
        if f"{key}_w" in keys and f"{key}_v" in keys:  # singleton_local_shards' split SwiGLU fc1
            return [(f"{key}_w", index), (f"{key}_v", index)]
    return []


def optimizer_states(folder: str) -> list:
    """The per-parameter optimizer states a Megatron folder holds in model space, e.g. ["exp_avg",
    "exp_avg_sq", "param"]: ``optimizer.state.{state}.{model key}`` tensors, laid out as the model
    key (the distributed optimizer's fully_reshardable format: "param" is the fp32 master; the
    plain optimizer's: "fp32_param" under mixed precision, none in fp32)."""
    from .safe_read import SafeReader, reading
    with reading(folder, flag="--from-megatron"):
        keys = SafeReader(folder, megatron=True).read_metadata().state_dict_metadata
    found = sorted({k.split(".")[2] for k in keys if k.startswith(OPTIMIZER_STATE)})
    if not found and any(k.startswith("optimizer.distributed.") for k in keys):
        return [BUCKETS]  # flat per-bucket tensors (megatron_buckets.py)
    return found


OPTIMIZER_STATE = "optimizer.state."
BUCKETS = "dp_reshardable buckets"


def read_full(folder: str, names: dict, m: C.ModelConfig, vocab: int, state: str = "") -> dict:
    """{meshlm global name: full tensor} for ``names`` ({name: full shape}, e.g. a TP=1 model's
    ``hf.full_shapes``) from the Megatron torch_dist ``folder``: QKV de-interleaved, split fc1
    joined, the vocabulary cut to ``vocab`` rows. Reads only the boxes named (one layer's slice of
    each stacked tensor); nothing is unpickled. state: an optimizer state of ``optimizer_states``
    (its tensors, laid out as the weights), "" for the weights.

    Raises CheckpointError naming a tensor the checkpoint lacks, or one of another shape.
    """
    from .boxes import Boxes
    from .safe_read import SafeReader, reading
    prefix = f"{OPTIMIZER_STATE}{state}." if state else ""
    with reading(folder, flag="--from-megatron"):
        meta = SafeReader(folder, megatron=True).read_metadata().state_dict_metadata
        meta = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}
        sizes = {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}
        plan, targets, pieces = {}, {}, {}
        for name in names:
            src = _sources(name, set(sizes))
            if not src:
                raise CheckpointError(f"{folder}: has no tensor for meshlm's {name}; a model other than its "
                                      f"common.pt args say, or a layer kind meshlm lacks?")
            plan[name] = src
            for key, index in src:
                shape = sizes[key]
                part = torch.empty(shape[len(index):], dtype=meta[key].properties.dtype)
                offset = tuple(index) + (0,) * len(part.shape)
                pieces.setdefault(key, []).append((offset, part.view((1,) * len(index) + part.shape)))
                targets[(name, key)] = part
        for key, found in pieces.items():
            read_boxes(folder, prefix + key, Boxes(sizes[key], found))
    out = {}
    for name, src in plan.items():
        parts = [targets[(name, key)] for key, _ in src]
        t = torch.cat(parts, -2 if name.endswith("weight") else -1) if len(parts) > 1 else parts[0]
        t = from_megatron_layout(name, t, m, vocab)
        if tuple(t.shape) != tuple(names[name]):
            raise CheckpointError(f"{folder}: {name} is {list(t.shape)} there, the model's {list(names[name])}; "
                                  f"are common.pt's args this model's?")
        out[name] = t
    return out


def from_megatron_layout(name: str, t: torch.Tensor, m: C.ModelConfig, vocab: int) -> torch.Tensor:
    """The full tensor of meshlm's ``name`` from Megatron's full layout ``t``: QKV rows
    de-interleaved, the vocabulary cut to ``vocab`` rows."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        t = _qkv_from_megatron(t, m.num_attention_heads, C.query_groups(m), C.head_dim(m))
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = t[:vocab]
    return t


def read_boxes(folder: str, key: str, boxes) -> None:
    """DCP-read the boxes of one tensor of a Megatron folder (its .metadata holds byte entries)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from .safe_read import SafeReader, _TensorOnlyPlanner
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: boxes}, storage_reader=SafeReader(folder, megatron=True), planner=_TensorOnlyPlanner(),
                 no_dist=True)


def to_megatron(full: dict, m: C.ModelConfig, padded_vocab: int) -> dict:
    """{Megatron key: Boxes} of meshlm's full weights ({global name: tensor}), for DCP to write as
    Megatron saves them: per-layer tensors as slices [i] of a stacked [L, …] tensor (routed experts
    [i, e] of [L, E, …]), QKV interleaved per query group, the vocabulary zero-padded to
    ``padded_vocab`` rows, norms under TE's names. A tied output layer has no entry (Megatron
    saves the embedding once)."""
    from .boxes import Boxes
    a, g, d = m.num_attention_heads, C.query_groups(m), C.head_dim(m)
    pieces: dict = {}
    for name, t in full.items():
        if name.endswith("router.expert_bias") and not m.moe_router_enable_expert_bias:
            continue  # meshlm's router always keeps the buffer; Megatron's only under the flag
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        layer = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if not layer:
            key = "decoder." + name if name.startswith("final_layernorm.") else name
            pieces[key] = ((), [((0,) * t.dim(), t.contiguous())])
            continue
        i, rest = int(layer.group(1)), layer.group(2)
        if rest.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            t = _qkv_to_megatron(t, a, g, d)
        e = _EXPERT.match(rest)
        key, index, lead = (f"{_STACK}mlp.experts.experts.{e.group(2)}.{e.group(3)}", (i, int(e.group(1))),
                            (m.num_layers, m.num_experts)) if e else \
            (_STACK + _LAYER.get(rest, (rest,))[0], (i,), (m.num_layers,))
        view = t.contiguous().view((1,) * len(index) + tuple(t.shape))
        pieces.setdefault(key, (lead, []))[1].append((index + (0,) * t.dim(), view))
    return {key: Boxes(lead + tuple(found[0][1].shape[len(lead):]), found) for key, (lead, found) in pieces.items()}


_LINEARS = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight", ".linear_fc2.weight")


def extra_states(tensors: dict) -> dict:
    """{key: [None]} of the ``_extra_state`` entries megatron-core's linear layers save beside the
    tensors of ``to_megatron`` (``tensors``): one per layer (and expert) of each linear layer,
    ``…linear_proj._extra_state/shard_{layer}_{L}`` (``shard_{layer}.{expert}_{L}.{E}``), each
    [None] (DCP pickles it): no FP8 metadata, what megatron-core's own layers hold outside FP8,
    so dist_checkpointing.load finds every object it asks for."""
    out = {}
    for key, boxes in tensors.items():
        if not (key.startswith(_STACK) and key.endswith(_LINEARS)):
            continue
        lead = len(boxes.shape) - 2  # the layer (and expert) axes before a [rows, columns] weight
        total = ".".join(str(n) for n in boxes.shape[:lead])
        for offset, _ in boxes.pieces:
            at = ".".join(str(i) for i in offset[:lead])
            out[f"{key[:-len('.weight')]}._extra_state/shard_{at}_{total}"] = [None]
    return out
