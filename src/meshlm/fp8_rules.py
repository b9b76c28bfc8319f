"""FP8 training's flags (Megatron-LM's names): what may be combined, and which layers run in FP8.

meshlm builds two recipes: ``tensorwise`` (Megatron's name; Transformer Engine's current scaling),
every GEMM input scaled by its own amax at the time of the GEMM (parallel/fp8.py), and ``delayed``,
the scales from --fp8-amax-history-len earlier steps' amaxes by --fp8-amax-compute-algo
(parallel/fp8_delayed.py; those two flags are refused with another recipe unless at Megatron's
defaults, where they describe no history; delayed is refused with MoE experts, whose rowwise recipe
scales each row by its current amax, and with --fp8-param-gather, which casts the weights by their
current amax). The others are refused in one line each: ``blockwise``, and ``mxfp8`` (Blackwell's
block scaling, which Hopper's tensor cores lack). --fp8-param-gather (the FP8 layers' weights cast from the fp32 master
once a step and all-gathered in FP8, optim/fp8_gather.py) needs the distributed optimizer (ZeRO-1/2/3:
the only layouts that gather weights) and is refused with MoE (the experts' rowwise recipe casts each
weight twice, per output and per input channel: one gathered FP8 copy cannot serve both), with
hybrid sharding and with optimizer offload (the master is split across replicas / on the host).

FP8 covers the four linears of each dense transformer layer (QKV, attention projection, fc1, fc2),
as in Megatron, and in MoE layers the routed experts' two projections (parallel/fp8_experts.py: the
rowwise recipe, E4M3 operands under hybrid too, as torch's grouped FP8 GEMM needs) and the shared
expert's linears; the router, the embedding, the output layer and the loss stay in the params' dtype
(the router in fp32 at least). Under --first-last-layers-bf16 the first
--num-layers-at-start-in-bf16 and the last --num-layers-at-end-in-bf16 layers stay out of FP8 too
(:func:`fp8_layers`).

On CPU the FP8 GEMMs are emulated (quantize → dequantize → matmul in the params' dtype), so the
float64 parity tests run the same scaling code as the GPU.
"""

from __future__ import annotations

from typing import Optional

from .config import zero_stage

# torch._scaled_mm needs each matrix dimension a multiple of 16 (cuBLASLt's FP8 rule)
FP8_ALIGN = 16
BUILT_RECIPES = ("tensorwise", "delayed")


def fp8_layers(t, num_layers: int) -> list:
    """[bool] × num_layers: whether layer i (global index) computes its linears in FP8.

    t: TrainingConfig. All False without --fp8-format.
    """
    if not t.fp8_format:
        return [False] * num_layers
    start = t.num_layers_at_start_in_bf16 if t.first_last_layers_bf16 else 0
    end = t.num_layers_at_end_in_bf16 if t.first_last_layers_bf16 else 0
    return [start <= i < num_layers - end for i in range(num_layers)]


