"""`meshlm convert`: Hugging Face model folders ↔ meshlm checkpoints, and weights to fine-tune.

    meshlm convert --from-hf HF_DIR --save CKPT        HF folder → meshlm checkpoint (TP=1, PP=1)
                                                       (an import takes --save or --output for CKPT)
    meshlm convert --to-hf --load CKPT --output HF_DIR  meshlm checkpoint (any TP/PP) → HF folder
    meshlm convert --from-megatron DIR --output CKPT    Megatron-LM torch_dist → meshlm (megatron_convert.py)
    meshlm convert --to-megatron --load CKPT --output DIR  meshlm → Megatron-LM torch_dist

Import writes a *weights-only* checkpoint (``CKPT/iter_0000000``: the model tensors of checkpoint/
state.py's ``model_state`` and config.json with the model derived from the HF config; no
optimizer state), the analogue of Megatron's converted "release" checkpoints. ``meshlm pretrain
--load`` of such a checkpoint, or of a Hugging Face folder itself, fine-tunes (``load_weights``):
every rank takes its slice of the full weights at the run's TP/PP layout, the optimizer starts
fresh and the run at iteration 0. ``meshlm generate --load CKPT`` samples from it.

Export reads the full weights of a checkpoint saved at any TP/PP layout
(``state.full_model_state``) and writes config.json plus model.safetensors, or shards with
model.safetensors.index.json beyond --max-shard-size; the HF tensors are views of the full weights,
copied one shard at a time, so the host holds the model plus one shard.

Import builds the model once and fills it tensor by tensor from the safetensors (``hf.HFWeights``:
one file opened per tensor read), so the host holds about one model plus one tensor.

The tokenizer travels both ways (checkpoint/hf_tokenizer.py): a run's HuggingFaceTokenizer,
SentencePiece (as tokenizer.model and an equivalent tokenizer.json) or GPT-2 BPE tokenizer is
written so that ``transformers.AutoTokenizer`` gives meshlm's ids, and bos/eos ids go into
config.json and generation_config.json; TikTokenizer and NullTokenizer export none (a note says
why). An HF folder's tokenizer.json, tokenizer.model or vocab.json + merges.txt is copied into the
checkpoint when its vocabulary is the model's.
"""

from __future__ import annotations

import argparse
import math
import os

from .. import config as C
from ..errors import CheckpointError, ConfigError
from ..folders import left_as_found, new_folder_problem, space_errors_named
from . import dist as ckpt
from .hf import HFWeights, full_shapes, load_into_chunks, to_hf_tensors, write_hf_folder
from .hf_config import (ARCHITECTURES, flag_problems, hf_config_from_model, hf_to_fine_tune, is_hf_folder,
                        model_from_hf, read_hf_config)
from .hf_tokenizer import export_tokenizer, import_tokenizer, write_generation_config

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def _size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count → bytes (argparse type): a finite size of 1 byte or more
    ('infGB' was an OverflowError traceback, '0.5B' 0 bytes: no limit at all)."""
    t = text.strip().upper()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if t.endswith(u)), "B")
    try:
        n = float(t[:len(t) - len(unit)] if t.endswith(unit) else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB") from None
    if not n > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    if not math.isfinite(n) or n * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite size of at least 1 byte, e.g. 5GB")
    return int(n * _UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `meshlm convert`."""
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", metavar="HF_DIR", help="import a Hugging Face model folder (config.json and "
                     "*.safetensors) into the meshlm checkpoint folder --save (or --output)")
    way.add_argument("--to-hf", action="store_true", help="export the meshlm checkpoint --load to the Hugging "
                     "Face folder --output")
    way.add_argument("--from-megatron", metavar="MEGATRON_DIR", help="import a Megatron-LM torch_dist checkpoint "
                     "(its --save folder or one iter_NNNNNNN, any TP/PP/EP) into the meshlm checkpoint folder --output (or --save)")
    way.add_argument("--to-megatron", action="store_true", help="export the meshlm checkpoint --load to a "
                     "Megatron-LM torch_dist checkpoint folder --output")
    parser.add_argument("--save", help="import: the meshlm checkpoint folder to write (new, or holding no "
                        "checkpoint); --output says the same")
    parser.add_argument("--load", help="export: a run's --save folder (its latest checkpoint) or one iter_XXXXXXX")
    parser.add_argument("--output", help="the folder to write: export: new or empty; import: the meshlm checkpoint "
                        "folder (as --save)")
    parser.add_argument("--hf-architecture", choices=ARCHITECTURES, default=None,
                        help="--to-hf: the Hugging Face model type [default: llama for RoPE models, else gpt2]")
    parser.add_argument("--max-shard-size", type=_size, default=None,
                        help="--to-hf: largest safetensors file; beyond it the weights are sharded [default: 5GB]")


