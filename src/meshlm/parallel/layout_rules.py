"""The parallel layout's rules: which world, batch, TP/CP/PP/EP sizes a config may run with.

Each function returns every problem as a line naming the flag and the fix: ``layout_problems``
(world, batch, gradient accumulation, the --rampup-batch-size ramp and --step-batch-size-schedule
(batch_rules.py), every size split over TP, CP,
and the pipeline's rules from parallel/pipeline.py), ``moe_problems`` (MoE and EP flags). meshlm.validate
checks a launch with them, the planner every layout it ranks. ``adjust`` is what Megatron changes
rather than refuses.
"""

from __future__ import annotations

from typing import Optional

from ..config import Config, SHARDING, ffn_hidden, global_batch, head_dim, moe_layer_pattern, query_groups, zero_stage
from .batch_rules import nearest_multiples as _nearest_multiples, step_schedule_problems
from ..errors import ConfigError


def layout_problems(cfg: Config, world: int, world_flag: str = "--nproc-per-node") -> list:
    """World, batch, the divisibility rules of TP/CP and (from parallel.pipeline) of PP.
    world_flag: the flag that sized ``world``, named in the fix of a world TP×CP×PP does not divide
    (--nproc-per-node for a launch, --world-size for a dry run, --num-gpus for meshlm plan)."""
    problems = []
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world % (tp * cp * pp):
        problems.append(f"world size {world} is not divisible by TP×CP×PP = {tp}×{cp}×{pp}; "
                        f"set {world_flag} to a multiple of {tp * cp * pp}")
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
    if groups != m.num_attention_heads and m.num_attention_heads % groups == 0:
        if groups >= tp and groups % tp:
            problems.append(f"--num-query-groups {groups} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
        elif groups < tp and tp % groups:
            problems.append(f"--tensor-model-parallel-size {tp} is not a multiple of "
                            f"--num-query-groups {groups}")
    problems += _accumulation_problems(t, dp)
    problems += _rampup_problems(cfg, world, dp)
    problems += step_schedule_problems(cfg, world, dp)
    problems += _tp_split_problems(cfg)
    problems += _context_problems(cfg)
    problems += sharding_problems(cfg, dp)
    if world % (tp * cp * pp) == 0:  # layers per stage, virtual stages, schedule
        from .pipeline import validate_pipeline
        problems += validate_pipeline(cfg, world)
    return problems


def sharding_problems(cfg: Config, dp: int) -> list:
    """The ZeRO flags: contradictory pairs, each named with both flags, and the hybrid groups."""
    p, problems = cfg.parallel, []
    strategy, stage = p.data_parallel_sharding_strategy, zero_stage(p)
    if p.use_torch_fsdp2 and SHARDING[strategy] not in (0, 3):
        problems.append(f"--use-torch-fsdp2 shards parameters, gradients and optimizer (ZeRO-3) but "
                        f"--data-parallel-sharding-strategy is {strategy}: drop one of the two")
    if p.torch_fsdp2_no_reshard_after_forward and stage != 3:
        problems.append("--torch-fsdp2-no-reshard-after-forward keeps ZeRO-3's gathered parameters: it needs "
                        "--data-parallel-sharding-strategy optim_grads_params (or --use-torch-fsdp2); add one or drop it")
    if p.overlap_param_gather and stage == 0:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer (or "
                        "--data-parallel-sharding-strategy optim or above)")
    n, group = p.num_distributed_optimizer_instances, dp * p.context_parallel_size
    if n > 1 and stage == 0:
        problems.append(f"--num-distributed-optimizer-instances {n} needs a sharded strategy: add "
                        "--use-distributed-optimizer or --data-parallel-sharding-strategy optim_grads(_params)")
    elif n > 1 and group % n:
        problems.append(f"--num-distributed-optimizer-instances {n} does not divide DP × CP = {group}: "
                        f"use a divisor of {group}")
    if p.outer_dp_sharding_strategy != "no_shard" and n == 1:
        problems.append(f"--outer-dp-sharding-strategy {p.outer_dp_sharding_strategy} needs "
                        "--num-distributed-optimizer-instances > 1 (the replicas it shards across)")
    return problems


def moe_problems(cfg: Config, world: int) -> list:
    """MoE flags (Megatron's rules): k ≤ experts, experts split evenly over EP, EP inside DP × CP,
    sequence parallelism under TP (each TP rank routes its own s/tp tokens), the layer pattern."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if not m.num_experts:
        return [f"--expert-model-parallel-size {ep} needs --num-experts"] if ep > 1 else []
    problems = []
    if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
        problems.append(f"--moe-router-load-balancing-type {m.moe_router_load_balancing_type}: not supported by "
                        f"meshlm, which has aux_loss (with --moe-aux-loss-coeff) and none")
    try:
        moe_layer_pattern(m)
    except ConfigError as e:
        problems.append(str(e))
    if m.moe_router_topk > m.num_experts:
        problems.append(f"--moe-router-topk {m.moe_router_topk} is more than --num-experts {m.num_experts}")
    if m.num_experts % ep:
        problems.append(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    dpcp = world // max(1, tp * p.pipeline_model_parallel_size)
    if dpcp % ep:
        problems.append(f"--expert-model-parallel-size {ep} must divide DP × CP = {dpcp} (experts split the "
                        f"data-parallel ranks); use a divisor of {dpcp} or more processes")
    if tp > 1 and not p.sequence_parallel:
        problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as in Megatron-LM)")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron-LM)")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        problems.append(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    return problems


def _accumulation_problems(t, dp: int) -> list:
    """--gradient-accumulation-steps N states the global batch as micro × N × DP; with
    --global-batch-size too, both must agree."""
    n = t.gradient_accumulation_steps
    if n is None or t.global_batch_size is None or t.global_batch_size == t.micro_batch_size * n * dp:
        return []
    return [f"--gradient-accumulation-steps {n} gives a global batch of --micro-batch-size "
            f"{t.micro_batch_size} × {n} × DP {dp} = {t.micro_batch_size * n * dp}, not --global-batch-size "
            f"{t.global_batch_size}; drop one of the two flags or make them agree"]


def _tp_split_problems(cfg: Config) -> list:
    """Rows each TP rank takes a 1/TP share of: the MLP width, the fused K/V rows when there are
    fewer query groups than TP ranks, and the sequence under --sequence-parallel."""
    problems = []
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    ffn = ffn_hidden(m)
    if ffn % tp:
        default = "" if m.ffn_hidden_size else " (the default MLP width from --hidden-size)"
        problems.append(f"--ffn-hidden-size {ffn}{default} is not divisible by --tensor-model-parallel-size "
                        f"{tp}; set --ffn-hidden-size to {_nearest_multiples(ffn, tp)}")
    groups, d = query_groups(m), head_dim(m)
    if groups < tp and tp % groups == 0 and (2 * groups * d) % tp:
        problems.append(f"the fused key/value rows 2 × --num-query-groups {groups} × head dim {d} are not "
                        f"divisible by --tensor-model-parallel-size {tp}; change --kv-channels "
                        f"(or --hidden-size) so that 2 × head dim is a multiple of {tp // groups}")
    if cfg.parallel.sequence_parallel and m.seq_length % tp:
        problems.append(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                        f"(needed by --sequence-parallel); use --seq-length "
                        f"{_nearest_multiples(m.seq_length, tp)}")
    return problems


def _context_problems(cfg: Config) -> list:
    """Context parallelism (parallel/context.py): 2·CP equal chunks of the sequence, SP's share of
    a CP rank's s/CP rows, no attention dropout in the CP attention."""
    m, p = cfg.model, cfg.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return []
    problems = []
    if m.seq_length % (2 * cp):
        problems.append(f"--seq-length {m.seq_length} is not divisible by 2 × --context-parallel-size {cp} "
                        f"(each CP rank holds 2 of 2·CP equal chunks); use --seq-length "
                        f"{_nearest_multiples(m.seq_length, 2 * cp)}")
    elif p.sequence_parallel and (m.seq_length // cp) % tp:
        problems.append(f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
                        f"--tensor-model-parallel-size {tp} (needed by --sequence-parallel); use --seq-length "
                        f"{_nearest_multiples(m.seq_length, cp * tp * 2)}")
    if m.attention_dropout:
        default = " (the default, as Megatron's)" if m.attention_dropout == type(m)().attention_dropout else ""
        problems.append(f"--attention-dropout {m.attention_dropout}{default}: the context-parallel attention has "
                        f"no dropout; set --attention-dropout 0 with --context-parallel-size {cp}")
    return problems


def _ramp_malformed(ramp) -> Optional[str]:
    """The line for a --rampup-batch-size that is not three positive integers, else None."""
    if len(ramp) != 3 or min(ramp) < 1:
        return f"--rampup-batch-size {' '.join(map(str, ramp))}: give three positive integers START INCREMENT SAMPLES"
    return None


def ramp_shape_problems(ramp, final: int) -> list:
    """The --rampup-batch-size START INCREMENT SAMPLES rules no layout changes (three positive
    integers; START below the global batch ``final``; INCREMENT dividing the gap), one line each:
    a ramp breaking them has no batch schedule (its samples per increment divide by zero), so
    `meshlm plan` checks them before it walks the schedule, as a launch does."""
    flag, malformed = "--rampup-batch-size", _ramp_malformed(ramp)
    if malformed:
        return [malformed]
    start, increment, _ = ramp
    if start >= final:
        return [f"{flag}: START {start} must be below the global batch {final} it ramps up to "
                f"(--global-batch-size); lower START or drop the ramp"]
    if (final - start) % increment:
        return [f"{flag}: INCREMENT {increment} does not divide the ramp from START {start} to the "
                f"global batch {final} ({final - start} samples)"]
    return []


def _rampup_problems(cfg: Config, world: int, dp: int) -> list:
    """--rampup-batch-size START INCREMENT SAMPLES: Megatron's checks (num_microbatches_calculator.py),
    made before the run: every batch of the ramp splits into whole micro-batches over DP (START and
    INCREMENT multiples of micro × DP), the ramp ends at the global batch (START below it,
    INCREMENT dividing the gap), SAMPLES ≥ 1, and the pipeline schedule fits every batch."""
    t = cfg.training
    ramp, flag = t.rampup_batch_size, "--rampup-batch-size"
    if ramp is None:
        return []
    malformed = _ramp_malformed(ramp)
    if malformed:
        return [malformed]
    final = global_batch(cfg, world)
    start, increment, _ = ramp
    step = t.micro_batch_size * dp
    problems = [f"{flag}: {name} {value} is not divisible by --micro-batch-size {t.micro_batch_size} × DP {dp} "
                f"= {step}; nearest valid {name}: {_nearest_multiples(value, step)}"
                for name, value in (("START", start), ("INCREMENT", increment)) if value % step] + \
        ramp_shape_problems(ramp, final)
    if problems:
        return problems
    from .batch_rules import interleaved_problems
    return interleaved_problems(cfg, world, flag, "the ramp's", "START and INCREMENT")


def adjust(cfg: Config) -> None:
    """What Megatron's validate_args changes rather than refuses: --sequence-parallel is turned off
    at TP = 1 (there is nothing to split it over; validate.py's ``notes`` says so at start), and
    --use-rotary-position-embeddings sets --position-embedding-type rope; --cp-comm-type allgather
    (Megatron's spelling) is meshlm's all_gather."""
    if cfg.parallel.tensor_model_parallel_size == 1:
        cfg.parallel.sequence_parallel = False
    if cfg.model.use_rotary_position_embeddings:  # Megatron's legacy RoPE switch
        cfg.model.position_embedding_type = "rope"
    if cfg.model.cp_comm_type == "allgather":  # Megatron's spelling of meshlm's all_gather
        cfg.model.cp_comm_type = "all_gather"