def fp8_problems(cfg, gpu: Optional[tuple] = None) -> list:
    """One line per FP8 flag problem. cfg: Config. gpu: (name, (major, minor)) of the workers' GPU
    when known (None: CPU, or a --dry-run for GPUs that are not here)."""
    t, m = cfg.training, cfg.model
    problems = []
    fp8_only = [flag for flag, on in (
        ("--fp8-recipe", t.fp8_recipe != "tensorwise"), ("--fp8-margin", t.fp8_margin != 0),
        ("--first-last-layers-bf16", t.first_last_layers_bf16), ("--fp8-param-gather", t.fp8_param_gather))
        if on]
    if not t.fp8_format:
        if fp8_only:
            problems.append(f"{' '.join(fp8_only)} need(s) --fp8-format e4m3|hybrid; add it or drop them")
        return problems
    if t.fp8_recipe == "mxfp8":
        where = f"this GPU is {gpu[0]} (compute capability {gpu[1][0]}.{gpu[1][1]})" if gpu else "not built here"
        problems.append(f"--fp8-recipe mxfp8 needs a Blackwell GPU (compute capability 10.0) and meshlm's MX "
                        f"kernels, {where}; use --fp8-recipe tensorwise")
    elif t.fp8_recipe not in BUILT_RECIPES:
        problems.append(f"--fp8-recipe {t.fp8_recipe} is not built in meshlm; use --fp8-recipe tensorwise "
                        f"(each tensor scaled by its current amax) or delayed (by an amax history)")
    delayed = t.fp8_recipe == "delayed"
    if delayed and t.fp8_amax_history_len < 1:
        problems.append(f"--fp8-amax-history-len {t.fp8_amax_history_len} must be at least 1 (the steps whose "
                        f"amaxes the delayed scales come from); raise it")
    if delayed and m.num_experts:
        problems.append("--fp8-recipe delayed with --num-experts is not built (the experts' rowwise FP8 scales each "
                        "row by its current amax); use --fp8-recipe tensorwise")
    if delayed and t.fp8_param_gather:
        problems.append("--fp8-recipe delayed with --fp8-param-gather is not built (the gathered weights are cast "
                        "by their current amax); drop one of them")
    if t.fp8_param_gather:
        problems += fp8_param_gather_problems(cfg)
    if t.fp16:
        problems.append("--fp8-format with --fp16 is not built; use --bf16 (FP8 GEMMs, bf16 elsewhere)")
    if m.num_experts and m.moe_expert_capacity_factor is not None:
        problems.append("--fp8-format with --num-experts and --moe-expert-capacity-factor is not built (the "
                        "experts' rowwise FP8 skips dropped rows, but no parity case proves it yet); drop the "
                        "capacity factor or --fp8-format")
    if m.num_experts and cfg.parallel.context_parallel_size > 1:
        problems.append("--fp8-format with --num-experts and --context-parallel-size > 1 is not built (the experts' "
                        "weight-gradient scales per source micro-batch would span CP peers on other EP ranks); "
                        "drop one of them")
    if t.first_last_layers_bf16 and t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16 >= m.num_layers:
        problems.append(f"--num-layers-at-start-in-bf16 {t.num_layers_at_start_in_bf16} + "
                        f"--num-layers-at-end-in-bf16 {t.num_layers_at_end_in_bf16} leave none of --num-layers "
                        f"{m.num_layers} in FP8; lower them")
    if gpu and tuple(gpu[1]) < (8, 9):
        problems.append(f"--fp8-format needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                        f"this GPU is {gpu[0]} ({gpu[1][0]}.{gpu[1][1]}); drop --fp8-format")
    return problems


def unused_history_note(t) -> Optional[str]:
    """The note for --fp8-amax-history-len / --fp8-amax-compute-algo under a recipe that reads no
    history (tensorwise, meshlm's default; Megatron's default is delayed, so its scripts, the Llama 3 8B
    FP8 example among them, give them without --fp8-recipe), or None. Transformer Engine's current
    scaling ignores them too; meshlm says so rather than refusing the script."""
    if not t.fp8_format or t.fp8_recipe == "delayed" or (t.fp8_amax_history_len, t.fp8_amax_compute_algo) == (
            1, "most_recent"):
        return None
    return (f"--fp8-amax-history-len {t.fp8_amax_history_len} / --fp8-amax-compute-algo {t.fp8_amax_compute_algo} have "
            f"no effect under --fp8-recipe {t.fp8_recipe} (meshlm's default; Megatron-LM's is delayed), which scales "
            f"each tensor by its current amax; add --fp8-recipe delayed to scale by the amax history")


def fp8_param_gather_problems(cfg) -> list:
    """--fp8-param-gather's combinations (with --fp8-format given): one line each."""
    p, problems = cfg.parallel, []
    if zero_stage(p) < 1:
        problems.append("--fp8-param-gather all-gathers the weights that the distributed optimizer shards; add "
                        "--use-distributed-optimizer (or --data-parallel-sharding-strategy optim|optim_grads|"
                        "optim_grads_params), or drop it")
    if cfg.model.num_experts:
        problems.append("--fp8-param-gather with --num-experts is not built (the experts' rowwise FP8 casts each "
                        "weight per output channel and again per input channel, so one gathered FP8 copy cannot "
                        "serve both); drop --fp8-param-gather")
    if p.num_distributed_optimizer_instances > 1:
        problems.append("--fp8-param-gather with --num-distributed-optimizer-instances > 1 is not built (a "
                        "weight's scale would need the amax over every replica's shards); drop one of them")
    if cfg.optimizer.optimizer_cpu_offload:
        problems.append("--fp8-param-gather with --optimizer-cpu-offload is not built (the FP8 weights are cast "
                        "from the fp32 master, which would be on the host); drop one of them")
    return problems


def alignment_problems(sizes: dict, tokens: int) -> list:
    """FP8 GEMMs on the GPU need every dimension a multiple of 16. sizes: {flag text: local size}
    of the linears' input/output widths; tokens: micro-batch × sequence length (one GEMM's rows)."""
    problems = [f"{name} = {n} is not a multiple of {FP8_ALIGN}, which FP8 GEMMs need; change it"
                for name, n in sizes.items() if n % FP8_ALIGN]
    if tokens % FP8_ALIGN:
        problems.append(f"--micro-batch-size × --seq-length = {tokens} tokens is not a multiple of {FP8_ALIGN}, "
                        f"which FP8 GEMMs need; change one of them")
    return problems