def run(args: argparse.Namespace) -> int:
    """Run `meshlm convert`; return the exit status 0 (errors are MeshlmErrors, one line). ConfigError
    for --hf-architecture or --max-shard-size with another direction than --to-hf (ignored before)."""
    hf_only = [flag for flag, value in (("--hf-architecture", args.hf_architecture),
                                        ("--max-shard-size", args.max_shard_size)) if value is not None]
    if hf_only and not args.to_hf:
        way = next(f for f, on in (("--from-hf", args.from_hf), ("--from-megatron", args.from_megatron),
                                   ("--to-megatron", args.to_megatron)) if on)
        named = " and ".join(hf_only)
        raise ConfigError(f"{named} {'shape' if len(hf_only) > 1 else 'shapes'} the Hugging Face folder --to-hf "
                          f"writes; {way} writes none: drop {named}")
    if args.from_megatron or args.to_megatron:
        return _run_megatron(args)
    if args.from_hf:
        out = import_folder(args, "--from-hf")
        path = import_hf(args.from_hf, out)
        directly = f" (or --load {args.from_hf} directly)" if hf_to_fine_tune(args.from_hf) else \
            f" (--load {args.from_hf} resumes the meshlm checkpoints saved into it instead)"
        print(f"meshlm: converted {args.from_hf} into {path}; fine-tune with `meshlm pretrain --load {out}`{directly}")
        return 0
    if not args.load or not args.output or args.save:
        raise ConfigError("--save belongs to --from-hf; --to-hf reads --load and writes --output" if args.save
                          else "--to-hf needs --load (a meshlm checkpoint) and --output (the folder to write)")
    files = export_hf(args.load, args.output, args.hf_architecture, args.max_shard_size or _size("5GB"))
    print(f"meshlm: wrote {args.output}: {', '.join(files)}")
    return 0


def import_folder(args: argparse.Namespace, way: str) -> str:
    """The meshlm checkpoint folder an import (``way``: --from-hf, --from-megatron) writes: --save or
    --output, either one (both only when they name the same folder).

    Raises:
        ConfigError: neither given, two different folders, the folder ``way`` reads, or --load (an
        export's input) given."""
    if args.load:
        raise ConfigError(f"--load is what an export reads; {way} writes the folder --save (or --output)")
    if args.save and args.output and os.path.abspath(args.save) != os.path.abspath(args.output):
        raise ConfigError(f"{way}: --save {args.save} and --output {args.output} name two folders; give one of them")
    if not (args.save or args.output):
        raise ConfigError(f"{way} needs --save (or --output): the meshlm checkpoint folder to write")
    out, src = args.save or args.output, getattr(args, way[2:].replace("-", "_"))
    if src and os.path.exists(out) and os.path.exists(src) and os.path.samefile(out, src):
        raise ConfigError(f"{'--save' if args.save else '--output'} {out} is the {way} folder itself; the meshlm "
                          f"checkpoint goes to a new folder: give another path")
    return out


def _run_megatron(args: argparse.Namespace) -> int:
    from .megatron_convert import export_megatron, import_megatron
    if args.from_megatron:
        out = import_folder(args, "--from-megatron")
        path = import_megatron(args.from_megatron, out)
        print(f"meshlm: converted {args.from_megatron} into {path}; train on with `meshlm pretrain --load {out}`")
        return 0
    if not args.load or not args.output or args.save:
        raise ConfigError("--save belongs to --from-megatron; --to-megatron reads --load and writes --output"
                          if args.save else "--to-megatron needs --load (a meshlm checkpoint) and --output "
                          "(the Megatron-LM folder to write)")
    path = export_megatron(args.load, args.output)
    print(f"meshlm: wrote {path}; Megatron-LM loads it with --load {args.output} --ckpt-format torch_dist "
          f"--no-load-optim --no-load-rng")
    return 0


