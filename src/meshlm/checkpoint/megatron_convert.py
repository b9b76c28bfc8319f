"""`meshlm convert --from-megatron` / `--to-megatron`: Megatron-LM torch_dist checkpoints ↔ meshlm.

    meshlm convert --from-megatron MEGATRON_SAVE --output CKPT       Megatron-LM → meshlm (TP=1, PP=1)
    meshlm convert --to-megatron --load CKPT --output MEGATRON_SAVE  meshlm (any layout) → Megatron-LM

Import reads the tensors at their full size (megatron.py: whatever TP/PP/EP saved them) and the
model flags from common.pt's args (megatron_common.py: no arbitrary pickle), builds meshlm's
model at TP=1 and writes a weights-only meshlm checkpoint (iteration 0, config.json holding the
model and tokenizer flags), as ``meshlm convert --from-hf`` does: ``meshlm pretrain --load CKPT``
fine-tunes it at any layout. When the folder holds Adam's state — per parameter in model space
(``optimizer.state.exp_avg.<model key>``…: the plain optimizer's, or the distributed optimizer's
``--dist-ckpt-optim-fully-reshardable`` format), or the distributed optimizer's default
``dp_reshardable`` buckets (megatron_buckets.py) — it becomes a meshlm training checkpoint at the
Megatron iteration instead (moments, fp32 masters, step, LR-schedule position, consumed samples),
and ``--load`` resumes training with its moments at any layout. A state it cannot read (MoE's
expert buckets, virtual pipeline stages) leaves a weights-only checkpoint and a note saying so.

Export writes Megatron-LM's folder layout: the tracker, ``iter_NNNNNNN/`` with metadata.json
(torch_dist), common.pt (``args``: the model flags under Megatron's names, ``iteration``,
``checkpoint_version`` 3.0) and the model tensors through DCP at their global shapes, stacked per
layer as megatron-core's ``sharded_state_dict`` names them, so ``dist_checkpointing.load`` reads
them at any TP/PP/EP, and each linear layer's ``_extra_state`` as megatron-core's layers save it
outside FP8 (``megatron.extra_states``: no FP8 metadata). No optimizer state is written: load it
in Megatron-LM with ``--no-load-optim`` (and ``--no-load-rng``; ``--finetune`` also restarts the
iteration count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings

import torch

from .. import config as C
from ..data.tokenizer import implied_tokenizer_type
from ..errors import CheckpointError
from ..folders import left_as_found, new_folder_problem, output_folder_problem
from . import megatron as mg
from .megatron_common import read_common

CHECKPOINT_VERSION = 3.0


def import_megatron(src: str, out: str) -> str:
    """Write the Megatron-LM checkpoint ``src`` (its --save folder or one iter_NNNNNNN) as a
    weights-only meshlm checkpoint in ``out``; return the checkpoint folder.

    Raises CheckpointError (one line): not a torch_dist Megatron checkpoint, a model meshlm
    cannot compute (naming the Megatron flag), a tensor missing or of another shape, or an
    ``out`` already holding a checkpoint.
    """
    from ..model.transformer import GPTModel
    from ..parallel.mesh import ParallelState
    from . import dist as ckpt
    from .hf import full_shapes, load_into_chunks
    from .model_space import ModelSpace
    from .state import model_state

    if not os.path.isdir(src):
        what = "a file, not a directory" if os.path.exists(src) else "no such directory"
        raise CheckpointError(f"--from-megatron {src}: {what}; give the folder holding {mg.TRACKER} "
                              f"(Megatron-LM's --save)")
    folder = mg.iteration_folder(src)
    stale = mg.tracker_problem(src)
    if stale:
        raise CheckpointError(f"--from-megatron {src}: {stale}")
    if folder is None:
        raise CheckpointError(f"--from-megatron {src}: not a Megatron-LM checkpoint (no {mg.TRACKER} naming an "
                              f"iter_NNNNNNN folder with {mg.METADATA} and {mg.COMMON}){ckpt.folder_kind(src)}")
    mg.check_backend(folder)
    common = read_common(os.path.join(folder, mg.COMMON))
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{folder}/{mg.COMMON}: holds no args; was it saved by Megatron-LM's training loop?")
    problem = output_folder_problem("--output", out)
    if problem:
        raise CheckpointError(problem)
    if ckpt.complete_iterations(out) or os.path.isfile(os.path.join(out, ckpt.TRACKER)):
        raise CheckpointError(f"--output {out} already holds a checkpoint; give a new folder")
    m, notes = mg.model_from_args(args), []
    cfg = C.Config()
    cfg.model = m
    for key, value in mg.data_from_args(args).items():
        setattr(cfg.data, key, value)
    vocab = getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None)
    if not vocab:
        raise CheckpointError(f"{folder}/{mg.COMMON}: its args hold neither vocab_size nor padded_vocab_size")
    if not getattr(args, "vocab_size", None):
        notes.append(f"the checkpoint's vocabulary is kept padded ({vocab} rows, args.padded_vocab_size)")
    cfg.model.vocab_size = vocab
    ps = ParallelState.single()
    model = GPTModel(cfg.model, ps, vocab, seed=cfg.training.seed)
    names = full_shapes([model])
    weights = mg.read_full(folder, names, m, vocab)
    read, adam = _optimizer_state(folder, common, args, names, m, vocab, weights, notes)
    for note in notes:
        print(f"meshlm: note: {note}")
    with torch.no_grad():
        load_into_chunks([model], weights, src, fix=f"{mg.COMMON}'s args disagree with its tensors (convert "
                                                    f"takes no model flag): was it saved by this model?")
    with left_as_found(out):  # a failed import leaves no empty or half-written folder
        os.makedirs(out, exist_ok=True)
        layout = {"tp": 1, "pp": 1, "cp": 1, "virtual_pipeline": 1, "dp": 1}
        space = ModelSpace([model], ps)
        tree, iteration = model_state(space), 0
        if read:
            tree.update(_training_state(common, args, adam, space, model, read))
            iteration = int(common.get("iteration", 0))
        return ckpt.save(out, iteration, tree, layout=layout, config=cfg.to_dict(),
                         coords={"tp": 0, "pp": 0, "cp": 0, "dp": 0})


def _adam_scalars(common: dict):
    """(step, lr) of the Megatron optimizer in common.pt (the plain optimizer's ``common_step``,
    or the step in its param groups, as the distributed optimizer keeps it); None if absent."""
    opt = common.get("optimizer")
    if not isinstance(opt, dict):
        return None
    inner = opt.get("optimizer", opt) if isinstance(opt.get("optimizer"), dict) else opt
    groups = inner.get("param_groups") or []
    step = (inner.get("state") or {}).get("common_step")
    if step is None:
        step = next((g["step"] for g in groups if isinstance(g, dict) and "step" in g), None)
    if step is None or not groups:
        return None
    return int(float(step)), float(groups[0].get("lr", 0.0))


def _optimizer_state(folder, common, args, names, m, vocab, weights, notes) -> tuple:
    """({"exp_avg", "exp_avg_sq", "master": {meshlm name: full tensor}}, (step, lr)) of the
    Megatron optimizer in ``folder`` ("master": the fp32 masters, the fp32 weights themselves when
    the plain optimizer trained in fp32), or (None, None) with a note in ``notes`` saying why the
    optimizer starts fresh. Read: Adam's per-parameter state in model space (the plain
    optimizer's, the distributed optimizer's fully_reshardable format) and the distributed
    optimizer's default dp_reshardable buckets (megatron_buckets.py)."""
    from . import megatron_buckets
    states = mg.optimizer_states(folder)
    if states == [mg.BUCKETS]:
        try:
            read, adam = megatron_buckets.read(folder, names, m, args, weights,
                                               lambda n, t: mg.from_megatron_layout(n, t, m, vocab))
        except CheckpointError as e:
            notes.append(f"the Megatron optimizer state is not read ({e}): `meshlm pretrain --load` fine-tunes "
                         f"with a fresh optimizer at iteration 0")
            return None, None
        read["master"] = read.pop("param")
        return read, adam
    adam = _adam_scalars(common)
    if states and ({"exp_avg", "exp_avg_sq"} - set(states) or adam is None):
        notes.append(f"the Megatron optimizer state ({', '.join(states)}) is not in a form meshlm reads "
                     f"(Adam's per-parameter moments and its step): `meshlm pretrain --load` fine-tunes with a "
                     f"fresh optimizer at iteration 0")
        return None, None
    if not states:
        notes.append(f"{folder} holds no optimizer state (saved with --no-save-optim?): the result is the "
                     f"weights alone, and `meshlm pretrain --load` fine-tunes them with a fresh optimizer at "
                     f"iteration 0 (not at iteration {common.get('iteration', 0)})")
        return None, None
    read = {kind: mg.read_full(folder, names, m, vocab, kind) for kind in ("exp_avg", "exp_avg_sq")}
    master = next((s for s in ("param", "fp32_param") if s in states), None)
    read["master"] = mg.read_full(folder, names, m, vocab, master) if master else \
        {n: w.float() for n, w in weights.items()}
    return read, adam


