"""Hugging Face safetensors weights ↔ meshlm's full weights, for Llama, Mistral, Mixtral, Qwen2,
Qwen3 and GPT-2.

One table (``rules``) says which Hugging Face tensors make each meshlm tensor; import and
export both read it. meshlm's full (TP=1) weights are those of ``parallel.tensor.
gather_full_state_dict`` and ``checkpoint.state.full_model_state``: global names, vocabulary
unpadded, fused QKV rows [Q (a·d); K (g·d); V (g·d)], fused SwiGLU fc1 rows [gate; up].

- Llama / Mistral (``model.layers.{i}.``): q_proj, k_proj, v_proj [·, h] stacked into linear_qkv;
  o_proj → linear_proj; gate_proj, up_proj stacked into linear_fc1; down_proj → linear_fc2;
  input_layernorm, post_attention_layernorm (→ pre_mlp_layernorm); model.embed_tokens,
  model.norm, lm_head (absent when tied). Query head j reads key/value head j // (a/g) in both.
- Qwen2: as Llama, with q_proj/k_proj/v_proj biases stacked into linear_qkv.bias (--add-qkv-bias).
  Qwen3: as Llama, with self_attn.q_norm / k_norm → self_attention.q_layernorm / k_layernorm
  (--qk-layernorm).
- Mixtral: as Mistral, the MLP an MoE (``block_sparse_moe.``, the layout transformers writes):
  gate → mlp.router; experts.{e}.w1 (gate), w3 (up) stacked into
  mlp.experts.local_experts.{e}.linear_fc1, w2 → its linear_fc2 (experts under global indices).
- GPT-2 (``transformer.h.{i}.``): Conv1D weights are [in, out] (y = x W + b), so each is
  transposed; c_attn's columns are already q | k | v. wte, wpe, ln_f; lm_head tied to wte.

RoPE needs no permutation: meshlm's Rotary (model/attention.py) rotates halves (x1, x2) of each
head, as transformers' rotate_half does, so HF's q_proj/k_proj rows are meshlm's rows. (Meta's
original Llama files pair dims (2i, 2i+1) instead; transformers' own converter permutes those.)

Tied embeddings: an HF file stores the embedding once; meshlm's last pipeline stage holds its
own copy ``output_layer.weight`` when PP > 1, filled from the embedding on import, dropped on export.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections import ChainMap
from collections.abc import Mapping
from typing import Optional

import torch

from .. import config as C
from ..errors import CheckpointError
from .hf_config import CONFIG, INDEX

SINGLE = "model.safetensors"
# buffers some HF files carry that are not weights (GPT-2's causal mask, old Llama's inv_freq)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


@dataclass(frozen=True)
class Rule:
    """meshlm tensor ``name`` = cat(HF tensors ``hf``, dim 0), each transposed first if conv1d.

    sizes: rows of each HF part in the meshlm tensor (to split it on export). tied_copy: the
    output layer's copy of a tied embedding (read on import, never written on export).
    """

    name: str
    hf: tuple
    sizes: tuple = ()
    conv1d: bool = False
    tied_copy: bool = False


def rules(arch: str, m: C.ModelConfig) -> list:
    """Every meshlm tensor of model ``m`` as a Hugging Face ``arch`` model stores it."""
    tied = not m.untie_embeddings_and_output_weights
    bias = (".weight", ".bias") if m.add_bias_linear else (".weight",)
    out = []
    if arch == "gpt2":
        norm = (".weight", ".bias")
        out += [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
                Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",))]
        for i in range(m.num_layers):
            p, q = f"transformer.h.{i}.", f"layers.{i}."
            out += [Rule(q + "input_layernorm" + s, (p + "ln_1" + s,)) for s in norm]
            out += [Rule(q + "self_attention.linear_qkv" + s, (p + "attn.c_attn" + s,), conv1d=True) for s in bias]
            out += [Rule(q + "self_attention.linear_proj" + s, (p + "attn.c_proj" + s,), conv1d=True) for s in bias]
            out += [Rule(q + "pre_mlp_layernorm" + s, (p + "ln_2" + s,)) for s in norm]
            out += [Rule(q + "mlp.linear_fc1" + s, (p + "mlp.c_fc" + s,), conv1d=True) for s in bias]
            out += [Rule(q + "mlp.linear_fc2" + s, (p + "mlp.c_proj" + s,), conv1d=True) for s in bias]
        out += [Rule("final_layernorm" + s, ("transformer.ln_f" + s,)) for s in norm]
        embedding = "transformer.wte.weight"
    else:
        a, g, d, f = m.num_attention_heads, C.query_groups(m), C.head_dim(m), C.ffn_hidden(m)
        out.append(Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)))
        for i in range(m.num_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            out.append(Rule(q + "input_layernorm.weight", (p + "input_layernorm.weight",)))
            qkv_bias = (".weight", ".bias") if m.add_bias_linear or m.add_qkv_bias else (".weight",)  # Qwen2's
            out += [Rule(q + "self_attention.linear_qkv" + s, tuple(p + f"self_attn.{x}_proj" + s for x in "qkv"),
                         (a * d, g * d, g * d)) for s in qkv_bias]
            out += [Rule(q + "self_attention.linear_proj" + s, (p + "self_attn.o_proj" + s,)) for s in bias]
            if m.qk_layernorm:  # Qwen3's q_norm / k_norm (RMSNorm over the head dim)
                out += [Rule(q + f"self_attention.{x}_layernorm.weight", (p + f"self_attn.{x}_norm.weight",))
                        for x in "qk"]
            out.append(Rule(q + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",)))
            if arch == "mixtral":
                out += _mixtral_moe(p + "block_sparse_moe.", q + "mlp.", m)
                continue
            out += [Rule(q + "mlp.linear_fc1" + s, (p + "mlp.gate_proj" + s, p + "mlp.up_proj" + s), (f, f))
                    for s in bias]
            out += [Rule(q + "mlp.linear_fc2" + s, (p + "mlp.down_proj" + s,)) for s in bias]
        out.append(Rule("final_layernorm.weight", ("model.norm.weight",)))
        embedding = "model.embed_tokens.weight"
    out.append(Rule("output_layer.weight", (embedding,), tied_copy=True) if tied
               else Rule("output_layer.weight", ("lm_head.weight",)))
    return out


def _mixtral_moe(p: str, q: str, m: C.ModelConfig) -> list:
    """The rules of one Mixtral MoE MLP: HF prefix ``p`` (…block_sparse_moe.), meshlm ``q`` (…mlp.)."""
    f = C.moe_ffn(m)
    out = [Rule(q + "router.weight", (p + "gate.weight",))]
    for e in range(m.num_experts):
        hf, ours = f"{p}experts.{e}.", f"{q}experts.local_experts.{e}."
        out += [Rule(ours + "linear_fc1.weight", (hf + "w1.weight", hf + "w3.weight"), (f, f)),
                Rule(ours + "linear_fc2.weight", (hf + "w2.weight",))]
    return out


# ----------------------------------------------------------------------------- files

def _weight_files(folder: str) -> dict:
    """{HF tensor name: safetensors file} of the folder (from the index when it is sharded)."""
    from safetensors import safe_open
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                mapping = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable ({e}); re-save the model with save_pretrained") from None
        return {name: os.path.join(folder, file) for name, file in mapping.items()}
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights; save the model with save_pretrained "
                              f"(safe_serialization, the default)")
    out = {}
    for name in files:
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as fh:
                out.update({key: path for key in fh.keys()})
        except Exception as e:  # the library raises its own SafetensorError
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def _read(path: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, the file opened for it alone (so no mapping of the file
    stays resident between tensors: host memory holds this tensor, not the file)."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as fh:
            return fh.get_tensor(name)
    except Exception as e:  # the library raises its own SafetensorError
        raise CheckpointError(f"{path}: cannot read tensor {name} ({e}); the file is damaged "
                              f"or incomplete") from None


def _shapes(files: dict) -> dict:
    """{HF name: shape} from the files' headers (no tensor data read)."""
    from safetensors import safe_open
    out = {}
    for path in sorted(set(files.values())):
        try:
            with safe_open(path, framework="pt") as fh:
                out.update({n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()})
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def _with_prefix(files: dict, arch: str) -> dict:
    """GPT-2 files saved from GPT2Model lack the ``transformer.`` prefix of GPT2LMHeadModel's."""
    if arch == "gpt2" and files and not any(n.startswith("transformer.") for n in files):
        return {(n if n.startswith("lm_head.") else "transformer." + n): f for n, f in files.items()}
    return files