# ----------------------------------------------------------------------------- import

def _hf_model(folder: str, flag: str = "--from-hf"):
    if not is_hf_folder(folder):
        raise CheckpointError(f"{flag} {folder}: not a Hugging Face model folder (config.json with a model_type "
                              f"and *.safetensors weights){ckpt.folder_kind(folder)}")
    return model_from_hf(read_hf_config(folder), os.path.join(folder, "config.json"))


def import_hf(src: str, save: str) -> str:
    """Write the Hugging Face folder ``src`` as a weights-only meshlm checkpoint in ``save``
    (iteration 0, TP=1, PP=1; config.json holds the model); return the checkpoint folder.

    Raises CheckpointError (one line) for an unusable folder, an unsupported HF feature, or a
    --save that already holds a checkpoint.
    """
    import torch

    from ..folders import output_folder_problem
    from ..model.transformer import GPTModel
    from ..parallel.mesh import ParallelState
    from .model_space import ModelSpace
    from .state import model_state

    hm = _hf_model(src)
    problem = output_folder_problem("--save", save)
    if problem:
        raise CheckpointError(problem)
    if ckpt.complete_iterations(save) or os.path.isfile(os.path.join(save, ckpt.TRACKER)):
        raise CheckpointError(f"--save {save} already holds a checkpoint; give a new folder")
    weights = HFWeights(src, hm.arch, hm.model_config())  # checks the tensors' names and shapes, reads none
    for note in hm.notes:
        print(f"meshlm: note: {note}")
    with left_as_found(save):  # a failed import leaves no empty or half-written --save folder
        os.makedirs(save, exist_ok=True)
        cfg = C.Config()
        cfg.model = hm.model_config()
        cfg.model.seq_length = min(hm.max_positions, hm.window or hm.max_positions)
        vocab = cfg.model.vocab_size
        data, notes = import_tokenizer(src, save, vocab, hm.arch)
        for note in notes:
            print(f"meshlm: note: {note}")
        for key, value in data.items():
            setattr(cfg.data, key, value)
        if data["tokenizer_type"] != "NullTokenizer":
            cfg.model.vocab_size = None  # the tokenizer's, as in a run trained with it
        ps = ParallelState.single()
        model = GPTModel(cfg.model, ps, vocab, seed=cfg.training.seed)
        with torch.no_grad():
            load_into_chunks([model], weights, src,  # tensor by tensor: the host holds the model + one tensor
                             fix=f"its config.json disagrees with its weights (convert takes no model flag): "
                                 f"fix {os.path.join(src, 'config.json')}")
        layout = {"tp": 1, "pp": 1, "cp": 1, "virtual_pipeline": 1, "dp": 1}
        return ckpt.save(save, 0, model_state(ModelSpace([model], ps)), layout=layout, config=cfg.to_dict(),
                         coords={"tp": 0, "pp": 0, "cp": 0, "dp": 0})


# ----------------------------------------------------------------------------- export

def export_hf(load: str, output: str, arch=None, max_shard_bytes: int = _size("5GB")) -> list:
    """Write the meshlm checkpoint ``load`` (a --save folder or one iter_XXXXXXX, any TP/PP layout)
    as a Hugging Face folder ``output``; return the files written.

    Raises CheckpointError (one line) for an unreadable checkpoint, a model the HF architecture
    cannot express (naming the flag), or an ``output`` that is a file or not empty; ConfigError
    naming --output when its disk is full. On any error ``output`` is left as it was found.
    """
    from .safe_read import reading
    from .state import full_model_state

    problem = new_folder_problem("--output", output)  # before anything is read
    if problem:
        raise CheckpointError(problem)
    folder = load if os.path.isfile(os.path.join(load, ckpt.MANIFEST)) else ckpt.checkpoint_dir(load)
    with reading(folder, load):
        saved = C.Config.from_dict(ckpt.read_config(folder))
    full = full_model_state(folder, load)
    vocab = full["embedding.word_embeddings.weight"].shape[0]
    hf_config = hf_config_from_model(saved.model, vocab, arch)
    tensors = to_hf_tensors(full, hf_config["model_type"], saved.model)
    # a full disk: one line naming --output; on any error the folder is left as it was found
    with left_as_found(output), space_errors_named(f"--output {output}", output):
        os.makedirs(output, exist_ok=True)
        tokenizer_files, notes, ids = export_tokenizer(saved.data, output, vocab)
        for note in notes:
            print(f"meshlm: note: {note}")
        hf_config.update(ids)
        files = write_hf_folder(output, tensors, hf_config, max_shard_bytes)
        return files + write_generation_config(output, ids) + tokenizer_files


