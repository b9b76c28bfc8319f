"""The distributed optimizer's ``dp_reshardable`` state → Adam's state per parameter (full tensors).

``dp_reshardable`` is what Megatron-LM saves under ``--use-distributed-optimizer --ckpt-format
torch_dist`` unless ``--dist-ckpt-optim-fully-reshardable`` (megatron-core 0.16.1
``DistributedOptimizer.sharded_param_state_dp_reshardable``). Its DCP entries, per model-parallel
rank r = pp_rank · TP + tp_rank (the rank in megatron-core's model-parallel group)::

    optimizer.distributed.dp_group_idx_{r}.gbuf_idx_{b}.dtype_({param dtype}, {grad dtype}).bucket_idx_{k}.{s}
        one flat tensor [numel_unpadded] per grad-buffer bucket and state s (param: the fp32
        master; exp_avg, exp_avg_sq), at every DP size the same (DP only shards it)
    optimizer.distributed.dp_group_idx_{r}.per_bucket_numel_unpadded/shard_0_1
        pickled [[{(param dtype, grad dtype): [numel_unpadded of each bucket]}]] (one per buffer)
    optimizer.distributed.dp_group_idx_{r}.optimizer/shard_0_1
        pickled [{"param_groups": [{..., "lr", "step"}]}]: Adam's step lives here

A bucket holds that rank's TP shards of its parameters (megatron-core param_and_grad_buffer.py):
the parameters in reverse registration order (``model.parameters()``), each starting at a
multiple of 64 elements, a new bucket when one reaches ``--ddp-bucket-size`` (none without
``--overlap-grad-reduce``) and around a pipeline-shared embedding. The bucket sizes in the
checkpoint give the breaks, so only the registration order is assumed. Two are known: the local
spec's (``input_layernorm`` before ``linear_proj`` before ``linear_qkv``; checked against
megatron-core on CPU) and Transformer Engine's (the norms inside ``linear_qkv``/``linear_fc1``,
registered before their weights; from TE's source, not run here). Each is tried and kept only
if the fp32 masters it reads equal the checkpoint's weights, so a layout it misreads is refused,
never imported.
"""

from __future__ import annotations

import io
import re
import warnings

import torch

from .. import config as C
from ..errors import CheckpointError

PREFIX = "optimizer.distributed."
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)\.bucket_idx_(\d+)"
                     r"\.(\w+)$")
_ALIGN = 64  # a parameter starts at a multiple of 64 elements (128-byte aligned at 16 bits)

# one layer's parameters in registration order (meshlm's names, the layer prefix left out)
_ATTN = ["self_attention.linear_proj.weight", "self_attention.linear_proj.bias"]
_QKV = ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",  # then --qk-layernorm's norms
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias"]
_MLP = ["mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
_NORM1 = ["input_layernorm.weight", "input_layernorm.bias"]
_NORM2 = ["pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"]
ORDERS = {"local": _NORM1 + _ATTN + _QKV + _NORM2 + _MLP,
          "transformer_engine": _ATTN + _NORM1 + _QKV + _NORM2 + _MLP}

_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
         "linear_fc1.weight", "linear_fc1.bias")  # column-parallel: TP splits dim 0
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: TP splits dim 1


def _stage_params(names: dict, args, pp_rank: int) -> list:
    """[(meshlm name or None, name of its full tensor)] of pipeline stage ``pp_rank`` of a
    megatron-core GPTModel in registration order ("{order}" stands for a layer's own list, see
    ``ORDERS``). A tied output layer on the last of several stages (its own copy of the
    embedding) reads as (None, the embedding). Layers split evenly: num_layers / PP per stage."""
    pp, layers = int(getattr(args, "pipeline_model_parallel_size", 1) or 1), args.num_layers
    per = layers // pp
    out = [(n, n) for n in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
           if pp_rank == 0 and n in names]
    out += [(f"layers.{i}.{{order}}", None) for i in range(pp_rank * per, (pp_rank + 1) * per)]
    if pp_rank == pp - 1:
        out += [(n, n) for n in ("final_layernorm.weight", "final_layernorm.bias") if n in names]
        if "output_layer.weight" in names:
            out.append(("output_layer.weight", "output_layer.weight"))
        elif pp > 1:
            out.append((None, "embedding.word_embeddings.weight"))
    return out


