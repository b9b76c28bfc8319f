"""The ``meshlm`` command: pretrain, preprocess, tokenizer train, generate, convert, plan, analyze, report.

Each subcommand's flags come from the module that does the work (``config.add_config_args`` for
pretrain, ``data.preprocess.add_arguments``, …), and are only imported when that subcommand runs,
so ``meshlm --help`` is instant. A MeshlmError anywhere prints ``meshlm: error: <message>`` on
stderr (a config with several problems lists them) and exits with status 2, without a traceback.
A reader of stdout that leaves early (`meshlm checkpoint inspect CK | head`) ends any command
quietly with status 141, as a pipe's writer killed by SIGPIPE.

``meshlm pretrain`` without a data flag (--data-path, --train-data-path, --mock-data, …) trains on the embedded default: the
Python standard library's sources, a BPE tokenizer trained on them and :data:`EMBEDDED_DEFAULT`'s
small GPT; any flag still overrides those settings.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from importlib import import_module

from . import __version__, launch
from .errors import ConfigError, MeshlmError

# The embedded-default run: a small GPT (1.3M parameters) that drops validation loss by more than
# 2 nats from its first evaluation (before the first step) within 10 minutes on 2 cores, corpus, tokenizer, preprocessing,
# evaluation and sample included. On CPU it runs as TP=2 × PP=2 (4 gloo workers, 4 micro-batches
# per step through 1F1B); on CUDA as DP over every local GPU. Applied below --model, --config, flags.
EMBEDDED_DEFAULT = {
    "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
    "hidden_dropout": 0.0, "attention_dropout": 0.0,
    "micro_batch_size": 4, "global_batch_size": 16, "train_iters": 500,
    "lr": 2e-3, "min_lr": 2e-4, "lr_warmup_iters": 10, "lr_decay_style": "cosine",
    "weight_decay": 0.1, "adam_beta2": 0.95,
    "log_interval": 10, "eval_interval": 50, "eval_iters": 4, "eval_at_start": True, "split": "98,2,0",
}
EMBEDDED_DEFAULT_CPU_LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                               "nproc_per_node": 4}


def embedded_default() -> dict:
    """EMBEDDED_DEFAULT plus this machine's layout: TP=2 × PP=2 on CPU, DP over all GPUs on CUDA."""
    import torch
    if torch.cuda.is_available():
        return dict(EMBEDDED_DEFAULT)
    return dict(EMBEDDED_DEFAULT, **EMBEDDED_DEFAULT_CPU_LAYOUT)


# ----------------------------------------------------------------------------- pretrain

def _new_run_dir() -> str:
    """runs/<YYYYmmdd-HHMMSS>, with a -N suffix if that folder already exists."""
    base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while os.path.exists(path):
        path, n = f"{base}-{n}", n + 1
    return path


_WARMUP_FLAGS = {"lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"}


_BATCH_FLAGS = {"micro_batch_size", "global_batch_size", "gradient_accumulation_steps"}

# the tokenizer's flags, in the config's field names: the embedded default replaces them by its own BPE
_TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
                     "tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
                     "null_tokenizer_eod_id", "null_tokenizer_pad_id")


