"""`meshlm checkpoint inspect DIR` and `meshlm checkpoint verify DIR [--layout TP,PP,DP]`.

DIR is a run's --save folder (its latest checkpoint) or one ``iter_XXXXXXX`` folder. Both read
files through the same safe paths as loading (checkpoint/safe_read.py: allow-listed .metadata,
tensors with ``weights_only``, values from JSON): nothing in DIR is unpickled beyond DCP's metadata
classes. Exit status 0 when all is well; 2 with one line per problem otherwise.

inspect: iteration, layout, world size, every tensor with its global shape, dtype and bytes; the
files against the manifest's sizes. verify: every file against the manifest's SHA-256, every
tensor read back, the layout's rules (meshlm.validate with the saved config at that layout; one
that breaks them is answered with the TP, PP and DP values that fit, not validate's fix), and
— for a layout of one process — the trainer's own load (``trainer.load_checkpoint``: model,
optimizer, scheduler, RNG) on CPU. A layout of several processes cannot be loaded in this one; the
command says which checks it left out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import os
import sys
import tempfile
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import dist as ckpt
from .checkpoint import manifest
from .checkpoint.safe_read import SafeReader, _load_json, reading
from .errors import CheckpointError, ConfigError, MeshlmError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `inspect` and `verify` actions of `meshlm checkpoint`."""
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="iteration, layout, tensors (global shape, dtype, bytes) of a checkpoint",
                             description="Show a checkpoint's iteration, layout, world size and tensors.",
                             allow_abbrev=False)
    verify = sub.add_parser("verify", help="check a checkpoint's checksums and that it loads at a layout, on CPU",
                            description="Check every file's SHA-256, read every tensor, and load the checkpoint "
                                        "at --layout on CPU.", allow_abbrev=False)
    for p in (inspect, verify):
        p.add_argument("dir", metavar="DIR", help="a run's --save folder (its latest checkpoint) or one iter_XXXXXXX")
    verify.add_argument("--layout", type=_layout, default=(1, 1, 1), metavar="TP,PP,DP",
                        help="the layout to load at [default: 1,1,1, which this process loads itself]")
    inspect.set_defaults(_run=run_inspect)
    verify.set_defaults(_run=run_verify)