def _ordered(names: dict, args, pp_rank: int, order: list) -> list:
    """``_stage_params`` with each layer expanded by ``order`` to the names the model has."""
    out = []
    for name, full in _stage_params(names, args, pp_rank):
        if name and name.endswith("{order}"):
            prefix = name[:-len("{order}")]
            out += [(prefix + n, prefix + n) for n in order if prefix + n in names]
        else:
            out.append((name, full))
    return out


def _split(name: str) -> int:
    """The dim TP splits in the full tensor ``name`` (Megatron's layout), -1 when replicated."""
    if name.endswith(_ROWS):
        return 0
    return 1 if name.endswith(_COLUMNS) else -1


def _place(full: torch.Tensor, name: str, flat: torch.Tensor, tp: int, rank: int, swiglu: bool) -> None:
    """Copy TP rank ``rank``'s shard ``flat`` (its elements in the rank's own shape) into the full
    tensor: dim-0 or dim-1 slices; a SwiGLU fc1's shard is [gate_r; up_r] of [gate; up]."""
    dim = _split(name)
    if dim < 0:
        full.copy_(flat.view(full.shape))
        return
    shape = list(full.shape)
    shape[dim] //= tp
    local = flat.view(shape)
    if swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        half = shape[0] // 2
        full[rank * half:(rank + 1) * half].copy_(local[:half])
        n = full.shape[0] // 2
        full[n + rank * half:n + (rank + 1) * half].copy_(local[half:])
        return
    full.narrow(dim, rank * shape[dim], shape[dim]).copy_(local)


