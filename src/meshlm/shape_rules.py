"""The numbers and the model shape of a config, as ``meshlm.validate`` words them: every numeric
flag's domain by one rule over the config's int/float fields, and the model's shape (heads dividing
the hidden size, query groups, positions, rotary dimensions, μP). A base module so that the planner
(``planner/predict.py``, modelling a recorded run for analyze and report) refuses what a launch
refuses instead of dividing by a size of 0; ``validate`` runs the same functions first.
"""

from __future__ import annotations

import dataclasses
import math

from .config import (Config, ModelConfig, config_fields, flag_of, head_dim, max_positions, query_groups, rotary_dim,
                     step_schedule)
from .values import kind_of


def shape_problems(cfg: Config) -> list:
    """The problems of cfg's numbers and model shape alone, as ``validate`` words them: every numeric
    flag's domain (``--seq-length 0``, ``--vocab-size -5``, …) and the model's shape (heads dividing
    the hidden size, query groups, rotary dimensions, …); no layout, data or folder check. ``meshlm
    plan`` refuses a config with these before it plans (one rule for both commands). Empty when fine."""
    sizes, problems = _numeric_problems(cfg)
    sizes = sizes or schedule_syntax_problems(cfg)  # the planner's global batch reads the schedule
    return sizes + problems if sizes else problems + _model_problems(cfg.model)


SCHEDULE_FLAG = "--step-batch-size-schedule"


def schedule_syntax_problems(cfg: Config) -> list:
    """The schedule's text (batches.parse_step_schedule); every later check reads the parsed
    schedule, so a caller stops at these as at a size of 0. Needs --seq-length ≥ 1."""
    text = cfg.training.step_batch_size_schedule
    if text is None:
        return []
    try:
        step_schedule(cfg)
    except ValueError as e:
        return [f"{SCHEDULE_FLAG} {text!r}: {e}"]
    return []


# The domain of every numeric flag, as one rule: finite and not negative; an int is a size, count
# or interval (≥ 1) unless listed as allowed to be 0; a float may be 0 unless listed as positive;
# a few have an upper bound (exclusive) as well.
_INT_MAY_BE_ZERO = {"seed", "eval_iters", "lr_warmup_iters", "lr_warmup_samples", "num_workers",
                    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                    "profile_step_start", "num_experts", "null_tokenizer_eod_id", "fp8_margin",
                    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "manual_gc_interval"}
_ELSEWHERE = {"null_tokenizer_pad_id"}  # -1 is Megatron's "no pad": data.tokenizer.null_ids_problem
_FLOAT_POSITIVE = {"norm_epsilon", "rotary_base", "rotary_percent", "init_method_std",
                   "initial_loss_scale", "min_loss_scale", "adam_eps", "moe_expert_capacity_factor",
                   "mup_width_mult", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim"}
_BELOW = {"hidden_dropout": (1, "1"), "attention_dropout": (1, "1"), "adam_beta1": (1, "1"),
          "adam_beta2": (1, "1"), "seed": (2 ** 32, "2**32")}


def _numeric_problems(cfg: Config) -> tuple:
    """(sizes, others): one line per numeric flag outside its domain. ``sizes`` are the ints that
    must be ≥ 1, which the other checks divide by; ``others`` the rest (NaN, inf, negative, …)."""
    sizes, others = [], []
    for sec, f in config_fields():
        typ = f.type if isinstance(f.type, str) else str(f.type)
        kind = kind_of(f)
        value = getattr(getattr(cfg, sec), f.name)
        if kind not in ("int", "float") or (value is None and "Optional" in typ) or f.name in _ELSEWHERE:
            continue
        flag = flag_of(f)
        if kind == "int" and f.name not in _INT_MAY_BE_ZERO:
            if value is None or value < 1:
                sizes.append(f"{flag} {value} is out of range: give a positive integer")
            continue
        noun = "an integer" if kind == "int" else "a number"
        hi, hi_text = _BELOW.get(f.name, (math.inf, ""))
        positive = f.name in _FLOAT_POSITIVE
        if value is None or not math.isfinite(value) or value < 0 or (positive and value == 0) or value >= hi:
            domain = f"in [0, {hi_text})" if hi_text else "> 0" if positive else "≥ 0"
            others.append(f"{flag} {value} is out of range: give {noun} {domain}")
    return sizes, others


def _model_problems(m: ModelConfig) -> list:
    problems = []
    if m.hidden_size % m.num_attention_heads and not m.kv_channels:
        problems.append(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                        f"{m.num_attention_heads}; set --kv-channels or change one of them")
    if m.openai_gelu and m.swiglu:
        problems.append("--openai-gelu chooses the GeLU of the GeLU MLP; --swiglu has none: drop one of them")
    groups = query_groups(m)
    if m.num_attention_heads % groups:
        problems.append(f"--num-query-groups {groups} does not divide --num-attention-heads "
                        f"{m.num_attention_heads}")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > max_positions(m):
        problems.append(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                        f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten "
                        f"--seq-length")
    if not m.add_position_embedding and m.position_embedding_type != "rope":  # as Megatron's validate_args
        problems.append("--no-position-embedding is deprecated (as in Megatron) and allowed only with "
                        "--position-embedding-type rope; use --position-embedding-type instead")
    if m.position_embedding_type == "rope" and head_dim(m) % 2:
        problems.append(f"--position-embedding-type rope needs an even head dimension, got {head_dim(m)} "
                        f"(--hidden-size / --num-attention-heads, or --kv-channels)")
    if m.rotary_percent > 1:
        problems.append(f"--rotary-percent {m.rotary_percent} is above 1; give the fraction of each head's "
                        f"dimensions to rotate, in (0, 1]")
    elif m.position_embedding_type != "rope" and m.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {m.rotary_percent} applies to rotary positions only; add "
                        f"--position-embedding-type rope or drop --rotary-percent")
    elif m.position_embedding_type == "rope" and 0 < m.rotary_percent and rotary_dim(m) == 0:
        problems.append(f"--rotary-percent {m.rotary_percent} × head dim {head_dim(m)} rotates no dimension; "
                        f"give at least {1 / head_dim(m):g}")
    return problems + _mup_problems(m)


_MUP_FIELDS = ("mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult",
               "mup_base_head_dim", "mup_attn_scale_power")


def _mup_problems(m: ModelConfig) -> list:
    """The --use-mup flags (meshlm/mup.py): set only with --use-mup, a width multiplier equal to
    the derived one, no MoE (μP's rule for the router is not implemented)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    if not m.use_mup:
        given = [flag_of(f) for f in dataclasses.fields(ModelConfig)
                 if f.name in _MUP_FIELDS and getattr(m, f.name) != defaults[f.name]]
        return [f"{' '.join(given)} need(s) --use-mup; add --use-mup or drop them"] if given else []
    problems = []
    base = m.mup_base_hidden_size or m.hidden_size
    if m.mup_width_mult is not None and base > 0 and not math.isclose(m.mup_width_mult, m.hidden_size / base):
        problems.append(f"--mup-width-mult {m.mup_width_mult} differs from --hidden-size / --mup-base-hidden-size "
                        f"= {m.hidden_size / base:g}; drop --mup-width-mult (it is derived) or fix the sizes")
    if m.num_experts:
        problems.append("--use-mup with --num-experts: μP for MoE routers and experts is not implemented; "
                        "drop one of them")
    return problems