# ----------------------------------------------------------------------------- fine-tuning

def _weights_only_checkpoint(load: str):
    """The iteration folder of --load when it is a meshlm checkpoint without optimizer state
    (written by ``import_hf``), else None (also for anything unreadable: the regular load reports it)."""
    from .safe_read import SafeReader, reading
    if not os.path.isfile(os.path.join(load, ckpt.TRACKER)):
        return None
    try:
        folder = ckpt.checkpoint_dir(load, quiet=True)
        with reading(folder, load):
            keys = SafeReader(folder).read_metadata().state_dict_metadata
    except (CheckpointError, OSError):
        return None
    return folder if all(k.startswith("model") for k in keys) else None


def is_weights_only(load) -> bool:
    """True when --load holds weights alone: a Hugging Face folder (without meshlm checkpoints of
    its own, ``hf_to_fine_tune``), or `meshlm convert --from-hf`'s checkpoint. Such a load
    fine-tunes: fresh optimizer, iteration 0 (``load_weights``)."""
    return bool(load) and (hf_to_fine_tune(load) or _weights_only_checkpoint(load) is not None)


def hf_load_problems(load: str, m: C.ModelConfig) -> list:
    """Why a run with model flags ``m`` cannot fine-tune the Hugging Face folder ``load``, one
    line each ([] when it can); for meshlm.validate, before any worker starts."""
    try:
        return flag_problems(_hf_model(load, "--load"), m, load)
    except CheckpointError as e:
        return [str(e)]


_DROPOUT = ("hidden_dropout", "attention_dropout")


def carry_dropout(cfg: C.Config, explicit: set) -> list:
    """Give the run the dropout of the model --load holds where the flags do not set it: a
    Hugging Face folder's (its config), or a meshlm checkpoint's (its config.json: a converted
    model's, or the run it resumes — so a restarted fine-tune goes on at the dropout its first
    attempt took from the HF model, not at meshlm's default 0.1). Returns the notes saying so ([]
    when nothing changed). A --load that cannot be read is left to meshlm.validate."""
    load = cfg.checkpoint.load
    if not load or not os.path.isdir(load) or set(_DROPOUT) <= explicit:
        return []
    try:
        if hf_to_fine_tune(load):
            model = _hf_model(load, "--load").model
        else:
            from .safe_read import reading
            folder = ckpt.checkpoint_dir(load, quiet=True)
            with reading(folder, load):
                model = ckpt.read_config(folder).get("model", {})
    except (CheckpointError, OSError, AttributeError):
        return []
    notes = []
    for name in _DROPOUT:
        value = model.get(name)
        if name not in explicit and isinstance(value, (int, float)) and value != getattr(cfg.model, name):
            setattr(cfg.model, name, float(value))
            notes.append(f"--{name.replace('_', '-')} {value:g}: the dropout of the model --load holds "
                         f"(pass the flag to choose another)")
    return notes


def load_weights(chunks, m: C.ModelConfig, load: str) -> None:
    """Copy the weights of ``load`` (see ``is_weights_only``) into this rank's model chunks, each
    TP rank keeping its slice; every pipeline stage reads only its own tensors.

    Raises CheckpointError (one line) when the model flags ``m`` describe another model, or a
    weight is missing, of another shape or unreadable.
    """
    from .state import check_model_config, full_model_state
    names = set(full_shapes(chunks))
    if hf_to_fine_tune(load):
        hm = _hf_model(load, "--load")
        problems = flag_problems(hm, m, load)
        if problems:
            raise CheckpointError("; ".join(problems))
        full = HFWeights(load, hm.arch, hm.model_config(), names)
    else:
        folder = _weights_only_checkpoint(load)
        check_model_config(folder, m, load=load)
        full = full_model_state(folder, load)
    load_into_chunks(chunks, full, load)