def _layout(params: list, shapes: dict, tp: int, sizes: list) -> list:
    """[(name, full name, bucket, offset, numel)] of one buffer: ``params`` [(name, full name)] in
    registration order, walked backwards as megatron-core fills its buffer; ``sizes`` the
    buckets' unpadded sizes (the checkpoint's), which end a bucket exactly where it ends."""
    out, bucket, at = [], 0, 0
    for name, full in reversed(params):
        numel = torch.Size(shapes[full]).numel() // (tp if _split(full) >= 0 else 1)
        at = -(-at // _ALIGN) * _ALIGN
        if at and bucket < len(sizes) and at == sizes[bucket]:  # a shared embedding opens a bucket
            bucket, at = bucket + 1, 0
        out.append((name, full, bucket, at, numel))
        at += numel
        if bucket < len(sizes) and at == sizes[bucket]:
            bucket, at = bucket + 1, 0
    if bucket != len(sizes):
        raise _Mismatch(f"the buckets' sizes {sizes} do not fit the parameters")
    return out


class _Mismatch(Exception):
    """The buckets do not follow the layout tried."""


def _objects(folder: str, keys: list) -> dict:
    """The pickled values ``keys`` of a Megatron folder, each unpickled with weights_only=True
    (plain containers, numbers, strings and torch dtypes: no code runs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .safe_read import SafeReader
    got = {}

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            got[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({k: io.BytesIO() for k in keys}, storage_reader=SafeReader(folder, megatron=True), planner=Planner(),
                 no_dist=True)
    return got


def read(folder: str, names: dict, m: C.ModelConfig, args, weights: dict, to_meshlm) -> tuple:
    """({"param"|"exp_avg"|"exp_avg_sq": {meshlm name: full tensor}}, (step, lr)) from the
    dp_reshardable buckets of the Megatron torch_dist ``folder``. ``names``: {meshlm
    name: full shape} of the model; ``weights``: the checkpoint's weights read for those names
    (meshlm's layout), which the masters must equal; ``to_meshlm(name, t)``: Megatron's full
    layout → meshlm's (QKV order, vocabulary cut).

    Raises CheckpointError (one line) when the buckets are not a dense model's in one of
    ``ORDERS`` (MoE's expert buffers, virtual or uneven pipeline stages, another layout).
    """
    from .safe_read import SafeReader, reading
    with reading(folder, flag="--from-megatron"):
        meta = SafeReader(folder, megatron=True).read_metadata().state_dict_metadata
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    for flag in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout", "num_experts"):
        if getattr(args, flag, None):
            raise CheckpointError(f"its distributed-optimizer buckets (dp_reshardable) are read for dense models "
                                  f"on even pipeline stages; this run has --{flag.replace('_', '-')}")
    if args.num_layers % pp:
        raise CheckpointError(f"its {args.num_layers} layers do not split evenly over PP {pp}")
    buckets = {}
    for key in meta:
        hit = _BUCKET.match(key)
        if hit:
            r, b, _, k, state = hit.groups()
            buckets.setdefault(int(r), {}).setdefault(int(b), {}).setdefault(int(k), {})[state] = key
    if sorted(buckets) != list(range(tp * pp)) or any(list(g) != [0] for g in buckets.values()):
        raise CheckpointError(f"its optimizer buckets are of model-parallel ranks {sorted(buckets)} and buffers "
                              f"{sorted({b for g in buckets.values() for b in g})}; TP {tp} × PP {pp} dense ranks "
                              f"with one buffer each are read")
    sizes_keys = [f"{PREFIX}dp_group_idx_{r}.per_bucket_numel_unpadded/shard_0_1" for r in buckets]
    with reading(folder, flag="--from-megatron"):
        objects = _objects(folder, sizes_keys + [f"{PREFIX}dp_group_idx_0.optimizer/shard_0_1"])
    flats = _flats(folder, buckets, meta)
    shapes = dict(names)
    padded = int(getattr(args, "padded_vocab_size", 0) or names["embedding.word_embeddings.weight"][0])
    for n in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if n in shapes:
            shapes[n] = (padded,) + tuple(shapes[n][1:])
    problems = []
    for order_name, order in ORDERS.items():
        try:
            states = _assemble(flats, buckets, objects, shapes, names, args, order, tp, m.swiglu, to_meshlm)
        except _Mismatch as e:
            problems.append(f"{order_name}: {e}")
            continue
        bad = [n for n, w in weights.items() if not torch.equal(states["param"][n].to(w.dtype), w)]
        if not bad:
            return states, _step_and_lr(objects[f"{PREFIX}dp_group_idx_0.optimizer/shard_0_1"])
        problems.append(f"{order_name}: its masters are not the weights of {bad[0]}")
    raise CheckpointError(f"its distributed-optimizer buckets follow no parameter order meshlm knows "
                          f"({'; '.join(problems)})")


def _step_and_lr(saved) -> tuple:
    """(Adam's step, lr) from the pickled optimizer state dict of model-parallel rank 0."""
    try:
        group = saved[0]["param_groups"][0]
        return int(float(group["step"])), float(group["lr"])
    except (IndexError, KeyError, TypeError, ValueError):
        raise CheckpointError("its optimizer's param groups hold no Adam step") from None


def _flats(folder: str, buckets: dict, meta: dict) -> dict:
    """{DCP key: flat bucket tensor} of every bucket and state (read once for every order tried)."""
    from .boxes import Boxes
    from .megatron import read_boxes
    from .safe_read import reading
    out = {}
    with reading(folder, flag="--from-megatron"):
        for by_buffer in buckets.values():
            for keys in by_buffer[0].values():
                for key in keys.values():
                    out[key] = torch.empty(tuple(meta[key].size), dtype=meta[key].properties.dtype)
                    read_boxes(folder, key, Boxes(tuple(meta[key].size), [((0,), out[key])]))
    return out


def _assemble(flats, buckets, objects, shapes, names, args, order, tp, swiglu, to_meshlm) -> dict:
    """{state: {meshlm name: full tensor}} from every model-parallel rank's buckets laid out by ``order``."""
    states = {}
    for r, by_buffer in sorted(buckets.items()):
        tp_rank, pp_rank = r % tp, r // tp
        (sizes,) = objects[f"{PREFIX}dp_group_idx_{r}.per_bucket_numel_unpadded/shard_0_1"][0][0].values()
        layout = _layout(_ordered(names, args, pp_rank, order), shapes, tp, list(sizes))
        for k, keys in by_buffer[0].items():
            for state, key in keys.items():
                flat = flats[key]
                for name, full, bucket, at, numel in layout:
                    if bucket != k or name is None:
                        continue
                    target = states.setdefault(state, {})
                    if name not in target:
                        target[name] = torch.zeros(shapes[full], dtype=flat.dtype)
                    _place(target[name], full, flat[at:at + numel], tp, tp_rank, swiglu)
    missing = [s for s in ("param", "exp_avg", "exp_avg_sq") if set(states.get(s, {})) != set(names)]
    if missing:
        raise _Mismatch(f"no {missing[0]} for every parameter")
    return {s: {n: to_meshlm(n, t) for n, t in by_name.items()} for s, by_name in states.items()}