class HFWeights(Mapping):
    """{meshlm global name: full tensor (the file's dtype)} of an HF folder's safetensors, read when
    asked: each access reads that tensor's parts from the files (nothing is cached), so loading a
    model tensor by tensor holds one tensor besides the model. ``shapes``: {name: full shape},
    from the file headers.

    names: the meshlm tensors wanted (a pipeline stage's); None for all. Raises CheckpointError
    naming a missing tensor, or tensors the folder holds that the model has no place for (e.g.
    biases the config does not announce). A tied model's ``lm_head.weight``, which some files hold
    beside the embedding, is left unread when it equals the embedding, as transformers leaves it;
    one that differs is refused (``_check_unread_head``).
    """

    def __init__(self, folder: str, arch: str, m: C.ModelConfig, names: Optional[set] = None):
        files = _with_prefix(_weight_files(folder), arch)
        plan = rules(arch, m)
        known = {h for r in plan for h in r.hf}
        if not m.untie_embeddings_and_output_weights and "lm_head.weight" in files:  # tied: a copy left unread
            known.add("lm_head.weight")
            _check_unread_head(folder, files, next(r.hf[0] for r in plan if r.name.startswith("embedding.word")))
        unused = sorted(n for n in files if n not in known and not n.endswith(_BUFFERS))
        if unused:
            raise CheckpointError(f"{folder}: holds {len(unused)} tensor(s) the {arch} model of its config.json "
                                  f"has no place for ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
        plan = [r for r in plan if names is None or r.name in names]
        missing = [h for r in plan for h in r.hf if h not in files]
        if missing:
            raise CheckpointError(f"{folder}: has no tensor {missing[0]}"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                                  f"incomplete download, or another model than its config.json says?")
        self._files, self._plan = files, {r.name: r for r in plan}
        hf_shapes = _shapes({h: files[h] for r in plan for h in r.hf})
        self.shapes = {}
        for r in plan:
            parts = [hf_shapes[h][::-1] if r.conv1d else hf_shapes[h] for h in r.hf]
            self.shapes[r.name] = (sum(p[0] for p in parts),) + tuple(parts[0][1:])

    def __getitem__(self, name: str) -> torch.Tensor:
        r = self._plan[name]
        parts = [_read(self._files[h], h) for h in r.hf]
        parts = [t.t() for t in parts] if r.conv1d else parts
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def __iter__(self):
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def _check_unread_head(folder: str, files: dict, embedding: str, rows: int = 4096) -> None:
    """A tied model's folder holding ``lm_head.weight`` beside the ``embedding`` (its HF name): equal,
    it is the same model either way; different, transformers 5 loads it as an output layer of its
    own (4 left it unread), so the folder names two models and importing it tied would silently be
    the other one: CheckpointError naming both ways out. Compared ``rows`` rows at a time."""
    from safetensors import safe_open
    try:
        with safe_open(files["lm_head.weight"], framework="pt") as a, \
                safe_open(files[embedding], framework="pt") as b:
            head, emb = a.get_slice("lm_head.weight"), b.get_slice(embedding)
            n = head.get_shape()[0]
            same = head.get_shape() == emb.get_shape() and all(
                torch.equal(head[i:i + rows], emb[i:i + rows]) for i in range(0, n, rows))
    except Exception as e:  # the library raises its own SafetensorError
        raise CheckpointError(f"{folder}: cannot read lm_head.weight or {embedding} ({e}); the files are damaged "
                              f"or incomplete") from None
    if not same:
        raise CheckpointError(f"{folder}: config.json ties the output layer to the embedding (tie_word_embeddings) "
                              f"but lm_head.weight differs from {embedding} (transformers 5 loads it untied): set "
                              f"\"tie_word_embeddings\": false in config.json to import it as the output layer, or "
                              f"remove lm_head.weight from the files to tie them")


def to_hf_tensors(full: dict, arch: str, m: C.ModelConfig) -> dict:
    """{HF name: tensor} from meshlm's full weights ({global name: tensor}): views of ``full``'s
    tensors (split, transposed), no copy; ``write_hf_folder`` copies one shard at a time. Under
    --apply-layernorm-1p the norms' weights are written as 1 + w (new tensors): transformers' norms
    scale by the weight itself.

    Raises CheckpointError naming a tensor the model needs and ``full`` lacks.
    """
    out = {}
    for r in rules(arch, m):
        if r.tied_copy:
            continue
        if r.name not in full:
            raise CheckpointError(f"the checkpoint has no tensor {r.name}; was it saved from this model?")
        parts = full[r.name].split(list(r.sizes), 0) if r.sizes else [full[r.name]]
        for h, t in zip(r.hf, parts):
            out[h] = t.t() if r.conv1d else t + 1 if m.apply_layernorm_1p and _is_norm_weight(r.name) else t
    return out


def _is_norm_weight(name: str) -> bool:
    """Whether meshlm tensor ``name`` is a LayerNorm/RMSNorm weight (model/transformer.py ``Norm``)."""
    return name.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight",
                          "q_layernorm.weight", "k_layernorm.weight"))