def _layout(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not TP,PP,DP (three positive integers, e.g. 2,1,2)")
    return tuple(int(p) for p in parts)


def _foreign_kind(path: str) -> Optional[str]:
    """What to do with DIR when it is another framework's model folder (a Hugging Face folder, a
    Megatron-LM save folder or one of its iterations), or None."""
    from .checkpoint.hf_config import hf_to_fine_tune
    from .checkpoint.megatron import convert_first, is_megatron_folder
    if hf_to_fine_tune(path):  # (a HF folder used as --save too holds meshlm checkpoints: those are shown)
        return (f"{path} is a Hugging Face model folder (config.json + safetensors), not a meshlm checkpoint; "
                f"`meshlm convert --from-hf {path} --save CKPT_DIR` makes one (or give it to `meshlm pretrain "
                f"--load` to fine-tune it)")
    parent = os.path.dirname(os.path.normpath(path))
    save = path if is_megatron_folder(path) else parent if is_megatron_folder(parent) else None
    if save is None:
        return None
    return convert_first(path, save)


def folder_of(path: str, latest_only: bool = False) -> str:
    """The checkpoint folder DIR means: DIR itself when it holds a manifest, else the --save
    folder's checkpoint a load would take (``latest_only``: the tracker's, with no fallback).
    CheckpointError naming DIR when it is no folder, or a folder of neither kind."""
    if os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
        return path
    fix = "give a run's --save folder or one of its iter_XXXXXXX folders"
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: {'a file, not a folder' if os.path.exists(path) else 'no such folder'}; {fix}")
    foreign = _foreign_kind(path)
    if foreign:
        raise CheckpointError(foreign)
    if not os.path.isfile(os.path.join(path, ckpt.TRACKER)):
        inner = ckpt.save_folder_in(path)
        raise CheckpointError(f"{path}: not a checkpoint (neither {ckpt.TRACKER} nor {ckpt.MANIFEST}); "
                              + (f"{inner} is: give that" if inner else fix))
    note = io.StringIO()  # its fallback note names --load: said here of DIR
    with contextlib.redirect_stdout(note):
        if latest_only and os.path.isdir(path) and ckpt.read_tracker(path) is not None:
            found = ckpt.checkpoint_dir(path, ckpt.read_tracker(path))
        else:
            found = ckpt.checkpoint_dir(path)
    print(as_dir_argument(note.getvalue(), path), end="", flush=True)
    return found


def as_dir_argument(text: str, path: str) -> str:
    """A message of the loading code (which names --load and its fixes) said of the DIR argument
    ``path`` of `meshlm checkpoint inspect/verify`, which have no --load."""
    return (text.replace(f"--load {path}", path)
            .replace("; load an earlier iteration or re-save", "; give one of its earlier iter_XXXXXXX folders, or re-save")
            .replace("point --load at", "give"))


def _naming_dir(run):
    """run_inspect/run_verify with the loading code's CheckpointErrors said of DIR (as_dir_argument)."""
    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CheckpointError as e:
            raise CheckpointError(as_dir_argument(str(e), args.dir)) from None
    return wrapped


def _fail(problems: list) -> int:
    from .launch import ERROR_PREFIX
    for problem in problems:
        print(f"{ERROR_PREFIX}{problem}", file=sys.stderr)
    return 2


def tensor_table(folder: str) -> list:
    """[(key, global shape, dtype, bytes)] of every tensor in the folder's DCP metadata."""
    metadata = SafeReader(folder).read_metadata()
    rows = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
            rows.append((key, tuple(md.size), str(md.properties.dtype).replace("torch.", ""), nbytes))
    return rows


@_naming_dir
def run_inspect(args: argparse.Namespace) -> int:
    """Print what the checkpoint DIR holds; exit 0, or 2 with its problems (sizes against the manifest)."""
    folder = folder_of(args.dir)
    with reading(folder, args.dir):
        saved = ckpt.read_manifest(folder)
        rows = tensor_table(folder)
    problems = manifest.problems(folder, saved.get("files") or {})
    layout = " ".join(f"{k}={v}" for k, v in (saved.get("layout") or {}).items()) or "not recorded"
    files = saved.get("files") or {}
    print(f"checkpoint {folder}\niteration {saved.get('iteration')} | layout {layout} | world size "
          f"{saved.get('world_size')} | torch {saved.get('torch_version')} | {len(files)} files, "
          f"{sum(f['bytes'] for f in files.values()):,} bytes")
    width = max((len(k) for k, *_ in rows), default=0)
    print(f"{len(rows)} tensors, {sum(r[3] for r in rows):,} bytes:")
    for key, shape, dtype, nbytes in rows:
        print(f"  {key:<{width}}  {list(shape)!s:<16} {dtype:<9} {nbytes:>12,}")
    return _fail([f"{folder}: {p}" for p in problems]) if problems else 0


@_naming_dir
def run_verify(args: argparse.Namespace) -> int:
    """Check DIR's checksums, tensors, and loading at --layout; exit 0, or 2 with one line per problem."""
    folder = folder_of(args.dir, latest_only=True)
    with reading(folder, args.dir):
        saved = ckpt.read_manifest(folder)
    files = saved.get("files")
    if not isinstance(files, dict):
        return _fail([f"{folder}: {ckpt.MANIFEST} lists no files (saved before meshlm recorded checksums)"])
    problems = [f"{folder}: {p}" for p in manifest.problems(folder, files, checksums=True)]
    if not problems:
        problems += _read_everything(folder, args.dir)
    tp, pp, dp = args.layout
    if not problems:
        problems += _layout_problems(folder, args.layout)
    if not problems and tp * pp * dp == 1:
        problems += _trainer_load(folder)
    if problems:
        return _fail(problems)
    weights_only = all(key.startswith("model") for key, *_ in tensor_table(folder))  # convert's output
    loaded = "model weights: a weights-only checkpoint, which fine-tunes from iteration 0" if weights_only \
        else "model, optimizer, scheduler, RNG"
    what = f"loads at TP=1 PP=1 DP=1 through the trainer ({loaded})" \
        if tp * pp * dp == 1 else \
        f"fits TP={tp} PP={pp} DP={dp}; not loaded: that layout needs {tp * pp * dp} processes " \
        f"(this check runs in one)"
    print(f"ok: {folder}: {len(files)} files match their SHA-256, every tensor reads back; {what}")
    return 0


def _read_everything(folder: str, load: str) -> list:
    """Problems reading every tensor (through the safe reader) and every rank JSON."""
    try:
        with reading(folder, load):
            for name in sorted(os.listdir(folder)):
                if name.startswith("rank_") and name.endswith(".json") and \
                        "state" not in _load_json(os.path.join(folder, name)):
                    raise KeyError("state")
            ckpt.read_tensors(folder, [key for key, *_ in tensor_table(folder)])
    except CheckpointError as e:
        return [str(e)]
    return []


def _config_at(folder: str, layout: tuple):
    """The checkpoint's saved Config with the parallel layout set to ``layout`` (TP, PP, DP), and
    the saved run's global batch kept where it was the default (micro × accumulation × DP, which
    follows the DP): at another DP the LR schedule's decay samples differed from the saved ones,
    so a checkpoint saved at DP=2 "did not load" at --layout 1,1,1."""
    from .config import Config, global_batch
    saved = Config.from_dict(ckpt.read_config(folder))
    cfg = _at(saved, layout)
    t = cfg.training
    if t.global_batch_size is None:
        batch = global_batch(saved, ckpt.read_manifest(folder).get("world_size") or 1)
        if batch % (t.micro_batch_size * layout[2]) == 0:
            t.global_batch_size, t.gradient_accumulation_steps = batch, None
    return cfg


def _at(saved, layout: tuple):
    """A copy of the Config ``saved`` at ``layout`` (TP, PP, DP). What a run resumed there chooses
    itself is set as it may: CP 1, EP 1 (--layout has no EP; experts reshard to any EP), sequence
    parallelism where TP > 1 and it was on or MoE needs it, no hybrid optimizer instances."""
    from .config import zero_stage
    cfg = copy.deepcopy(saved)
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout[0], layout[1]
    p.context_parallel_size = p.expert_model_parallel_size = 1
    if layout[1] == 1:
        p.virtual_pipeline_model_parallel_size = p.num_layers_per_virtual_pipeline_stage = None
        p.decoder_first_pipeline_num_layers = p.decoder_last_pipeline_num_layers = None
    p.sequence_parallel = (p.sequence_parallel or bool(cfg.model.num_experts)) and layout[0] > 1
    p.overlap_param_gather = p.overlap_param_gather and zero_stage(p) >= 1
    p.num_distributed_optimizer_instances, p.outer_dp_sharding_strategy = 1, "no_shard"  # any DP
    return cfg


_NAMES = {"--tensor-model-parallel-size": "TP", "--pipeline-model-parallel-size": "PP"}


def _layout_problems(folder: str, layout: tuple) -> list:
    """The layout's rules (meshlm.validate, shapes only) for the saved config at ``layout``: one line
    per rule it breaks (the rule alone: validate's fix would change the saved model, which is
    fixed here), then one line naming the --layout values that fit (``_layout_fix``)."""
    from .config import Config
    try:
        with reading(folder):
            saved = Config.from_dict(ckpt.read_config(folder))
        broken = _rule_problems(saved, layout)
    except CheckpointError as e:
        return [str(e)]
    if not broken:
        return []
    where = f"{folder} at TP={layout[0]} PP={layout[1]} DP={layout[2]}"
    lines = []
    for problem in broken:
        rule = problem.split("; ")[0]
        for flag, name in _NAMES.items():
            rule = rule.replace(flag, name)
        lines.append(f"{where}: {rule}")
    return lines + [f"{where}: {_layout_fix(saved, layout)}"]


def _rule_problems(saved, layout: tuple) -> list:
    """validate's problems (shapes only, no files) for the Config ``saved`` at ``layout``."""
    from .validate import validate
    cfg = _at(saved, layout)
    cfg.checkpoint.save = cfg.checkpoint.load = cfg.checkpoint.save_interval = None
    cfg.logging.run_dir = cfg.logging.log_dir = cfg.logging.tensorboard_dir = None
    try:
        validate(cfg, world=layout[0] * layout[1] * layout[2], check_files=False, cuda=False)
    except ConfigError as e:
        return e.problems
    return []


def _layout_fix(saved, layout: tuple, most: int = 64) -> str:
    """The fix of a --layout the saved model does not fit: for each of TP, PP, DP, the values up to
    ``most`` that fit with the other two as given; where none does (another one is at fault), those
    that fit with the other two at 1."""
    def fitting(i: int, others: tuple) -> list:
        return [v for v in range(1, most + 1) if not _rule_problems(saved, others[:i] + (v,) + others[i + 1:])]

    parts = []
    for base in (layout, (1, 1, 1)):
        for i, name in enumerate(("TP", "PP", "DP")):
            values = fitting(i, base) if base[i] != 1 or base == (1, 1, 1) else []
            if values and values != [base[i]]:
                rest = " ".join(f"{n}={base[k]}" for k, n in enumerate(("TP", "PP", "DP")) if k != i)
                parts.append(f"{name} {_listed(values)} (with {rest})")
        if parts:
            break
    fits = "; ".join(parts) if parts else "no layout up to 64 per dimension"
    return f"verify keeps the flags the checkpoint was saved with, so give another --layout TP,PP,DP: it fits {fits}"


def _listed(values: list) -> str:
    """'1, 2 or 4'."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


@contextlib.contextmanager
def _world_of_one():
    """A gloo world of one for the block (the environment and any existing group left as found)."""
    from torch import distributed as dist

    from .parallel.mesh import init_distributed
    env, ours = dict(os.environ), not dist.is_initialized()
    if ours:  # not a job's worker: a world of one on a free port
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
            os.environ.pop(name, None)
    try:
        init_distributed()
        yield
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


def _trainer_load(folder: str) -> list:
    """Load ``folder`` into a model and optimizer built at TP=PP=DP=1 on CPU through the trainer's
    load_checkpoint (the path ``meshlm pretrain --load`` takes). The folder is offered to it as the
    only checkpoint of a scratch --load directory (a link and a tracker), so an iter_ folder that
    is not the latest is loaded as itself."""
    from .data.tokenizer import build_tokenizer
    from .model.chunks import build_model_chunks
    from .optim.distributed import build_optimizer
    from .optim.schedule import scheduler_for
    from .parallel.data import DistributedDataParallel
    from .parallel.mesh import ParallelState
    from .training import trainer
    cfg = _config_at(folder, (1, 1, 1))
    iteration = ckpt.read_manifest(folder)["iteration"]
    with tempfile.TemporaryDirectory() as root, _world_of_one():
        os.symlink(os.path.abspath(folder), ckpt.iteration_dir(root, iteration))
        with open(os.path.join(root, ckpt.TRACKER), "w") as fh:
            fh.write(f"{iteration}\n")
        cfg.checkpoint.load, cfg.checkpoint.save, cfg.checkpoint.verify_integrity = root, None, False
        try:
            tokenizer = build_tokenizer(cfg.data, cfg.model.vocab_size)
        except MeshlmError as e:  # outside the checkpoint: its config names the run's file
            return [f"{folder} not loaded through the trainer: the tokenizer the run trained with does not load "
                    f"({e}); the checkpoint names it by the run's path: put the file back there"]
        try:
            ps = ParallelState.build(1, 1, 1)
            chunks = build_model_chunks(cfg, ps, tokenizer.vocab_size, torch.float32)
            ddp = DistributedDataParallel(chunks, ps, cfg)
            run = trainer.Run(cfg, ps, tokenizer, None, None, chunks, ddp, build_optimizer(cfg, ps, chunks, ddp),
                              scheduler_for(cfg, 1), None, None, None, None, None)
            with contextlib.redirect_stdout(io.StringIO()):  # its "loaded checkpoint <scratch path>" line
                trainer.load_checkpoint(run)
        except MeshlmError as e:
            return [f"{folder} does not load at TP=1 PP=1 DP=1: {str(e).replace(root, folder)}"]
    return []
