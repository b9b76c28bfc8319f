"""Config validation: every problem at once, each naming its flag and the fix.

``validate(cfg, world)`` checks a ``meshlm.config.Config`` and raises one ConfigError listing
every problem; it runs in the launching process before any worker starts. The range of every
numeric flag comes first, by one rule over the config's int/float fields (the sizes the other
checks divide by must be positive before they run); then the parallel layout (including every
size split over TP, and MoE: parallel/layout_rules.py, which the planner shares), the model shape, training and optimizer settings, data/tokenizer
combinations, the folders the run writes and, unless ``check_files=False``, the paths the run
reads (data, tokenizer, checkpoint).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

from .config import (Config, batch_schedule, ffn_hidden, flag_of, global_batch, head_dim, moe_ffn, padded_vocab_size, query_groups,
                     run_iterations, world_size_of)
from .errors import ConfigError, DataError
from .fp8_rules import alignment_problems, fp8_problems, unused_history_note
from .shape_rules import _model_problems, _numeric_problems, schedule_syntax_problems, shape_problems  # noqa: F401
from .parallel import layout_rules


def validate(cfg: Config, world: Optional[int] = None, check_files: bool = True,
             cuda: Optional[bool] = None, world_flag: str = "--nproc-per-node") -> None:
    """Check the whole config; raise one ConfigError listing every problem.

    world: job size (default from the environment / --nproc-per-node), world_flag the flag that set
    it (named in a fix). check_files: also check
    that the run has data and that data and tokenizer paths exist (off for checks of shapes alone,
    and before the embedded default corpus is prepared); --load is checked either way. The folders the run writes
    (--save, --run-dir, --log-dir, …) are always checked: each must be, or be creatable as, a
    writable directory.

    Precision: --fp16 is an error without CUDA (no fp16 training on CPU: its kernels are slow or
    missing, and a loss scaler there only hides that). --bf16 is accepted on CPU so one config
    runs on both kinds of machine; the trainer keeps fp32 there and prints a note. cuda: whether
    the workers have CUDA (default: whether this machine has; --dry-run assumes GPU workers).
    As Megatron's validate_args, it turns --sequence-parallel off at TP = 1 (:func:`notes` says so).
    """
    sizes, problems = _numeric_problems(cfg)
    sizes = sizes or schedule_syntax_problems(cfg)
    if sizes:  # the checks below divide by these values or read the batch schedule
        raise ConfigError(sizes + problems)
    out_of_range = list(problems)
    layout_rules.adjust(cfg)
    world = world_size_of(cfg) if world is None else world
    problems += layout_rules.layout_problems(cfg, world, world_flag)
    problems += _model_problems(cfg.model)
    problems += layout_rules.moe_problems(cfg, world)
    problems += _training_problems(cfg, cuda)
    problems += _fp8_problems(cfg, cuda)
    problems += _run_length_problems(cfg, world)
    problems += _process_count_problems(cfg, world)
    problems += _data_problems(cfg)
    problems += _output_problems(cfg)
    problems += _profile_problems(cfg, world)
    if check_files:
        problems += _file_problems(cfg)
    problems += _load_problems(cfg)
    if not problems:  # the estimate and the schedule need a valid layout and shape
        problems += offload_host_problems(cfg, world) + _saved_schedule_problems(cfg, world)
    if problems:  # a problem two checks find (e.g. building the tokenizer repeats a flag check) once
        raise ConfigError(_once_per_flag(problems, out_of_range))


def _once_per_flag(problems: list, out_of_range: list) -> list:
    """problems without repeats, and without the later lines about a flag whose value the numeric
    rule already refused (``--lr-warmup-fraction -0.1`` is out of range; that it is no fraction adds
    nothing)."""
    refused = {p.split(" ", 1)[0] for p in out_of_range}
    return list(dict.fromkeys(p for p in problems if p in out_of_range or p.split(" ", 1)[0] not in refused))


def _training_problems(cfg: Config, cuda: Optional[bool]) -> list:
    """Precision, learning-rate schedule, evaluation and checkpoint cadence."""
    problems = []
    t, o, c = cfg.training, cfg.optimizer, cfg.checkpoint
    if t.bf16 and t.fp16:
        problems.append("--bf16 and --fp16 are exclusive; pick one")
    if t.fp16 and cuda is not True:
        import torch
        if not torch.cuda.is_available():
            problems.append("--fp16 needs CUDA; on CPU train in fp32 (no flag) or --bf16")
    if 0 <= o.lr < o.min_lr:
        problems.append(f"--min-lr {o.min_lr} is above --lr {o.lr}; lower --min-lr or raise --lr")
    problems += _decoupled_lr_problems(o)
    problems += _recompute_problems(t, cfg.model.num_layers)
    problems += _moment_dtype_problems(o)
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        problems.append(f"--optimizer-offload-fraction {o.optimizer_offload_fraction} is not a share: give 0 to 1")
    elif o.optimizer_offload_fraction != 1.0 and not o.optimizer_cpu_offload:
        problems.append(f"--optimizer-offload-fraction {o.optimizer_offload_fraction} needs --optimizer-cpu-offload")
    if c.save_interval is not None and not c.save:
        problems.append(f"--save-interval {c.save_interval} needs --save (a checkpoint directory)")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        problems.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive: "
                        "keep the first to use this run's LR schedule, the second to keep the checkpoint's")
    if c.keep_checkpoints == 1:  # below 1 is the numeric rule's
        problems.append("--keep-checkpoints 1 is too few: give at least 2 (a crash may damage the latest, "
                        "and loading then falls back to the one before)")
    return problems


def _moment_dtype_problems(o) -> list:
    """--exp-avg-dtype / --exp-avg-sq-dtype: fp32 or bf16, non-fp32 only with
    --use-precision-aware-optimizer (Megatron's rule) and not with offloaded shards."""
    problems = []
    for flag, value in (("--exp-avg-dtype", o.exp_avg_dtype), ("--exp-avg-sq-dtype", o.exp_avg_sq_dtype)):
        if value in ("fp16", "fp8"):
            with_flag = "" if o.use_precision_aware_optimizer else " with --use-precision-aware-optimizer"
            problems.append(f"{flag} {value}: meshlm keeps Adam moments in fp32 or bf16 ({value} needs per-tensor "
                            f"scaling it does not do); give {flag} bf16{with_flag}")
        elif value != "fp32" and not o.use_precision_aware_optimizer:
            problems.append(f"{flag} {value} needs --use-precision-aware-optimizer (as in Megatron-LM); add it or "
                            f"drop {flag}")
        elif value != "fp32" and o.optimizer_cpu_offload:
            problems.append(f"{flag} {value}: --optimizer-cpu-offload keeps its host shards' moments in fp32; "
                            f"drop one of the two")
    return problems


def _on_this_host(cfg: Config, world: int, available: Optional[float], half: bool):
    """(config with its global batch, Layout, planner memory.Memory of the largest rank, this node's
    ranks: LOCAL_WORLD_SIZE under torchrun else the workers meshlm starts, available host bytes:
    ``available`` or this host's), or None when the available memory cannot be read."""
    from .host_memory import available_bytes
    available = available_bytes() if available is None else available
    if available is None:
        return None
    import copy

    from .config import default_nproc
    from .data.tokenizer import vocab_of
    from .planner.layout import Layout
    from .planner.memory import estimate
    c = copy.deepcopy(cfg)
    c.training.global_batch_size = global_batch(cfg, world)
    layout = Layout.of(c, world)
    mem = estimate(c, layout, vocab_of(c)[0], half=half)
    return c, layout, mem, int(os.environ.get("LOCAL_WORLD_SIZE") or min(world, default_nproc(cfg))), available


def offload_host_problems(cfg: Config, world: int, available: Optional[float] = None) -> list:
    """--optimizer-cpu-offload: the host bytes of this node's ranks (planner/memory.py ``host_bytes``:
    the fraction's fp32 masters and moments, 12 bytes an element, plus the staging; × the local
    ranks, LOCAL_WORLD_SIZE under torchrun, else the workers meshlm starts) must not exceed
    ``available`` bytes (default: this host's, meshlm/host_memory.py). One line naming the flag, both
    figures and the largest fraction that fits; [] when it fits, without offload, or when the
    available memory cannot be read."""
    o = cfg.optimizer
    if not o.optimizer_cpu_offload or o.optimizer_offload_fraction == 0:
        return []
    half = bool(cfg.training.bf16 or cfg.training.fp16)
    here = _on_this_host(cfg, world, available, half)
    if here is None:
        return []
    from .planner.memory import GiB, largest_offload_fraction
    _, _, mem, local, available = here
    need = local * mem.host_bytes
    if need <= available:
        return []
    fit = largest_offload_fraction(mem, available / local, half=half)
    fix = (f"give --optimizer-offload-fraction {fit:.2f} or less (the rest stays on the GPU)" if fit > 0 else
           "no fraction fits: free host memory, or shard the optimizer over more GPUs (--use-distributed-optimizer)")
    return [f"--optimizer-offload-fraction {o.optimizer_offload_fraction:g} needs {need / GiB:.1f} GiB of host memory "
            f"({local} local rank(s) × {mem.host_bytes / GiB:.2f} GiB: fp32 masters and Adam moments, 12 bytes an "
            f"element, and the staging buffers) but {available / GiB:.1f} GiB is available on this host: {fix}"]


def host_model_problems(cfg: Config, world: int, cuda: Optional[bool], available: Optional[float] = None) -> list:
    """A CPU run (cuda False; None: this machine has no CUDA) whose model state does not fit the host:
    the largest rank's fp32 weights, grads and optimizer state (planner/memory.py ``estimate``, 16
    bytes a parameter with Adam) × this node's ranks against ``available`` bytes (default: this
    host's). One line naming the size and the flags that shrink or split it; [] when it fits, on
    GPU workers, or when the available memory cannot be read. Checked by `meshlm pretrain` before
    its workers start (not by ``validate``, whose verdict does not depend on this host). Without it,
    --hidden-size 10**9 failed in the model's constructor with a traceback and --num-layers 10**8
    built layers for minutes."""
    if cuda or (cuda is None and __import__("torch").cuda.is_available()):
        return []
    here = _on_this_host(cfg, world, available, half=False)
    if here is None:
        return []
    from .data.tokenizer import vocab_of
    from .planner.memory import GiB
    c, layout, mem, local, available = here
    state = mem.weights + mem.grads + mem.optimizer
    if local * state <= available:
        return _logits_problems(c, layout, vocab_of(c)[0], local, available)
    vocab = vocab_of(c)[0]
    padded = padded_vocab_size(vocab, c.model.make_vocab_size_divisible_by, c.parallel.tensor_model_parallel_size)
    padding = f", --make-vocab-size-divisible-by {c.model.make_vocab_size_divisible_by}: it pads the {vocab:,} ids " \
              f"to {padded:,} rows" if (padded - vocab) * c.model.hidden_size * 2 > mem.params else ""  # the pad sizes it
    return [f"the model does not fit this host's memory: a rank at {layout.describe()} holds {mem.params:,} parameters, "
            f"{state / GiB:.1f} GiB of fp32 weights, grads and optimizer state, × {local} local rank(s) = "
            f"{local * state / GiB:.1f} GiB, but {available / GiB:.1f} GiB is available; shrink the model "
            f"(--num-layers, --hidden-size, --ffn-hidden-size, --vocab-size{padding}) or split it over more ranks "
            f"(--tensor-model-parallel-size, --pipeline-model-parallel-size)"]


def _logits_problems(cfg: Config, layout, vocab: int, local: int, available: float) -> list:
    """host_model_problems' second part: the last stage's model state and one micro-batch's fp32
    logits, [micro, seq / CP, padded vocab / TP] × 4 bytes, which the CPU loss materializes whatever
    else a step keeps; both are less than the step needs. --micro-batch-size 10**9 on mock data
    collated samples for minutes before failing."""
    from .planner.memory import GiB, estimate
    mem = estimate(cfg, layout, vocab, half=False, stage=layout.pp - 1)
    m = cfg.model
    rows = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, layout.tp) // layout.tp
    logits = layout.micro_batch * (m.seq_length // layout.cp) * rows * 4
    need = local * (mem.weights + mem.grads + mem.optimizer + logits)
    if need <= available:
        return []
    return [f"a micro-batch does not fit this host's memory: its fp32 logits alone, --micro-batch-size "
            f"{layout.micro_batch} × --seq-length {m.seq_length} × {rows:,} vocabulary rows × 4 bytes = "
            f"{logits / GiB:.1f} GiB, with the last stage's model state, × {local} local rank(s) = {need / GiB:.1f} "
            f"GiB, but {available / GiB:.1f} GiB is available; lower --micro-batch-size or --seq-length"]


def _fp8_problems(cfg: Config, cuda: Optional[bool]) -> list:
    """--fp8-* (meshlm/fp8_rules.py); on GPU workers (here, or cuda=True) every GEMM size a multiple of 16."""
    if not cfg.training.fp8_format and not any(
            (cfg.training.fp8_recipe != "tensorwise", cfg.training.fp8_margin, cfg.training.first_last_layers_bf16,
             cfg.training.fp8_param_gather)):
        return []
    import torch
    gpu = None
    if cuda is not False and torch.cuda.is_available():
        gpu = (torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    problems = fp8_problems(cfg, gpu)
    if cfg.training.fp8_format and (gpu or cuda):
        m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
        ffn, d = ffn_hidden(m), head_dim(m)
        sizes = {"--hidden-size": m.hidden_size, "--ffn-hidden-size / TP": ffn // tp,
                 "query and key/value widths / TP": (m.num_attention_heads + 2 * query_groups(m)) * d // tp,
                 "heads × head dim / TP": m.num_attention_heads * d // tp}
        if m.num_experts:
            sizes["--moe-ffn-hidden-size"] = moe_ffn(m)
            if m.moe_shared_expert_intermediate_size:
                sizes["--moe-shared-expert-intermediate-size / TP"] = m.moe_shared_expert_intermediate_size // tp
        problems += alignment_problems(sizes, cfg.training.micro_batch_size * m.seq_length)
    return problems


# the LR schedule's lengths: (in iterations, in samples)
_LENGTHS = (("lr_warmup_iters", "lr_warmup_samples"), ("lr_decay_iters", "lr_decay_samples"),
            ("lr_wsd_decay_iters", "lr_wsd_decay_samples"))


def exclusive_lengths(cfg: Config) -> list:
    """[the one line] when both --train-iters and --train-samples are given (pretrain and plan), else []."""
    t = cfg.training
    if t.train_samples is not None and t.train_iters is not None:
        return [f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are exclusive; give one"]
    return []


# local processes a run may start per usable core (workers and their data-loader processes): far past
# what trains usefully, short of what would fork a machine to a standstill (--nproc-per-node 100000)
PROCESSES_PER_CORE = 32


def _process_count_problems(cfg: Config, world: int) -> list:
    """The processes of this node: --nproc-per-node × (1 + --num-workers), at most PROCESSES_PER_CORE a
    usable core (meshlm's preprocess caps its --workers likewise); under torchrun (LOCAL_WORLD_SIZE
    set) a --nproc-per-node that is not torchrun's, and in another launched job (RANK or
    SLURM_PROCID set) one above its WORLD_SIZE (``world``, the size validated: not a dry run's),
    which would be ignored (the launcher started the workers)."""
    from .parallel.mesh import usable_cores
    problems = []
    env, given = os.environ, cfg.parallel.nproc_per_node
    local = env.get("LOCAL_WORLD_SIZE")
    job = env.get("WORLD_SIZE", env.get("SLURM_NTASKS")) if "RANK" in env or "SLURM_PROCID" in env else None
    job = int(job) if job and job.isdigit() and int(job) == world else None  # the job's size, not a dry run's
    if local and given and given != int(local):
        problems.append(f"--nproc-per-node {given} is meshlm's own launcher's, but "
                        f"torchrun started this job with {local} processes on this node; drop it (torchrun's "
                        f"--nproc-per-node sizes the job)")
    elif not local and given and job and given > job:
        problems.append(f"--nproc-per-node {given} is meshlm's own launcher's, but this process is a rank of a job "
                        f"of {job} processes its launcher started (RANK and WORLD_SIZE, or srun's SLURM_PROCID "
                        f"and SLURM_NTASKS, in the environment), which would run with {job}: drop it (the "
                        f"launcher sizes the job), or, in a shell that is no job (`srun --pty bash` sets "
                        f"SLURM_PROCID), unset those variables to have meshlm start {given} workers itself")
    nproc, loaders = cfg.parallel.nproc_per_node or 1, cfg.data.num_workers
    count, cores = nproc * (1 + loaders), usable_cores()
    if count > PROCESSES_PER_CORE * cores:
        problems.append(f"--nproc-per-node {nproc} × (1 + --num-workers {loaders}) = {count:,} processes on this "
                        f"node's {cores} usable cores; meshlm starts at most {PROCESSES_PER_CORE * cores:,} "
                        f"({PROCESSES_PER_CORE} a core): lower --nproc-per-node or --num-workers")
    return problems


def _run_length_problems(cfg: Config, world: int) -> list:
    """--train-iters or --train-samples (exclusive), the LR schedule's lengths in the same unit,
    and --lr-warmup-fraction and WSD (Megatron's arguments.py rules for iteration- and
    sample-based training; a length in the other unit, which Megatron ignores or refuses, is refused)."""
    o, t = cfg.optimizer, cfg.training
    by_samples = t.train_samples is not None
    problems = exclusive_lengths(cfg)
    for iters, samples in _LENGTHS:
        wrong, right = (f"--{f.replace('_', '-')}" for f in ((iters, samples) if by_samples else (samples, iters)))
        value = getattr(o, wrong[2:].replace("-", "_"))
        if value and by_samples:  # None or 0: not given
            problems.append(f"{wrong} {value} counts iterations, but --train-samples makes the run sample-based; "
                            f"give {right} instead")
        elif value:
            problems.append(f"{wrong} {value} needs --train-samples (a sample-based run); with --train-iters "
                            f"give {right} instead")
    if t.rampup_batch_size is not None and not by_samples:
        problems.append("--rampup-batch-size needs --train-samples (the ramp is sample-based, as in Megatron); "
                        "give the run's length in samples instead of --train-iters")
    elif by_samples and batch_schedule(cfg, world).constant and t.train_samples < global_batch(cfg, world):
        problems.append(f"--train-samples {t.train_samples} is less than one global batch "
                        f"({global_batch(cfg, world)}): the run would take no step; raise --train-samples")
    unit, noun = ("samples", "samples") if by_samples else ("iters", "iterations")
    default = "--train-samples" if by_samples else "--train-iters"
    warmup = o.lr_warmup_samples if by_samples else o.lr_warmup_iters
    decay = getattr(o, f"lr_decay_{unit}") or (t.train_samples if by_samples else run_iterations(cfg, world))
    anneal = getattr(o, f"lr_wsd_decay_{unit}")
    exceeds = f"exceeds the decay {noun} {decay} (--lr-decay-{unit}, default {default})"
    if o.lr_warmup_fraction is not None and warmup:
        problems.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-{unit} {warmup} "
                        f"are exclusive; give one")
    if o.lr_warmup_fraction is not None and o.lr_warmup_fraction > 1:  # below 0: the numeric rule says it
        problems.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} is above 1; give a fraction "
                        f"of the decay {noun}, e.g. 0.01")
    if warmup > decay:
        problems.append(f"--lr-warmup-{unit} {warmup} {exceeds}; lower --lr-warmup-{unit}")
    if o.lr_decay_style == "WSD" and anneal is None:
        problems.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N ({noun} of the final anneal)")
    elif o.lr_decay_style == "WSD" and anneal > decay:
        problems.append(f"--lr-wsd-decay-{unit} {anneal} {exceeds}; lower --lr-wsd-decay-{unit}")
    return problems


def _recompute_problems(t, num_layers: int) -> list:
    """Megatron's rules for --recompute-* (transformer_config.py)."""
    problems = []
    if (t.recompute_num_layers or 0) > num_layers:
        problems.append(f"--recompute-num-layers {t.recompute_num_layers} exceeds --num-layers {num_layers}; "
                        f"give 1..{num_layers}")
    full = t.recompute_granularity == "full"
    if t.recompute_activations and full:
        problems.append("--recompute-activations means --recompute-granularity selective; "
                        "drop it to recompute full layers")
    if full and t.recompute_method is None:
        problems.append("--recompute-granularity full needs --recompute-method uniform or block")
    if full and t.recompute_num_layers is None:
        problems.append("--recompute-granularity full needs --recompute-num-layers N")
    if not full and t.recompute_method is not None:
        problems.append(f"--recompute-method {t.recompute_method} needs --recompute-granularity full")
    if not full and t.recompute_num_layers is not None:
        problems.append(f"--recompute-num-layers {t.recompute_num_layers} needs --recompute-granularity full")
    return problems


def _data_problems(cfg: Config) -> list:
    """Data source and tokenizer combinations (no file access)."""
    problems = []
    d, vocab = cfg.data, cfg.model.vocab_size
    from .data.gpt_dataset import split_weights
    from .data.sources import given_sources, source_problems, split_string
    try:
        if split_weights(split_string(d))[0] == 0:
            problems.append(f"--split {d.split} gives the training set no data; make the first "
                            f"(train) weight positive, e.g. 969,30,1")
    except ConfigError as e:
        problems += e.problems
    problems += source_problems(d)
    if d.mock_data and not vocab:
        problems.append("--mock-data needs --vocab-size (the range of the random token ids)")
    from .data.tokenizer import MODEL_FILE, implied_tokenizer_type, missing_files, special_tokens_problem
    if d.tokenizer_type in MODEL_FILE and not d.tokenizer_model:
        problems.append(missing_files(d.tokenizer_type))
    problems += [p for p in [special_tokens_problem(d.tokenizer_type, d.tokenizer_special_tokens)] if p]
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        problems.append(missing_files(d.tokenizer_type))
    if d.tokenizer_type == "NullTokenizer" and not vocab:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size")
    from .data.tokenizer import half_gpt2_problem, null_ids_problem
    problems += [p for p in [null_ids_problem(d, vocab), None if d.mock_data else half_gpt2_problem(d)] if p]
    files = [f for f in given_sources(d) if f != "--mock-data"]
    if files and not implied_tokenizer_type(d, vocab):  # the type the workers' build_tokenizer takes
        problems.append(f"{files[0]} needs --tokenizer-type (or --vocab-size with NullTokenizer)")
    if cfg.model_preset:
        from .presets import PRESETS
        if cfg.model_preset not in PRESETS:
            problems.append(f"--model {cfg.model_preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return problems


def _missing_data_fix(prefix: str) -> str:
    """The fix for a data prefix whose .bin/.idx is missing: drop a ".bin"/".idx" given with the
    prefix (Megatron's --data-path takes the path without them), else make the files."""
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        return f"give the prefix without {ext}: {stem}"
    return "run `meshlm preprocess` to make it"


def _file_problems(cfg: Config) -> list:
    """No data at all, or missing data / tokenizer paths, each naming its flag."""
    problems = []
    d = cfg.data
    from .data.sources import blends, given_sources, prefixes
    if not given_sources(d):
        problems.append("no training data: give --data-path (see `meshlm preprocess`) or --mock-data")
    try:
        data = blends(d)
        if d.per_split_data_args_path is not None and data[0][1] is None:
            problems.append(f"{data[0][0]}: no training data; give \"train\" a dataset")
        for flag, prefix in prefixes(data):
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                problems.append(f"{flag}: {prefix + missing[0]} does not exist ({_missing_data_fix(prefix)})")
            else:  # a .idx that is no index or a .bin it does not describe stopped the workers, not this check
                problems += _indexed_problems(flag, prefix)
    except ConfigError as e:
        problems.extend(e.problems)
    # only the files the chosen tokenizer reads: a YAML's GPT-2 files do not block a switch to
    # --tokenizer-type HuggingFaceTokenizer on the command line
    from .data.tokenizer import EXTRA_TYPES, MODEL_FILE, implied_tokenizer_type
    used = {"GPT2BPETokenizer": [("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)]}
    used.update({kind: [("--tokenizer-model", d.tokenizer_model)] for kind in MODEL_FILE})
    kind = implied_tokenizer_type(d)  # given, or implied by the files (data/tokenizer.py)
    missing = [f"{flag} {path}: no such file" for flag, path in used.get(kind, [])
               if path and not os.path.exists(path)]
    problems += missing
    if kind in EXTRA_TYPES and d.tokenizer_model and not missing:
        problems += _tokenizer_problems(cfg)
    return problems


def _decoupled_lr_problems(o) -> list:
    """--decoupled-min-lr needs --decoupled-lr (alone it changed nothing), and stays at or below it."""
    if o.decoupled_lr is None:
        return ["--decoupled-min-lr needs --decoupled-lr (the word embedding's and output layer's peak LR)"] \
            if o.decoupled_min_lr is not None else []
    low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
    if 0 <= o.decoupled_lr < low:
        flag = "--min-lr" if o.decoupled_min_lr is None else "--decoupled-min-lr"
        return [f"{flag} {low} is above --decoupled-lr {o.decoupled_lr}; lower {flag} (or give --decoupled-min-lr) "
                f"or raise --decoupled-lr"]
    return []


def _indexed_problems(flag: str, prefix: str) -> list:
    """The one-line reason the indexed dataset ``prefix`` (both files present) does not open —
    the .idx's magic, version, size and document index, the .bin's size against it — or []."""
    from .data.indexed import IndexedDataset
    try:
        IndexedDataset(prefix)
    except DataError as e:
        return [f"{flag}: {e}"]
    return []


def _load_problems(cfg: Config) -> list:
    """What is wrong with --load (missing, a file, no checkpoint in it, a HF folder the model flags
    do not describe), each naming the flag; checked with or without the data files (the embedded
    default's dry run, and its launch before the corpus is prepared, skipped it)."""
    problems = []
    load = cfg.checkpoint.load
    if load and os.path.exists(load) and not os.path.isdir(load):  # a fresh run cannot start in a file either
        problems.append(f"--load {load}: a file, not a directory; point --load at a run's --save directory "
                        f"(the one holding latest_checkpointed_iteration.txt) or a Hugging Face model folder")
    elif load and not os.path.isdir(load) and load != cfg.checkpoint.save:
        problems.append(f"--load {load}: no such directory (with --save {load} too, a fresh run starts there)")
    from .checkpoint.hf_config import hf_to_fine_tune
    if load and hf_to_fine_tune(load):  # a Hugging Face model to fine-tune
        from .checkpoint.convert import hf_load_problems
        problems += hf_load_problems(load, cfg.model)
    elif load:
        from .checkpoint.dist import check_loadable
        found = check_loadable(load, cfg.checkpoint.save)
        problems += found or _saved_model_problems(cfg)
    return problems


def _saved_model_problems(cfg: Config) -> list:
    """The workers' comparison of --load's model (its config.json, no tensor read) with the model
    flags, made before any worker starts, so a dry run finds it too: one line naming each differing
    flag, or []. The vocabulary is left to the workers (a tokenizer file's is not known here), and
    so is --finetune (it compares the tensors) and anything unreadable (the load says so)."""
    from .checkpoint import dist as ckpt
    from .checkpoint.state import model_config_differences
    from .errors import CheckpointError
    c = cfg.checkpoint
    if c.finetune or not c.load or ckpt.read_tracker(c.load) is None:
        return []
    try:
        path = ckpt.checkpoint_dir(c.load, quiet=True)
        diffs = model_config_differences(path, cfg.model, c.load)
    except (CheckpointError, OSError):
        return []
    diffs = [d for d in diffs if not d.startswith("--vocab-size ")]
    if not diffs:
        return []
    return [f"--load {c.load}: checkpoint {os.path.basename(os.path.normpath(path))} is of another model: "
            f"{', '.join(diffs)}; pass the saved values or start without --load"]


def _saved_schedule_problems(cfg: Config, world: int) -> list:
    """The workers' comparison of --load's LR schedule (one rank JSON, no tensor read) with this
    run's at ``world`` processes (optim/schedule.py ``load_state_dict``), made before any worker
    starts, so a dry run finds it too: its one line, or []. Nothing where the schedule is not loaded
    or not compared (--finetune, --no-load-optim, a weights-only folder, --override- or
    --use-checkpoint-opt_param-scheduler), nor for a checkpoint that does not read (the load says so)."""
    from .checkpoint import dist as ckpt
    from .checkpoint.convert import is_weights_only
    from .errors import CheckpointError
    from .optim.schedule import scheduler_for
    c = cfg.checkpoint
    if not c.load or c.finetune or c.no_load_optim or c.override_opt_param_scheduler or \
            c.use_checkpoint_opt_param_scheduler or is_weights_only(c.load) or ckpt.read_tracker(c.load) is None:
        return []
    try:
        # rank 0's JSON alone: every rank saves the same schedule (a large job's thousands are not all read)
        saved = ckpt.shared_value(ckpt.checkpoint_dir(c.load, quiet=True), "scheduler")
        scheduler_for(cfg, world).load_state_dict(saved, "check", c.load)
    except CheckpointError as e:
        return [str(e)]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return []


def _tokenizer_problems(cfg: Config) -> list:
    """What building a SentencePiece or tiktoken tokenizer finds wrong (a file of another kind, a
    vocabulary too small for --vocab-size, …): these files are cheap to read, so read them here."""
    from .data.tokenizer import build_tokenizer
    from .errors import MeshlmError
    try:
        build_tokenizer(cfg.data, cfg.model.vocab_size)
    except ConfigError as e:
        return e.problems
    except MeshlmError as e:
        return [str(e)]
    return []


def job_size_problems(world_size: Optional[int], nnodes: int) -> list:
    """The job a --dry-run checks: --world-size (None: --nnodes × --nproc-per-node) and --nnodes
    must be positive (a 0 world size used to be read as unset, a 0 node count divided by zero)."""
    problems = []
    if world_size is not None and world_size < 1:
        problems.append(f"--world-size {world_size} is out of range: give the job's process count (1 or more), "
                        f"or leave it out for --nnodes × --nproc-per-node")
    if nnodes < 1:
        problems.append(f"--nnodes {nnodes} is out of range: give the job's node count (1 or more)")
    return problems


def _profile_problems(cfg: Config, world: int) -> list:
    from .training.profiling import problems  # imports torch: only when a config is checked
    return problems(cfg, world)


def _output_problems(cfg: Config) -> list:
    """Each folder the run writes is a directory, or can be created as one, and is writable; a
    --data-cache-path already holding sample indices may be read-only (a shared cache built once:
    Megatron loads it; one it lacks is a one-line DataError when it would be written)."""
    from .data.gpt_dataset import holds_index_cache
    from .folders import output_folder_problem
    c, lg, cache = cfg.checkpoint, cfg.logging, cfg.data.data_cache_path
    folders = [("--save", c.save), ("--run-dir", lg.run_dir), ("--log-dir", lg.log_dir),
               ("--tensorboard-dir", lg.tensorboard_dir), ("--data-cache-path", None if holds_index_cache(cache) else cache)]
    return [p for p in (output_folder_problem(flag, path) for flag, path in folders if path) if p]


def notes(cfg: Config) -> list:
    """Settings that are valid but do not do what they may seem to: one line each, printed at start."""
    m, c = cfg.model, cfg.checkpoint
    lines = []
    moe = [flag_of(f) for f in dataclasses.fields(m) if f.name.startswith("moe_")
           and getattr(m, f.name) != (f.default_factory() if f.default is dataclasses.MISSING else f.default)]
    if moe and not m.num_experts:
        lines.append(f"{' '.join(moe)} ignored without --num-experts: every layer keeps a dense MLP; add "
                     f"--num-experts N for MoE layers")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        lines.append("--sequence-parallel is turned off at --tensor-model-parallel-size 1 (as Megatron does): "
                     "it splits activations over TP ranks, and there is one")
    if m.num_query_groups and not m.group_query_attention:
        lines.append(f"--num-query-groups {m.num_query_groups} is ignored without --group-query-attention "
                     f"(as in Megatron): every attention head keeps its own key/value head; add "
                     f"--group-query-attention to use {m.num_query_groups} groups")
    if cfg.training.fp8_format and m.num_experts:
        lines.append("--fp8-format with --num-experts: the routed experts run in FP8 too (rowwise, grouped FP8 "
                     "GEMMs), which trains slower than bf16 experts at small widths (0.57x bf16's tokens/s for "
                     "mixtral-small, hidden 1024, on one H200: bench/RESULTS.md); the dense layers gain as usual")
    if unused_history_note(cfg.training):
        lines.append(unused_history_note(cfg.training))
    if cfg.logging.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        lines.append(f"--tensorboard-dir {cfg.logging.tensorboard_dir}: the tensorboard package is not installed, "
                     f"so no TensorBoard logs are written (as in Megatron; metrics.jsonl has every figure); "
                     f"pip install tensorboard")
    switches = [flag for flag, on in (("--finetune", c.finetune), ("--no-load-optim", c.no_load_optim),
                                      ("--no-load-rng", c.no_load_rng),
                                      ("--override-opt_param-scheduler", c.override_opt_param_scheduler),
                                      ("--use-checkpoint-opt_param-scheduler",
                                       c.use_checkpoint_opt_param_scheduler)) if on]
    if switches and not c.load:
        lines.append(f"{' '.join(switches)} ignored without --load (as in Megatron): the run starts from "
                     f"its initial weights; add --load CHECKPOINT_DIR to start from a checkpoint")
    fresh = "--finetune" if c.finetune else "--no-load-optim" if c.no_load_optim else None
    if c.load and fresh and (c.override_opt_param_scheduler or c.use_checkpoint_opt_param_scheduler):
        flag = "--override" if c.override_opt_param_scheduler else "--use-checkpoint"
        lines.append(f"{flag}-opt_param-scheduler ignored with {fresh} (as in Megatron): the checkpoint's LR "
                     f"schedule is not loaded, so this run's flags set it, from step 0")
    from .data.tokenizer import ignored_tokenizer_files, ignored_vocab_size
    if not cfg.data.mock_data:
        lines += [line for line in (ignored_vocab_size(cfg.data, m.vocab_size),
                                    ignored_tokenizer_files(cfg.data, m.vocab_size)) if line]
    if c.verify_integrity and not c.load:
        lines.append("--verify-integrity ignored without --load: it checks the checkpoint a run loads")
    if c.async_save and not c.save:
        lines.append("--async-save ignored without --save: this run writes no checkpoint; add --save DIR")
    keep = next(f.default for f in dataclasses.fields(c) if f.name == "keep_checkpoints")
    if c.keep_checkpoints != keep and not c.save:
        lines.append(f"--keep-checkpoints {c.keep_checkpoints} ignored without --save: this run writes no "
                     f"checkpoint; add --save DIR")
    t = cfg.training
    if t.exit_signal != next(f.default for f in dataclasses.fields(t) if f.name == "exit_signal") \
            and not t.exit_signal_handler:
        lines.append(f"--exit-signal {t.exit_signal} ignored without --exit-signal-handler: {t.exit_signal} ends "
                     f"the run at once, with nothing saved; add --exit-signal-handler to stop after the "
                     f"iteration (and save, with --save)")
    from .training.profiling import notes as profile_notes
    return lines + profile_notes(cfg)