def _new_file_mode(path: str) -> None:
    """Give ``path`` the mode of any new file (0666 less the umask, e.g. 0644): safetensors writes
    its file 0600, so others on a shared cluster could not read exported weights."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_hf_folder(out: str, tensors: dict, hf_config: dict, max_shard_bytes: int) -> list:
    """Write config.json and the weights: model.safetensors, or when larger than max_shard_bytes,
    model-0000i-of-0000n.safetensors with model.safetensors.index.json (transformers' layout).
    Returns the files written. ``out`` must exist and hold none of them. ``tensors`` may be views
    of one another: each shard is copied into contiguous tensors of its own just before it is
    written, so the host holds ``tensors`` plus one shard."""
    from safetensors.torch import save_file
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    written = []
    files = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, names in zip(files, shards):
        shard = {n: tensors[n].clone(memory_format=torch.contiguous_format) for n in names}
        save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
        _new_file_mode(os.path.join(out, file))
        del shard
        written.append(file)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file for file, names in zip(files, shards) for n in names}}
        with open(os.path.join(out, INDEX), "w") as fh:
            json.dump(index, fh, indent=2)
        written.append(INDEX)
    with open(os.path.join(out, CONFIG), "w") as fh:
        json.dump(hf_config, fh, indent=2)
    return written + [CONFIG]


# ----------------------------------------------------------------------------- into a model

def full_shapes(chunks) -> dict:
    """{global name: full (TP=1, unpadded) shape} of every parameter of the model chunks."""
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            shape = list(p.shape)
            if getattr(p, "tensor_model_parallel", False):
                shape[p.partition_dim] = p.full_size
            out[name] = tuple(shape)
    return out


_FLAGS_FIX = "pass the model's flags"  # a fine-tune's fix: it takes the model flags


def load_into_chunks(chunks, full: dict, source: str, fix: Optional[str] = None) -> None:
    """Copy full weights (a dict, or ``HFWeights`` read tensor by tensor) into each chunk's
    parameters, each rank keeping its TP slice the way a fresh model's weights are sliced
    (``parallel.tensor.load_full_state_dict``).

    A tied model's last stage (PP > 1) takes ``output_layer.weight`` from the embedding. Raises
    CheckpointError, before copying anything, naming a missing tensor or one of another shape
    (source: the folder, for the message; fix: its end, what to change: None for a fine-tune, whose
    message names the model flags; the config file of a conversion, which takes no model flag, and
    then no flag is named).
    """
    from ..parallel.tensor import load_full_state_dict
    shapes = dict(full.shapes) if isinstance(full, HFWeights) else {n: tuple(t.shape) for n, t in full.items()}
    tied_copy = any(getattr(p, "shared_embedding", False) for chunk in chunks
                    for name, p in chunk.named_parameters() if name == "output_layer.weight")
    if tied_copy and "output_layer.weight" not in full and "embedding.word_embeddings.weight" in full:
        full = ChainMap({"output_layer.weight": full["embedding.word_embeddings.weight"]}, full)
        shapes["output_layer.weight"] = shapes["embedding.word_embeddings.weight"]
    for name, shape in full_shapes(chunks).items():
        if name not in full:
            raise CheckpointError(f"{source}: has no weight for {name}; was it saved from this model?")
        if shapes[name] != shape:
            what = "vocabulary" if "word_embeddings" in name or "output_layer" in name else \
                "positions" if "position_embeddings" in name else None
            flag = {"vocabulary": ": check the tokenizer / --vocab-size",
                    "positions": ": --max-position-embeddings"}.get(what, "") if fix is None else ""
            hint = f" (the {what}{flag})" if what else ""
            raise CheckpointError(f"{source}: {name} is {list(shapes[name])}, the model's {list(shape)}"
                                  f"{hint}; {fix or _FLAGS_FIX}")
    for chunk in chunks:
        load_full_state_dict(chunk, full)