def _training_state(common, args, adam, space, model, read) -> dict:
    """The optimizer, scheduler, RNG and progress of a meshlm training checkpoint (what
    trainer.save_checkpoint writes) from the Megatron run: Adam's moments and fp32 masters per
    parameter (``read``, as ``_optimizer_state`` gives them), its step and lr, the LR schedule's
    position in samples, the iteration and consumed samples."""
    from . import dist as ckpt
    from .state import rng_state
    fragments = [(p, 0, {kind: read[kind][n].float().reshape(-1).contiguous() for kind in read})
                 for n, p in model.named_parameters()]
    step, lr = adam
    scheduler = common.get("opt_param_scheduler") or {}
    consumed = int(getattr(args, "consumed_train_samples", 0) or scheduler.get("num_steps", 0))
    return {"optimizer": {"step": step, "lr": lr, "loss_scaler": {}, "params": space.state(fragments, writing=True)},
            "scheduler": {"num_samples": int(scheduler.get("num_steps", consumed))},
            ckpt.rank_key("rng", 0): rng_state(), "dropout_call": 0,
            "train": {"iteration": int(common.get("iteration", 0)), "consumed_samples": consumed}}


# ----------------------------------------------------------------------------- export

def megatron_args(cfg: C.Config, vocab: int, padded: int) -> argparse.Namespace:
    """The args a Megatron-LM run of this model would have saved (Megatron's names; the fields
    meshlm shares with it, resolved: ffn, groups and head size explicit)."""
    m = cfg.model
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(C.ModelConfig)}
    if fields["moe_layer_freq"].isdigit():
        fields["moe_layer_freq"] = int(fields["moe_layer_freq"])
    fields.update(ffn_hidden_size=C.ffn_hidden(m), num_query_groups=C.query_groups(m), kv_channels=C.head_dim(m),
                  group_query_attention=C.query_groups(m) != m.num_attention_heads,
                  max_position_embeddings=C.max_positions(m), vocab_size=vocab, padded_vocab_size=padded,
                  tokenizer_type=implied_tokenizer_type(cfg.data, vocab),  # the type the run used: a
                  tokenizer_model=cfg.data.tokenizer_model,  # type implied by its files was None, so
                  # --from-megatron of this folder took NullTokenizer (ids as text) for its tokenizer.json
                  vocab_file=cfg.data.vocab_file, merge_file=cfg.data.merge_file,
                  ckpt_format="torch_dist", num_experts=m.num_experts or None,
                  # Megatron-LM since 2026-01 names these two by TransformerConfig's fields (megatron.py _RENAMED)
                  layernorm_epsilon=m.norm_epsilon, layernorm_zero_centered_gamma=m.apply_layernorm_1p)
    return argparse.Namespace(**fields)


