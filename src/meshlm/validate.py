"""Config validation: every problem at once, each naming its flag and the fix.

``validate(cfg, world)`` checks a ``meshlm.config.Config`` and raises one ConfigError listing
every problem; it runs in the launching process before any worker starts. Positive sizes come
first (the other checks divide by them); then the parallel layout, the model shape, training and
optimizer settings, data/tokenizer combinations and, unless ``check_files=False``, the paths the
run reads (data, tokenizer, checkpoint).
"""

from __future__ import annotations

import os
from typing import Optional

from .config import Config, ModelConfig, head_dim, max_positions, query_groups, world_size_of
from .errors import ConfigError


def _nearest_multiples(value: int, step: int) -> str:
    lo = (value // step) * step
    hi = lo + step
    return f"{lo} or {hi}" if lo > 0 else f"{hi}"


def validate(cfg: Config, world: Optional[int] = None, check_files: bool = True) -> None:
    """Check the whole config; raise one ConfigError listing every problem.

    world: job size (default from the environment / --nproc-per-node). check_files: also check
    that the run has data and that data, tokenizer and checkpoint paths exist (off for checks of
    shapes alone, and before the embedded default corpus is prepared).

    Precision: --fp16 is an error without CUDA (no fp16 training on CPU: its kernels are slow or
    missing, and a loss scaler there only hides that). --bf16 is accepted on CPU so one config
    runs on both kinds of machine; the trainer keeps fp32 there and prints a note.
    """
    problems = _positive_problems(cfg)
    if problems:  # the checks below divide by these values
        raise ConfigError(problems)
    world = world_size_of(cfg) if world is None else world
    problems += _layout_problems(cfg, world)
    problems += _model_problems(cfg.model)
    problems += _training_problems(cfg)
    problems += _data_problems(cfg)
    if check_files:
        problems += _file_problems(cfg)
    if problems:
        raise ConfigError(problems)


def _positive_problems(cfg: Config) -> list:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    required = [("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                ("--context-parallel-size", p.context_parallel_size),
                ("--micro-batch-size", t.micro_batch_size), ("--num-layers", m.num_layers),
                ("--hidden-size", m.hidden_size), ("--num-attention-heads", m.num_attention_heads),
                ("--seq-length", m.seq_length), ("--train-iters", t.train_iters),
                ("--log-interval", t.log_interval), ("--eval-interval", t.eval_interval),
                ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)]
    optional = [("--global-batch-size", t.global_batch_size), ("--num-query-groups", m.num_query_groups),
                ("--kv-channels", m.kv_channels), ("--ffn-hidden-size", m.ffn_hidden_size),
                ("--vocab-size", m.vocab_size), ("--nproc-per-node", p.nproc_per_node),
                ("--max-position-embeddings", m.max_position_embeddings),
                ("--save-interval", cfg.checkpoint.save_interval), ("--exit-interval", t.exit_interval),
                ("--lr-decay-iters", cfg.optimizer.lr_decay_iters)]
    return [f"{name} must be a positive integer, got {value}"
            for name, value in required + [(n, v) for n, v in optional if v is not None]
            if value is None or value < 1]


def _layout_problems(cfg: Config, world: int) -> list:
    """World, batch, the divisibility rules of TP/CP and (from parallel.pipeline) of PP."""
    problems = []
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world % (tp * cp * pp):
        problems.append(f"world size {world} is not divisible by TP×CP×PP = {tp}×{cp}×{pp}; "
                        f"set --nproc-per-node to a multiple of {tp * cp * pp}")
        dp = 1
    else:
        dp = world // (tp * cp * pp)
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
        step = t.micro_batch_size * dp
        problems.append(f"--global-batch-size {t.global_batch_size} is not divisible by "
                        f"--micro-batch-size {t.micro_batch_size} × DP {dp} = {step}; "
                        f"nearest valid --global-batch-size: {_nearest_multiples(t.global_batch_size, step)}")
    if m.num_attention_heads % tp:
        problems.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    groups = query_groups(m)
    if m.num_query_groups and m.num_attention_heads % groups == 0:
        if groups >= tp and groups % tp:
            problems.append(f"--num-query-groups {groups} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
        elif groups < tp and tp % groups:
            problems.append(f"--tensor-model-parallel-size {tp} is not a multiple of "
                            f"--num-query-groups {groups}")
    if p.sequence_parallel and tp == 1:
        problems.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if cp > 1:
        problems.append(f"--context-parallel-size {cp}: context parallelism builds its process groups "
                        f"but does not train yet; use --context-parallel-size 1")
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer")
    if world % (tp * cp * pp) == 0:  # layers per stage, virtual stages, schedule
        from .parallel.pipeline import validate_pipeline
        problems += validate_pipeline(cfg, world)
    return problems


def _model_problems(m: ModelConfig) -> list:
    problems = []
    if m.hidden_size % m.num_attention_heads and not m.kv_channels:
        problems.append(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                        f"{m.num_attention_heads}; set --kv-channels or change one of them")
    if m.group_query_attention and not m.num_query_groups:
        problems.append("--group-query-attention needs --num-query-groups")
    groups = query_groups(m)
    if m.num_attention_heads % groups:
        problems.append(f"--num-query-groups {groups} does not divide --num-attention-heads "
                        f"{m.num_attention_heads}")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > max_positions(m):
        problems.append(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                        f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten "
                        f"--seq-length")
    if m.position_embedding_type == "rope" and head_dim(m) % 2:
        problems.append(f"--position-embedding-type rope needs an even head dimension, got {head_dim(m)} "
                        f"(--hidden-size / --num-attention-heads, or --kv-channels)")
    if not 0 <= m.hidden_dropout < 1 or not 0 <= m.attention_dropout < 1:
        problems.append("--hidden-dropout and --attention-dropout must be in [0, 1)")
    return problems


def _training_problems(cfg: Config) -> list:
    """Precision, learning-rate schedule, evaluation and checkpoint cadence."""
    problems = []
    t, o, c = cfg.training, cfg.optimizer, cfg.checkpoint
    if t.bf16 and t.fp16:
        problems.append("--bf16 and --fp16 are exclusive; pick one")
    if t.fp16:
        import torch
        if not torch.cuda.is_available():
            problems.append("--fp16 needs CUDA; on CPU train in fp32 (no flag) or --bf16")
    if o.lr < 0 or o.min_lr < 0:
        problems.append(f"--lr {o.lr} and --min-lr {o.min_lr} must not be negative")
    elif o.min_lr > o.lr:
        problems.append(f"--min-lr {o.min_lr} is above --lr {o.lr}")
    decay = o.lr_decay_iters or t.train_iters
    if o.lr_warmup_iters < 0:
        problems.append(f"--lr-warmup-iters must not be negative, got {o.lr_warmup_iters}")
    elif o.lr_warmup_iters > decay:
        problems.append(f"--lr-warmup-iters {o.lr_warmup_iters} exceeds the decay iterations {decay} "
                        f"(--lr-decay-iters, default --train-iters); lower --lr-warmup-iters")
    for name, value in [("--weight-decay", o.weight_decay), ("--clip-grad", o.clip_grad),
                        ("--eval-iters", t.eval_iters)]:
        if value < 0:
            problems.append(f"{name} must not be negative, got {value}")
    if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1) or o.adam_eps <= 0:
        problems.append("--adam-beta1/--adam-beta2 must be in [0, 1) and --adam-eps positive")
    if c.save_interval is not None and not c.save:
        problems.append(f"--save-interval {c.save_interval} needs --save (a checkpoint directory)")
    return problems


def _data_problems(cfg: Config) -> list:
    """Data source and tokenizer combinations (no file access)."""
    problems = []
    d, vocab = cfg.data, cfg.model.vocab_size
    from .data.gpt_dataset import split_weights
    try:
        split_weights(d.split)
    except ConfigError as e:
        problems += e.problems
    if d.mock_data and d.data_path:
        problems.append("--mock-data and --data-path are exclusive; pick one")
    if d.mock_data and not vocab:
        problems.append("--mock-data needs --vocab-size (the range of the random token ids)")
    if d.tokenizer_type == "HuggingFaceTokenizer" and not d.tokenizer_model:
        problems.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json)")
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        problems.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if d.tokenizer_type == "NullTokenizer" and not vocab:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size")
    if d.data_path and not d.tokenizer_type and not vocab:
        problems.append("--data-path needs --tokenizer-type (or --vocab-size with NullTokenizer)")
    if cfg.model_preset:
        from .model.presets import PRESETS
        if cfg.model_preset not in PRESETS:
            problems.append(f"--model {cfg.model_preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return problems


def _file_problems(cfg: Config) -> list:
    """No data at all, or missing data / tokenizer / checkpoint paths, each naming its flag."""
    problems = []
    d = cfg.data
    if not d.data_path and not d.mock_data:
        problems.append("no training data: give --data-path (see `meshlm preprocess`) or --mock-data")
    from .data.blend import parse_data_path
    try:
        for _, prefix in parse_data_path(d.data_path):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    problems.append(f"--data-path: {prefix + ext} does not exist "
                                    f"(run `meshlm preprocess` to make it)")
    except ConfigError as e:
        problems.extend(e.problems)
    # only the files the chosen tokenizer reads: a YAML's GPT-2 files do not block a switch to
    # --tokenizer-type HuggingFaceTokenizer on the command line
    used = {"HuggingFaceTokenizer": [("--tokenizer-model", d.tokenizer_model)],
            "GPT2BPETokenizer": [("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)]}
    for flag, path in used.get(d.tokenizer_type, []):
        if path and not os.path.exists(path):
            problems.append(f"{flag} {path}: no such file")
    load = cfg.checkpoint.load
    if load and not os.path.isdir(load) and load != cfg.checkpoint.save:
        problems.append(f"--load {load}: no such directory (with --save {load} too, a fresh run starts there)")
    if load:
        from .checkpoint.dist import check_loadable
        problems += check_loadable(load, cfg.checkpoint.save)
    return problems