def _fit_embedded(cfg, explicit: set, world: int | None = None) -> None:
    """Fit the embedded default's batch, run length and warm-up (10 iterations) to the job and the
    user's flags. Batch (no batch flag given; none under the user's --step-batch-size-schedule): its global batch of 16 rounded up to a multiple of
    DP, the micro-batch the largest of at most 4 that divides a DP rank's share (8 GPUs: 16 as 2 ×
    DP 8; 3 GPUs: 18 as 3 × 2 × DP 3), so the run starts on any GPU count (world: the job's
    processes, default ``world_size_of``). Length: --train-samples replaces its --train-iters, a
    warm-up flag of the user's replaces its warm-up; otherwise the warm-up is at most a tenth of the
    decay length, so ``--train-iters 5`` runs (the full 10 from 100 iterations on); under
    --train-samples it is 10 global batches of samples."""
    from .config import dp_size, global_batch, world_size_of
    t, o = cfg.training, cfg.optimizer
    _fit_embedded_layout(cfg, explicit, world_size_of(cfg) if world is None else world)
    dp = max(1, dp_size(cfg, world_size_of(cfg) if world is None else world))
    if "step_batch_size_schedule" in explicit and "global_batch_size" not in explicit:
        t.global_batch_size = None  # the user's schedule sets the batch, not the default's 16
    elif not explicit & _BATCH_FLAGS and t.global_batch_size % (t.micro_batch_size * dp):
        share = -(-t.global_batch_size // dp)  # a DP rank's samples a step
        t.global_batch_size = share * dp
        t.micro_batch_size = max(m for m in range(1, t.micro_batch_size + 1) if share % m == 0)
    if "train_samples" in explicit and "train_iters" not in explicit:
        t.train_iters = None
    if explicit & _WARMUP_FLAGS:
        if "lr_warmup_iters" not in explicit:
            o.lr_warmup_iters = 0  # the user's warm-up flag replaces the default's
    elif t.train_iters is None:
        o.lr_warmup_samples = min(o.lr_warmup_iters * global_batch(cfg), (o.lr_decay_samples or t.train_samples) // 10)
        o.lr_warmup_iters = 0
    else:
        o.lr_warmup_iters = max(0, min(o.lr_warmup_iters, (o.lr_decay_iters or t.train_iters) // 10))


_LAYOUT_FLAGS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"}


def _fit_embedded_layout(cfg, explicit: set, world: int) -> None:
    """The embedded CPU layout (TP=2 × PP=2) where the user's flags allow it, else PP, TP or both
    dropped to 1, in that order (no layout flag given): --nproc-per-node 1 or 2, or --num-layers 1, were refused
    ('world size 1 is not divisible by TP×CP×PP = 2×1×2; set --nproc-per-node to a multiple of 4'),
    a layout the user never asked for."""
    from .config import ffn_hidden
    p, m = cfg.parallel, cfg.model
    if explicit & _LAYOUT_FLAGS:
        return
    tp0, pp0 = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    for tp, pp in ((tp0, pp0), (tp0, 1), (1, pp0), (1, 1)):
        if world % (tp * pp * p.context_parallel_size) == 0 and m.num_layers % pp == 0 and \
                m.num_attention_heads % tp == 0 and ffn_hidden(m) % tp == 0:
            p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
            return


def _lock(held: contextlib.ExitStack | None, folder: str, flag: str, run_dir: str) -> None:
    """Take ``folder``'s one-run-at-a-time lock (checkpoint.lock) until ``held`` closes."""
    if held is not None:
        from .checkpoint.lock import hold
        held.enter_context(hold(folder, run_dir, flag))


def _lock_logs(held: contextlib.ExitStack | None, cfg, set_aside) -> None:
    """Take the log folder's lock too where it is not the run directory (its ``logs``, or a
    --log-dir), so that a run given another run's log folder as --log-dir is refused instead of
    setting the running job's logs aside and writing its own metrics.jsonl among them. The folder
    is checked first (its lock taken and its file dropped, so that ``set_aside(log_dir)``, which may
    rename the folder, takes no lock file along), then set aside, then locked for the run."""
    from .checkpoint.lock import LOCK_FILE, hold
    from .folders import missing_top, remove_created
    run_dir = cfg.logging.run_dir
    log_dir = os.path.dirname(launch.worker_log_path(cfg, 0))
    own = held is not None and os.path.realpath(log_dir) != os.path.realpath(run_dir)
    flag = "--log-dir" if cfg.logging.log_dir else "--run-dir"
    if own:
        top = missing_top(log_dir)
        with hold(log_dir, run_dir, flag):
            os.unlink(os.path.join(log_dir, LOCK_FILE))
        remove_created(log_dir, top)  # the check's: the lock below makes it again (and removes it on a refusal)
    set_aside(log_dir)
    if own:
        _lock(held, log_dir, flag, run_dir)


def resolve_config(args: argparse.Namespace, held: contextlib.ExitStack | None = None):
    """Flags → validated Config with a run directory and data, written to <run_dir>/config.yaml.

    held: if given, the run directory's lock (checkpoint.lock) is taken right after the checks
    that need no corpus, before anything is written there, and the --save folder's lock after the
    full validation; both are kept until ``held`` closes. A folder another run uses raises
    CheckpointError. Notes on settings that do not do what they may seem to are printed first.

    Without data flags (--data-path, --train-data-path, …, --mock-data) the embedded default settings apply, its corpus is prepared in
    the run directory (after the shape checks, so a bad flag fails in a second, not a minute) and
    the model is saved to <run_dir>/checkpoints (unless --save), so the run ends with a sample.
    Raises ConfigError listing every problem, DataError for an unusable corpus.
    """
    from .config import dump_yaml, explicit_fields, world_size_of
    from .folders import space_errors_named
    from .validate import host_model_problems, notes, validate

    cfg, embedded = _config_and_source(args)
    run_dir = cfg.logging.run_dir = cfg.logging.run_dir or _new_run_dir()
    if embedded:  # saved there, so the run ends with a sample (before the notes: --async-save has a --save)
        cfg.checkpoint.save = cfg.checkpoint.save or os.path.join(run_dir, "checkpoints")
    print(f"meshlm: run directory {run_dir}", flush=True)
    from .megatron_flags import startup_lines
    from .checkpoint.convert import carry_dropout
    for note in notes(cfg) + startup_lines(args, explicit_fields(args)) + carry_dropout(cfg, explicit_fields(args)):
        print(f"meshlm: note: {note}", flush=True)
    world = world_size_of(cfg)
    validate(cfg, world, check_files=not embedded)
    host = host_model_problems(cfg, world, cuda=None)  # the workers start on this host
    if host:
        raise ConfigError(host)
    _lock(held, run_dir, "--run-dir", run_dir)
    _lock_logs(held, cfg, lambda log_dir: _set_aside(run_dir, log_dir) if not cfg.checkpoint.load and
               os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None)
    if embedded:
        from .data.corpus import prepare_default_corpus
        print("meshlm: no --data-path, --train-data-path or --mock-data: training on the embedded default "
              "corpus (the Python standard library's sources)", flush=True)
        with space_errors_named(f"--run-dir {run_dir}", run_dir):  # corpus, tokenizer, .bin/.idx
            corpus = prepare_default_corpus(run_dir)
        cfg.data.data_path = list(corpus["data_path"])
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = corpus["tokenizer_model"]
        validate(cfg, world)
    save = cfg.checkpoint.save
    locked = {os.path.realpath(run_dir), os.path.realpath(os.path.dirname(launch.worker_log_path(cfg, 0)))}
    if save and os.path.realpath(save) not in locked:  # one folder, one lock
        _lock(held, save, "--save", run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    dump_yaml(_with_absolute_log_dir(cfg), path)  # a full disk is one line (validate's probe file takes no block)
    print(f"meshlm: config {path}", flush=True)
    return cfg


def _with_absolute_log_dir(cfg):
    """cfg for config.yaml: a relative --log-dir made absolute (a copy), so that `meshlm analyze` and
    `meshlm report` find the run's metrics from any working directory, not only the launch's."""
    if not cfg.logging.log_dir or os.path.isabs(cfg.logging.log_dir):
        return cfg
    import copy
    out = copy.deepcopy(cfg)
    out.logging.log_dir = os.path.abspath(cfg.logging.log_dir)
    return out


def _set_aside(run_dir: str, log_dir: str) -> None:
    """A fresh run (no --load; not a torchrun restart, whose attempts share one log) into a run
    directory holding an earlier run's logs: rename them aside (run_logs.py) and print where."""
    from .run_logs import set_aside_old_logs
    try:
        note = set_aside_old_logs(run_dir, log_dir)
    except OSError as e:
        raise ConfigError([f"--run-dir {run_dir}: cannot move the earlier run's logs aside ({e.strerror}: "
                           f"{e.filename}); give another --run-dir or move them yourself"]) from None
    if note:
        print(f"meshlm: note: {note}", flush=True)


def _config_and_source(args: argparse.Namespace, world=None) -> tuple:
    """(Config from the flags, whether it trains on the embedded default): without data flags the
    embedded default's settings apply. Raises ConfigError when a data flag is given on the command
    line without a prefix (e.g. `--data-path $DATA_PATH` with DATA_PATH unset): never the embedded
    default instead; and when a tokenizer flag is given without a data flag (the embedded default
    trains its own BPE tokenizer, so the flag would be dropped). world: Config → the job's
    processes, that the embedded batch is fitted to (default: ``world_size_of``)."""
    from .config import config_from_args, explicit_fields
    from .data.sources import given_sources
    cfg = config_from_args(args)
    empty = [f"--{name.replace('_', '-')}" for name in ("data_path", "train_data_path", "valid_data_path",
                                                        "test_data_path")
             if f"data.{name}" in vars(args) and not getattr(cfg.data, name)]
    if empty:
        raise ConfigError([f"{flag} is given without a prefix; give the dataset prefix(es) (e.g. {flag} "
                           f"data/web_text_document), or drop the flag" for flag in empty])
    if given_sources(cfg.data):
        return cfg, False
    ignored = [name for name in _TOKENIZER_FIELDS if name in explicit_fields(args)]
    if ignored:  # the launch replaced them by its corpus's BPE tokenizer, silently; the dry run reported them
        from .data.corpus import DEFAULT_VOCAB
        flags = [f"--{name.replace('_', '-')}" for name in ignored]
        given = [f"{flag} {getattr(cfg.model if name == 'vocab_size' else cfg.data, name)}"
                 for flag, name in zip(flags, ignored)]
        raise ConfigError(f"{', '.join(given)}: given without a data flag, where the embedded default trains on its "
                          f"own corpus with its own BPE tokenizer of {DEFAULT_VOCAB} ids; give the --data-path "
                          f"preprocessed with it (meshlm preprocess), or drop {' and '.join(flags)}")
    cfg = config_from_args(args, base=embedded_default())
    _fit_embedded(cfg, explicit_fields(args), world(cfg) if world else None)
    return cfg, True


def _plan_config(args: argparse.Namespace) -> tuple:
    """(Config, False) for `meshlm plan`: from the flags alone (a plan needs no data, and under a
    launch script's model flags the embedded default's batch and length are not what it asks for);
    with no pretrain flag at all (no --model, --config or config flag: cluster flags only) the
    embedded default's model, batch and length with its tokenizer's vocabulary, what `meshlm
    pretrain` with no flags trains (one note says so; at --num-gpus, not its CPU layout). ConfigError
    for the numbers and shapes pretrain refuses (``validate.shape_problems``: the same rule)."""
    from .config import config_from_args, explicit_fields
    from .validate import exclusive_lengths, shape_problems
    bare = not (explicit_fields(args) or args.model_preset or args.config)
    cfg = config_from_args(args, base=EMBEDDED_DEFAULT if bare else None)
    if bare:
        from .data.corpus import DEFAULT_VOCAB
        _fit_embedded(cfg, set(), args.num_gpus or 1)
        cfg.model.vocab_size = DEFAULT_VOCAB
        m, t = cfg.model, cfg.training
        if args.train_tokens is not None:  # plan's own run length replaces the embedded one's
            t.train_iters = None
        length = f"{t.train_iters} iterations" if t.train_iters else f"--train-tokens {args.train_tokens:g}"
        print(f"meshlm plan: note: no pretrain flags: planning what `meshlm pretrain` with no flags trains (the "
              f"embedded default: {m.num_layers} layers, hidden {m.hidden_size}, sequence {m.seq_length}, its BPE "
              f"tokenizer's vocabulary of {DEFAULT_VOCAB}, global batch {t.global_batch_size}, {length}); give "
              f"your launch's flags (e.g. --model gpt2-125m) to plan that", file=sys.stderr, flush=True)
    elif args.train_tokens is not None:  # a --config's length, as the embedded one's (the flags' own: refused with it)
        cfg.training.train_iters = cfg.training.train_samples = None
    problems = shape_problems(cfg) + exclusive_lengths(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, False


def _dry_run(args: argparse.Namespace) -> int:
    """Check everything a launch checks for the job's world size, print the layout and per-rank
    memory, and return 0 without starting a worker (or writing anything)."""
    from .config import default_nproc, explicit_fields
    from .dry_run import report
    from .megatron_flags import startup_lines
    from .validate import job_size_problems, notes, validate

    nnodes = 1 if args.nnodes is None else args.nnodes
    problems = job_size_problems(args.world_size, nnodes)
    if problems:
        raise ConfigError(problems)
    def job(cfg):
        return args.world_size if args.world_size is not None else nnodes * default_nproc(cfg)
    cfg, embedded = _config_and_source(args, job)
    if embedded:  # the checkpoint folder its launch would save to (resolve_config)
        cfg.checkpoint.save = cfg.checkpoint.save or os.path.join(cfg.logging.run_dir or _new_run_dir(), "checkpoints")
    world = job(cfg)
    if args.nnodes is not None and world % nnodes:
        raise ConfigError(f"--world-size {world} is not whole nodes of --nnodes {nnodes}; give a multiple of {nnodes}")
    nproc = cfg.parallel.nproc_per_node
    if args.world_size is not None and args.nnodes is not None and nproc and nproc * nnodes != world:
        raise ConfigError(f"--world-size {world} is not --nnodes {nnodes} × --nproc-per-node {nproc} = "
                          f"{nnodes * nproc}; give two of the three")
    per_node = world // nnodes if args.nnodes is not None else min(world, default_nproc(cfg))
    from .checkpoint.convert import carry_dropout
    for note in notes(cfg) + startup_lines(args, explicit_fields(args)) + carry_dropout(cfg, explicit_fields(args)):
        print(f"meshlm: note: {note}", flush=True)
    sized_by = "--world-size" if args.world_size is not None else \
        "--nproc-per-node (× --nnodes)" if args.nnodes is not None else "--nproc-per-node"
    validate(cfg, world, check_files=not embedded, cuda=True, world_flag=sized_by)
    from .data.corpus import DEFAULT_VOCAB
    from .data.tokenizer import vocab_of
    # the embedded default's launch trains a BPE tokenizer of DEFAULT_VOCAB ids (not a 32,000 assumed)
    vocab = (DEFAULT_VOCAB, "the embedded default's BPE tokenizer") if embedded else vocab_of(cfg)
    for line in report(cfg, world, vocab):
        print(f"meshlm: dry run: {line}", flush=True)
    from .planner.gpus import PRESETS
    from .planner.lint import lint
    for warning in lint(cfg, world, per_node, PRESETS["H100-80GB"], vocab[0]):
        print(f"meshlm: dry run: warning: {warning}", flush=True)
    print("meshlm: dry run: all checks passed; no worker started", flush=True)
    return 0


def _run_pretrain(args: argparse.Namespace) -> int:
    from .config import config_from_args, default_nproc, dp_size

    if args.dry_run:
        return _dry_run(args)
    sized = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("nnodes", "world_size")
             if getattr(args, name) is not None]
    if sized:  # a launch that silently ran on one node's --nproc-per-node workers instead
        raise ConfigError(f"{' '.join(sized)} only size{'s' if len(sized) == 1 else ''} the job that --dry-run checks; a launch takes its size from "
                          f"--nproc-per-node (local workers) or from torchrun / Slurm (e.g. `torchrun --nnodes 2 "
                          f"--nproc-per-node 8 -m meshlm pretrain …`): add --dry-run, or drop {' and '.join(sized)}")

    if launch.is_self_launched_worker():  # re-entered with the resolved config.yaml
        return launch.run_worker(config_from_args(args))
    with contextlib.ExitStack() as held:  # the --run-dir and --save locks, held until the run ends
        if launch.in_launched_job():  # torchrun / srun started every rank; rank 0 resolves and locks
            return launch.run_worker(launch.resolve_on_rank0(lambda: resolve_config(args, held),
                                                             config_from_args(args)))
        cfg = resolve_config(args, held)
        nproc = default_nproc(cfg)
        if nproc == 1:
            return launch.run_worker(cfg)
        p = cfg.parallel
        print(f"meshlm: starting {nproc} workers: TP={p.tensor_model_parallel_size} "
              f"CP={p.context_parallel_size} PP={p.pipeline_model_parallel_size} DP={dp_size(cfg, nproc)}; "
              f"their logs go to {os.path.dirname(launch.worker_log_path(cfg, 0))}", flush=True)
        return launch.launch_local(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"), nproc, worker_main)


def worker_main(config_path: str, env: dict) -> None:
    """A self-launched worker's body (launch.launch_local forks it from its forkserver): ``meshlm
    pretrain --config config_path`` in this process, with ``env`` in its environment
    (launch.become_worker). Exits with pretrain's status (SystemExit) where that is not 0."""
    launch.become_worker(env)
    status = main(["pretrain", "--config", config_path])
    if status:
        raise SystemExit(status)


# ----------------------------------------------------------------------------- other commands

def _delegate(module: str, add: str, run: str):
    """A subcommand implemented in ``module``: the returned function adds its flags (``add``) and
    sets ``_run`` to the module's ``run`` function."""
    def add_arguments(parser):
        getattr(import_module(module, __package__), add)(parser)
        parser.set_defaults(_run=lambda args: getattr(import_module(module, __package__), run)(args))
    return add_arguments


def _add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE tokenizer (tokenizer.json) on a corpus",
                           description="Train a byte-level BPE tokenizer (tokenizer.json) on a corpus.",
                           allow_abbrev=False)
    _delegate(".data.tokenizer", "add_train_arguments", "run_train")(train)


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    import_module(".inspect_checkpoint", __package__).add_arguments(parser)


def _add_pretrain(parser: argparse.ArgumentParser) -> None:
    from .config import add_config_args, config_fields, flag_of
    from .megatron_flags import add_no_effect_args, help_epilog
    add_config_args(parser)
    run = parser.add_argument_group("dry run")
    run.add_argument("--dry-run", action="store_true", help="check the flags, files and layout, print the "
                     "layout and per-rank memory, exit without starting workers")
    run.add_argument("--nnodes", type=int, default=None, help="nodes of the job --dry-run checks (× "
                     "--nproc-per-node; default 1); only with --dry-run")
    run.add_argument("--world-size", type=int, default=None, help="processes of the job --dry-run checks; only "
                     "with --dry-run")
    add_no_effect_args(parser)
    parser.epilog = help_epilog({flag_of(f) for _, f in config_fields()})
    parser.set_defaults(_run=_run_pretrain)


def _add_plan(parser: argparse.ArgumentParser) -> None:
    """`meshlm plan`: pretrain's flags (any launch script can be planned) plus the cluster's."""
    from .config import add_config_args
    from .megatron_flags import add_no_effect_args
    add_config_args(parser)
    add_no_effect_args(parser)
    import_module(".planner.command", __package__).add_arguments(parser)
    parser.set_defaults(_run=lambda args: import_module(".planner.command", __package__).run(args, _plan_config))


COMMANDS = {
    "pretrain": ("train a GPT/Llama model (Megatron flags; embedded default corpus without data flags)",
                 _add_pretrain),
    "plan": ("plan a launch: per-rank memory, the fastest layouts that fit a cluster, with their flags "
             "(pretrain's flags + --num-gpus --gpus-per-node --gpu; --calibrate measures this machine)", _add_plan),
    "preprocess": ("tokenize jsonl/text files into Megatron .bin/.idx files",
                   _delegate(".data.preprocess", "add_arguments", "run")),
    "tokenizer": ("tokenizer tools: `meshlm tokenizer train`", _add_tokenizer_arguments),
    "generate": ("sample text from a trained checkpoint",
                 _delegate(".training.generate", "add_arguments", "run")),
    "checkpoint": ("checkpoint tools: `meshlm checkpoint inspect DIR`, `meshlm checkpoint verify DIR "
                   "[--layout TP,PP,DP]`", _add_checkpoint_arguments),
    "convert": ("convert between meshlm checkpoints and Hugging Face model folders (Llama, Mistral, Mixtral, "
                "GPT-2) or Megatron-LM torch_dist checkpoints",
                _delegate(".checkpoint.convert", "add_arguments", "run")),
    "analyze": ("read a run's metrics.jsonl: where the step time goes, the dominant cost, the flags that fix it",
                _delegate(".planner.analyze", "add_arguments", "run")),
    "sweep": ("search LR (and batch, warm-up, init std, width) on short proxy runs, grid or successive "
              "halving; a table, sweep.html and the flags for the full run",
              _delegate(".sweep", "add_arguments", "run")),
    "report": ("write an HTML report of one or more runs (curves, pipeline timeline; --trace for Perfetto)",
               _delegate(".report.page", "add_arguments", "run")),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as a ConfigError (one line, exit 2) instead of usage text,
    a value of the wrong kind in the config flags' words ("'1e3' is not an integer (write 1000)");
    the subcommands' parsers are of this class too."""

    def error(self, message):
        import re
        typed = re.fullmatch(r"(argument \S+): invalid (int|float) value: '(.*)'", message)
        if typed:  # a subcommand's own `type=int` flag: worded as the config flags' (values.flag_type)
            from .values import expected
            message = f"{typed[1]}: {typed[3]!r} is not {expected(typed[2], typed[3])}"
        raise ConfigError(f"{message}; see `{self.prog} --help`")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``meshlm`` parser; only ``command``'s own flags are built (they import their module)."""
    parser = _Parser(
        prog="meshlm", allow_abbrev=False, description="Megatron-style 3D-parallel LLM training on torch.distributed "
        "(gloo on CPU, NCCL on GPUs).", epilog="`meshlm COMMAND --help` shows a command's flags.")
    parser.add_argument("--version", action="version", version=f"meshlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           allow_abbrev=False)  # as Megatron: a truncated flag is an error, not a guess
        if name == command:
            add_arguments(p)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict:
    """{option string: action} of ``parser`` and of every subcommand parser built under it."""
    out = {}
    for action in parser._actions:
        out.update(dict.fromkeys(action.option_strings, action))
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            out.update(_options(sub))
    return out


def attach_dash_values(parser: argparse.ArgumentParser, argv: list) -> list:
    """``argv`` with each one-value flag followed by a word starting with a single '-' that is no
    flag (``--split -1,2,3``, ``--lr -1e-3``, ``--prompt -x``) written ``--flag=word``: argparse takes
    those for flags and says only "expected one argument", while joined the value reaches the flag's
    own check (a range error naming it) or is simply the value. Words after ``--`` are left as they
    are (sweep passes them on to its trials)."""
    options, out = _options(parser), []
    i = 0
    while i < len(argv):
        word, action = argv[i], options.get(argv[i])
        if word == "--":
            return out + argv[i:]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if (action is not None and action.nargs is None and nxt[:1] == "-" and nxt[:2] != "--"
                and nxt not in options):
            out.append(f"{word}={nxt}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


EMPTY_ALLOWED = {"--prompt"}  # generate: an empty prompt samples from nothing


def empty_values(parser: argparse.ArgumentParser, argv: list) -> list:
    """One line for each flag of ``argv`` given an empty value (``--save ""``, ``--save=``), which
    argparse takes and most commands then read as the flag left out: `--save $CKPT` with CKPT unset
    trained without saving, `--load $CKPT` started afresh. Flags in EMPTY_ALLOWED and words after
    ``--`` (sweep's trials check their own) are left alone."""
    options, found = _options(parser), []
    for i, word in enumerate(argv):
        if word == "--":
            break
        flag, eq, value = word.partition("=")
        action = options.get(flag)
        if action is None or action.nargs == 0 or flag in EMPTY_ALLOWED:
            continue
        if (eq and not value) or (not eq and i + 1 < len(argv) and argv[i + 1] == ""):
            found.append(f"{flag} is given an empty value (an unset shell variable?); give it a value, or drop "
                         f"the flag")
    return found


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR), so that a
    BrokenPipeError came from stdout and not from some other pipe or socket."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a test's StringIO), no poll (Windows)
        return False


def main(argv=None) -> int:
    """Entry point of ``meshlm`` and ``python -m meshlm``; returns the exit status.

    0 success; 2 a user error (MeshlmError or bad flags; one message on stderr); 1 a worker crash
    (its rank and log tail are printed); 130 interrupted; 141 (128 + SIGPIPE, no traceback) when
    the reader of stdout has gone (`meshlm checkpoint inspect CK | head`), for every command and
    --help. Other exceptions are bugs in meshlm and keep their traceback.
    """
    try:
        try:
            return _run_command(list(sys.argv[1:] if argv is None else argv))
        finally:  # a reader that left shows here (also under --help's SystemExit), not at the exit
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        with contextlib.suppress(OSError, ValueError):  # no second error when Python flushes at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a writer killed by SIGPIPE: `meshlm … | head` ends quietly


def _run_command(argv: list) -> int:
    """Parse ``argv`` and run its command; a MeshlmError or an interrupt as main() documents."""
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command)
        empty = empty_values(parser, argv)
        if empty:
            raise ConfigError(empty)
        args, extra = parser.parse_known_args(attach_dash_values(parser, argv))
        if extra:  # a Megatron flag meshlm lacks, or a typo: all of them in one line
            from .megatron_flags import refusal
            action = getattr(args, f"{command}_command", None)  # tokenizer train, checkpoint inspect, …
            named = f"{command} {action}" if action else command
            raise refusal(extra, command) if command in ("pretrain", "plan") else ConfigError(
                f"unrecognized arguments: {' '.join(extra)}; see `meshlm {named} --help`")
        return args._run(args) or 0
    except MeshlmError as e:
        print(f"{launch.ERROR_PREFIX}{launch.error_rank()}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not launch.is_self_launched_worker():  # a worker's launcher says it once for all of them
            print("meshlm: interrupted", file=sys.stderr)
        return 130