def _padded(vocab: int, m: C.ModelConfig) -> int:
    """Megatron's padded vocabulary at TP=1: a multiple of --make-vocab-size-divisible-by."""
    k = m.make_vocab_size_divisible_by
    return -(-vocab // k) * k


def export_megatron(load: str, out: str) -> str:
    """Write the meshlm checkpoint ``load`` (any layout) as a Megatron-LM torch_dist checkpoint
    in ``out`` (tracker and iter_NNNNNNN of the checkpoint's iteration); return that folder.

    Raises CheckpointError (one line) for an unreadable checkpoint or an ``out`` that is a file
    or not empty.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from . import dist as ckpt
    from .safe_read import reading
    from .state import full_model_state

    problem = new_folder_problem("--output", out)  # before anything is read
    if problem:
        raise CheckpointError(problem)
    folder = load if os.path.isfile(os.path.join(load, ckpt.MANIFEST)) else ckpt.checkpoint_dir(load)
    with reading(folder, load):
        saved = C.Config.from_dict(ckpt.read_config(folder))
        iteration = ckpt.read_manifest(folder)["iteration"]
    full = full_model_state(folder, load)
    vocab = full["embedding.word_embeddings.weight"].shape[0]
    padded = _padded(vocab, saved.model)
    tensors = mg.to_megatron(full, saved.model, padded)
    tensors.update(mg.extra_states(tensors))
    target = os.path.join(out, f"iter_{iteration:07d}")
    with left_as_found(out):  # a failed export leaves --output as it was found
        os.makedirs(target)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, storage_writer=FileSystemWriter(target), no_dist=True,
                     planner=DefaultSavePlanner(flatten_state_dict=False))  # the [None] objects stay whole
        common = {"args": megatron_args(saved, vocab, padded), "iteration": iteration,
                  "checkpoint_version": CHECKPOINT_VERSION}
        torch.save(common, os.path.join(target, mg.COMMON))
        with open(os.path.join(target, mg.METADATA), "w") as fh:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, fh)
        with open(os.path.join(out, mg.TRACKER), "w") as fh:
            fh.write(str(iteration))
    return target
