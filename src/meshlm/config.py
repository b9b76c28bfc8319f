"""The typed config tree: one source of truth for flags, YAML keys, defaults and help.

Every field of the section dataclasses below is one command-line flag, named as in Megatron-LM
(``--hidden-size`` for ``model.hidden_size``), and one YAML key (flat ``hidden_size`` /
``hidden-size``, or nested under its section: ``model: {hidden_size: 768}``). Precedence, lowest
first: dataclass defaults < ``--model`` preset < ``--config`` YAML < command-line flags.

Derived values (data-parallel size, number of micro-batches, padded vocabulary) are computed by
the functions at the bottom, never stored twice. Checking a config is ``meshlm.validate``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .batches import BatchSchedule, parse_step_schedule
from .errors import ConfigError
from .values import WORDS, coerce, expected, flag_type, kind_of

SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}  # Megatron's names: ZeRO stage

DEFAULT_TRAIN_ITERS = 100  # run length when neither --train-iters nor --train-samples is given


TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")


def opt(default: Any, help: str, *, flag: Optional[str] = None, choices=None,
        action: Optional[str] = None, nargs=None, metavar=None, aliases: tuple = ()):
    """A config field with its command-line metadata.

    flag: the Megatron flag name when it differs from ``--field-name``; aliases: Megatron's other
    spellings of it (e.g. ``--override-opt-param-scheduler`` beside ``--override-opt_param-scheduler``).
    action: "store_true" for a boolean switch, "store_false" for a ``--disable-x`` switch.
    metavar: the value's name(s) in --help (default: the field name in capitals).
    """
    meta = {"help": help, "flag": flag, "choices": choices, "action": action, "nargs": nargs,
            "metavar": metavar, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """Shape of the decoder. Defaults give a small GPT that trains on a laptop."""

    num_layers: int = opt(4, "number of transformer layers")
    hidden_size: int = opt(256, "hidden size h")
    num_attention_heads: int = opt(4, "number of attention heads a")
    group_query_attention: bool = opt(False, "use grouped-query attention with --num-query-groups",
                                      action="store_true")
    num_query_groups: Optional[int] = opt(None, "number of key/value heads under --group-query-attention "
                                          "(default 1, as Megatron's: multi-query)")
    ffn_hidden_size: Optional[int] = opt(None, "MLP hidden size (default 4h, or for SwiGLU 8h/3 rounded down to "
                                         "a multiple of 64, as Megatron)")
    kv_channels: Optional[int] = opt(None, "head dimension (default h / heads)")
    seq_length: int = opt(256, "training sequence length s in tokens")
    max_position_embeddings: Optional[int] = opt(None, "learned position table size (default: seq length)")
    normalization: str = opt("LayerNorm", "normalization layer", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = opt(1e-5, "epsilon of LayerNorm/RMSNorm")
    apply_layernorm_1p: bool = opt(False, "zero-centred norm weights (Megatron's; TE's zero_centered_gamma): each "
                                   "LayerNorm/RMSNorm weight w is stored from 0 and scales by 1 + w",
                                   action="store_true")
    swiglu: bool = opt(False, "SwiGLU MLP instead of GeLU", action="store_true")
    bias_gelu_fusion: bool = opt(True, "no fused bias-GeLU: as in Megatron-LM, a GeLU MLP with biases otherwise "
                                 "computes the fused kernel's tanh approximation of GeLU; this gives the exact "
                                 "erf GeLU", flag="--no-bias-gelu-fusion", action="store_false")
    openai_gelu: bool = opt(False, "GeLU by its tanh approximation (OpenAI's GPT-2; HF's gelu_new) instead of "
                            "the exact erf form", action="store_true")
    position_embedding_type: str = opt("learned_absolute", "position embeddings",
                                       choices=["learned_absolute", "rope"])
    use_rotary_position_embeddings: bool = opt(False, "Megatron's deprecated spelling of --position-embedding-type "
                                               "rope (which it sets)", action="store_true")
    add_position_embedding: bool = opt(True, "deprecated in Megatron: allowed only with --position-embedding-type "
                                       "rope, where it changes nothing", flag="--no-position-embedding",
                                       action="store_false")
    rotary_base: float = opt(10000.0, "RoPE base theta")
    rotary_percent: float = opt(1.0, "RoPE rotates the first int(this × head dim) dimensions of each head, "
                                "the rest pass through (partial rotary, e.g. GPT-NeoX 0.25)")
    untie_embeddings_and_output_weights: bool = opt(
        False, "separate output layer instead of the tied input embedding", action="store_true")
    add_bias_linear: bool = opt(True, "disable biases in linear layers", flag="--disable-bias-linear",
                                action="store_false")
    add_qkv_bias: bool = opt(False, "a bias in the query/key/value projection even under --disable-bias-linear "
                             "(Qwen2's)", action="store_true")
    qk_layernorm: bool = opt(False, "normalise each head's query and key (--normalization's kind, over the head "
                             "dim) before RoPE (Qwen3's, OLMo 2's)", action="store_true")
    hidden_dropout: float = opt(0.1, "dropout on hidden states")
    attention_dropout: float = opt(0.1, "dropout on attention probabilities")
    init_method_std: float = opt(0.02, "std of the normal weight init")
    use_mup: bool = opt(False, "μP (Tensor Programs V, Table 8; meshlm/mup.py): hidden init std / √m, hidden "
                        "Adam LR / m, logits × --mup-output-mult, 1/d attention; m = hidden / base hidden",
                        action="store_true")
    mup_base_hidden_size: Optional[int] = opt(None, "μP: hidden size of the base (proxy) model (default: "
                                              "--hidden-size, i.e. width multiplier 1)")
    mup_width_mult: Optional[float] = opt(None, "μP: width multiplier; derived as hidden / base hidden, "
                                          "and if given must equal it")
    mup_embedding_mult: float = opt(1.0, "μP: multiplier of the embedding output")
    mup_output_mult: float = opt(1.0, "μP: multiplier of the logits (left at 1.0: set to 1 / width multiplier)")
    mup_base_head_dim: Optional[float] = opt(None, "μP: head dim of the base model; softmax scale = "
                                             "√(this) / d^power (none: 1 / d^power)")
    mup_attn_scale_power: float = opt(1.0, "μP: softmax scale = 1 / d^power (0.5: the standard 1/√d, 1: μP's 1/d)")
    vocab_size: Optional[int] = opt(None, "vocabulary size (mock data / null tokenizer; else from the tokenizer)")
    make_vocab_size_divisible_by: int = opt(128, "pad the vocabulary to a multiple of this × TP")
    num_experts: Optional[int] = opt(None, "routed experts per MoE layer (none or 0: dense MLPs only)")
    moe_ffn_hidden_size: Optional[int] = opt(None, "hidden size of each routed expert (default --ffn-hidden-size)")
    moe_router_topk: int = opt(2, "experts each token is routed to (k)")
    moe_layer_freq: str = opt("1", "which layers are MoE: N = layers 0, N, 2N, …; or a pattern of 1 (MoE) "
                              "and 0 (dense) per layer, e.g. \"([0]+[1]*3)*2\"")
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "hidden size of the shared expert every token also goes through (none: no shared expert)")
    moe_router_score_function: str = opt("softmax", "router scores: softmax (over the k chosen, or over all "
                                         "with --moe-router-pre-softmax) or sigmoid (normalised over the k)",
                                         choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = opt(False, "softmax over all experts before the top-k (gates not "
                                       "renormalised)", action="store_true")
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "router load balancing: aux_loss (the --moe-aux-loss-coeff loss) or none (no aux loss); "
        "Megatron's other kinds are refused")
    moe_router_dtype: str = opt("fp32", "the router's logits, scores, top-k and aux losses: fp32 (the only dtype "
                                "meshlm computes them in; model/router_gemm.py)", choices=["fp32"])
    moe_aux_loss_coeff: float = opt(0.0, "load-balancing loss coefficient α (Switch/GShard: α·E·Σ f_i·P_i)")
    moe_z_loss_coeff: Optional[float] = opt(None, "router z-loss coefficient (ST-MoE: mean logsumexp²)")
    moe_router_enable_expert_bias: bool = opt(
        False, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the scores for the top-k choice, "
        "moved each step by --moe-router-bias-update-rate towards the mean load", action="store_true")
    moe_router_bias_update_rate: float = opt(1e-3, "step of the expert bias update")
    moe_router_force_load_balancing: bool = opt(
        False, "benchmarking only: route by random normal logits (the router's gradient passes straight "
        "through), so the load is balanced in expectation", action="store_true")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "expert capacity = ceil(tokens × k / experts × this) per micro-batch and rank; routes beyond "
        "it are dropped (none: no dropping)")
    moe_token_drop_policy: str = opt("probs", "which routes an expert over capacity keeps: the highest "
                                     "probabilities, or the earliest positions", choices=["probs", "position"])
    cp_comm_type: str = opt("p2p", "context-parallel attention: p2p (K/V passed round a ring, overlapped with "
                            "attention) or allgather (K/V gathered; cheap with GQA; all_gather is the same)",
                            choices=["p2p", "allgather", "all_gather"])


@dataclass
class ParallelConfig:
    """Parallel layout. DP = world / (TP × CP × PP)."""

    tensor_model_parallel_size: int = opt(1, "tensor parallel size (TP)")
    pipeline_model_parallel_size: int = opt(1, "pipeline parallel size (PP)")
    expert_model_parallel_size: int = opt(1, "expert parallel size (EP): the routed experts split over EP "
                                          "ranks carved out of DP × CP")
    context_parallel_size: int = opt(1, "context parallel size (CP)")
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism (needs TP > 1)", action="store_true")
    virtual_pipeline_model_parallel_size: Optional[int] = opt(None, "virtual stages per pipeline rank")
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(None, "layers per virtual pipeline stage")
    decoder_first_pipeline_num_layers: Optional[int] = opt(None, "layers on the first pipeline stage")
    decoder_last_pipeline_num_layers: Optional[int] = opt(None, "layers on the last pipeline stage")
    pipeline_schedule: str = opt("auto", "pipeline schedule",
                                 choices=["auto", "none", "gpipe", "1f1b", "interleaved"])
    use_distributed_optimizer: bool = opt(False, "shard optimizer state over DP (ZeRO-1; the same as "
                                          "--data-parallel-sharding-strategy optim)", action="store_true")
    data_parallel_sharding_strategy: str = opt(
        "no_shard", "what DP × CP shards (ZeRO stage): no_shard (0), optim (1: optimizer state), optim_grads "
        "(2: + gradients), optim_grads_params (3: + parameters, gathered per block)", choices=list(SHARDING))
    use_torch_fsdp2: bool = opt(False, "Megatron's torch FSDP2 switch: meshlm runs its own ZeRO-3 "
                                "(--data-parallel-sharding-strategy optim_grads_params) instead", action="store_true")
    torch_fsdp2_no_reshard_after_forward: bool = opt(
        False, "ZeRO-3: keep each gathered bucket whole from its first forward to the optimizer's update "
        "(torchtitan's reshard_after_forward=False): one all-gather a step instead of two per micro-batch, "
        "at the cost of the whole stage's weights held in the step", action="store_true")
    num_distributed_optimizer_instances: int = opt(
        1, "hybrid sharding: DP × CP splits into this many replicas (a node each); the strategy shards "
        "inside a replica, --outer-dp-sharding-strategy decides across them")
    outer_dp_sharding_strategy: str = opt(
        "no_shard", "across --num-distributed-optimizer-instances replicas: no_shard (gradient shards "
        "all-reduced, all state replicated) or optim (optimizer state also split across them)",
        choices=["no_shard", "optim"])
    overlap_grad_reduce: bool = opt(False, "overlap DP gradient reduction with backward", action="store_true")
    overlap_param_gather: bool = opt(False, "overlap ZeRO-1 parameter all-gather with forward",
                                     action="store_true")
    ddp_bucket_size: Optional[int] = opt(None, "elements per gradient bucket (default max(40M, 1M × DP); 2^30 at DP × CP 1)")
    accumulate_allreduce_grads_in_fp32: bool = opt(True, "keep main_grad in fp32 (always on in meshlm)",
                                                   action="store_true")
    grad_reduce_in_bf16: bool = opt(False, "bf16 params' gradients accumulated and reduced in bf16, not fp32 "
                                    "(Megatron's): half the gradient memory and DP bytes, at bf16's rounding of "
                                    "the micro-batches' sum and of the reduction", action="store_true")
    use_cpu_initialization: bool = opt(True, "build each full weight from the seed, keep this rank's slice "
                                       "(on by default in meshlm)", action="store_true")
    nproc_per_node: Optional[int] = opt(None, "local workers to start (default: GPUs, or as the layout needs on CPU)")
    distributed_timeout_minutes: int = opt(10, "timeout of collectives in minutes: a collective that waits longer "
                                           "ends the job, naming the ranks that did not arrive")


@dataclass
class TrainingConfig:
    """Batching, precision, iterations, logging cadence."""

    micro_batch_size: int = opt(4, "samples per micro-batch per DP rank")
    global_batch_size: Optional[int] = opt(None, "samples per optimizer step (default micro × accumulation × DP)")
    gradient_accumulation_steps: Optional[int] = opt(
        None, "micro-batches per DP rank per step: another way to state the global batch (micro × this × DP)")
    train_iters: Optional[int] = opt(None, f"optimizer steps (default {DEFAULT_TRAIN_ITERS} unless --train-samples)")
    train_samples: Optional[int] = opt(None, "samples to train on instead of --train-iters: the run takes the steps "
                                       "that fit (a partial last batch is dropped); the --lr-*-samples flags apply")
    rampup_batch_size: Optional[list[int]] = opt(
        None, "grow the global batch from START by INCREMENT over SAMPLES consumed samples up to "
        "--global-batch-size (needs --train-samples)", nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    step_batch_size_schedule: Optional[str] = opt(
        None, 'the global batch by tokens consumed, as Megatron-LM: "THRESHOLD:BATCH ..." (e.g. "0:16 2.4B:320 '
        '4.8B:624"; K/M/B/T suffixes); each step takes the batch of the last threshold reached; the last '
        "entry's batch is the global batch", metavar="SCHEDULE")
    seed: int = opt(1234, "seed of weights, dropout and data order")
    bf16: bool = opt(False, "bf16 parameters and compute (accepted on CPU, which trains in fp32)",
                     action="store_true")
    fp16: bool = opt(False, "fp16 parameters and compute with dynamic loss scaling (CUDA only)",
                     action="store_true")
    initial_loss_scale: float = opt(2.0 ** 32, "fp16 initial loss scale")
    min_loss_scale: float = opt(1.0, "fp16 minimum loss scale")
    loss_scale_window: int = opt(1000, "fp16 steps without overflow before the scale doubles")
    hysteresis: int = opt(2, "fp16 overflows tolerated before the scale halves")
    fp8_format: Optional[str] = opt(None, "FP8 GEMMs in the transformer layers' linears: e4m3 everywhere, or "
                                    "hybrid (e4m3 forward, e5m2 gradients); on CPU emulated (meshlm/fp8_rules.py)",
                                    choices=["e4m3", "hybrid"])
    fp8_recipe: str = opt("tensorwise", "FP8 scaling: tensorwise (each tensor by its current amax) or delayed "
                          "(by an amax history of earlier steps); blockwise and mxfp8 are refused", choices=["tensorwise", "delayed", "blockwise",
                                                                               "mxfp8"])
    fp8_margin: int = opt(0, "FP8 scale = format max / amax / 2^margin")
    fp8_amax_history_len: int = opt(1, "steps of amax history the delayed recipe keeps per operand")
    fp8_amax_compute_algo: str = opt("most_recent", "the delayed recipe's amax from its history: its max or "
                                     "the most recent",
                                     choices=["most_recent", "max"])
    first_last_layers_bf16: bool = opt(False, "keep the first and last transformer layers out of FP8",
                                       action="store_true")
    num_layers_at_start_in_bf16: int = opt(1, "layers kept in bf16 at the start, with --first-last-layers-bf16")
    num_layers_at_end_in_bf16: int = opt(1, "layers kept in bf16 at the end, with --first-last-layers-bf16")
    fp8_param_gather: bool = opt(False, "keep the FP8 layers' weights in FP8, cast from the fp32 master after each step, "
                                 "and all-gather them in FP8 (needs --use-distributed-optimizer or a "
                                 "--data-parallel-sharding-strategy)", action="store_true")
    skip_nan_steps: bool = opt(False, "skip a step with NaN/inf loss instead of stopping (bf16/fp32)",
                               action="store_true")
    check_for_nan_in_loss_and_grad: bool = opt(
        True, "with a NaN/inf step, name the rank(s) whose local gradients were non-finite (one sum per "
        "gradient bucket before its DP reduction)", flag="--no-check-for-nan-in-loss-and-grad", action="store_false")
    loss_spike_threshold: float = opt(0.0, "log a loss spike when a step's loss exceeds this factor × the mean "
                                      "of the last 20 losses (0: off)", metavar="FACTOR")
    recompute_activations: bool = opt(False, "selective recompute: the same as --recompute-granularity selective",
                                      action="store_true")
    recompute_granularity: Optional[str] = opt(
        None, "selective: recompute core attention (softmax(QKᵀ)V) in backward; full: whole layers "
        "(with --recompute-method and --recompute-num-layers)", choices=["selective", "full"])
    recompute_method: Optional[str] = opt(
        None, "full recompute: uniform (checkpoint groups of --recompute-num-layers layers) or block "
        "(the first --recompute-num-layers layers of each pipeline chunk)", choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = opt(None, "full recompute: layers per group (uniform) or per chunk (block)")
    fast_path: str = opt("auto", "compiled layers, fused kernels and fused AdamW (auto: on CUDA, off on CPU)",
                         choices=["auto", "on", "off"])
    log_interval: int = opt(10, "iterations between log lines")
    manual_gc: bool = opt(False, "Python's garbage collector off during training, run at chosen iterations on "
                          "every rank instead (training/manual_gc.py)", action="store_true")
    manual_gc_interval: int = opt(0, "with --manual-gc, iterations between collections (0: none between steps)")
    manual_gc_eval: bool = opt(True, "with --manual-gc, do not collect before and after each evaluation",
                               flag="--no-manual-gc-eval", action="store_false")
    eval_interval: int = opt(100, "iterations between validation runs")
    eval_iters: int = opt(10, "validation iterations per evaluation")
    eval_at_start: bool = opt(False, "evaluate once before the first step (the untrained validation loss)",
                              action="store_true")
    exit_interval: Optional[int] = opt(None, "stop after an iteration divisible by this (checkpointing first)")
    exit_duration_in_mins: Optional[int] = opt(
        None, "stop after the first iteration that ends this many minutes after the job started, "
        "the slowest rank's clock deciding (checkpointing first; exit status 0)")
    exit_signal_handler: bool = opt(
        False, "on --exit-signal, stop after the current iteration on every rank (checkpointing first; "
        "exit status 0)", action="store_true")
    exit_signal: str = opt("SIGTERM", "the signal --exit-signal-handler waits for",
                           choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    calculate_per_token_loss: bool = opt(
        False, "loss = sum of token losses / loss tokens of the global batch (default: mean of "
        "micro-batch means)", action="store_true")


@dataclass
class OptimizerConfig:
    """AdamW, LR schedule and gradient clipping."""

    optimizer_type: str = opt("adam", "the optimizer: adam is Megatron's, Adam with decoupled weight decay (AdamW, "
                              "Loshchilov & Hutter 2019), the only one meshlm has", flag="--optimizer", choices=["adam"])
    lr: float = opt(6e-4, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of decay")
    decoupled_lr: Optional[float] = opt(None, "peak learning rate of the word embedding and the output layer, on "
                                        "the same schedule (Megatron's; none: --lr's)")
    decoupled_min_lr: Optional[float] = opt(None, "--decoupled-lr's value at the end of decay (default --min-lr)")
    lr_decay_style: str = opt("linear", "decay after warm-up", choices=["constant", "linear", "cosine",
                                                                         "inverse-square-root", "WSD"])
    lr_warmup_iters: int = opt(0, "linear warm-up iterations")
    lr_decay_iters: Optional[int] = opt(None, "decay iterations (default: train iters)")
    lr_warmup_samples: int = opt(0, "linear warm-up samples (with --train-samples)")
    lr_decay_samples: Optional[int] = opt(None, "decay samples (with --train-samples; default: train samples)")
    weight_decay: float = opt(0.01, "AdamW weight decay (not on biases and norms)")
    clip_grad: float = opt(1.0, "global gradient norm clip (0 = off)")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.999, "Adam beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon")
    lr_warmup_fraction: Optional[float] = opt(None, "warm-up as a fraction of the decay iterations "
                                              "(instead of --lr-warmup-iters)")
    lr_wsd_decay_style: str = opt("exponential", "WSD: shape of the final anneal",
                                  choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: Optional[int] = opt(None, "WSD: iterations of the final anneal (ends at the decay end)")
    lr_wsd_decay_samples: Optional[int] = opt(None, "WSD: samples of the final anneal (with --train-samples)")
    use_precision_aware_optimizer: bool = opt(False, "keep the Adam moments in --exp-avg-dtype and "
                                              "--exp-avg-sq-dtype (updated in fp32, stored rounded)",
                                              action="store_true")
    exp_avg_dtype: str = opt("fp32", "dtype of Adam's first moment (non-fp32 with --use-precision-aware-optimizer)",
                             choices=["fp32", "bf16", "fp16", "fp8"])
    exp_avg_sq_dtype: str = opt("fp32", "dtype of Adam's second moment (non-fp32 with "
                                "--use-precision-aware-optimizer)", choices=["fp32", "bf16", "fp16", "fp8"])
    optimizer_cpu_offload: bool = opt(False, "keep fp32 masters and Adam moments of a fraction of the optimizer "
                                      "shards in host memory and update them there", action="store_true")
    optimizer_offload_fraction: float = opt(1.0, "with --optimizer-cpu-offload: the share of the optimizer state "
                                            "(in elements, whole shards from the first) that lives on the host")


@dataclass
class DataConfig:
    """Corpus, tokenizer and splits."""

    data_path: list = opt([], "indexed-dataset prefixes, optionally weighted: 0.7 A 0.3 B", nargs="*")
    dataloader_type: str = opt("single", "single: one pass over the samples in order, resumable at the consumed "
                               "samples (Megatron's default and meshlm's only sampler)", choices=["single"])
    split: Optional[str] = opt(None, "train,valid,test weights cutting --data-path's datasets (default "
                               "969,30,1, Megatron's legacy default); not with --train/valid/test-data-path")
    train_data_path: list = opt([], "the training split's own blend, as --data-path (instead of --data-path "
                                "and --split)", nargs="*")
    valid_data_path: list = opt([], "the validation split's own blend, as --data-path (none: no evaluation)",
                                nargs="*")
    test_data_path: list = opt([], "the test split's own blend, as --data-path", nargs="*")
    data_args_path: Optional[str] = opt(None, "a text file holding --data-path's tokens (for long blends)")
    per_split_data_args_path: Optional[str] = opt(
        None, 'a JSON file {"train": ..., "valid": ..., "test": ...} holding each split\'s --data-path tokens '
        '(a string, a list, or null)')
    mock_data: bool = opt(False, "random tokens instead of a corpus", action="store_true")
    tokenizer_type: Optional[str] = opt(None, "tokenizer kind", choices=list(TOKENIZER_TYPES))
    tokenizer_model: Optional[str] = opt(None, "tokenizer.json (HuggingFaceTokenizer), SentencePiece .model "
                                         "(SentencePiece/GPTSentencePiece/Llama2Tokenizer) or Megatron's "
                                         "tiktoken vocabulary .json (TikTokenizer)")
    tiktoken_pattern: Optional[str] = opt(None, "TikTokenizer: Megatron's split pattern (default v2)",
                                          choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = opt(1000, "TikTokenizer: ids 0..N-1 are special tokens")
    tokenizer_special_tokens: Optional[list] = opt(None, "TikTokenizer: the first special tokens (must "
                                                   "include <unk> <s> </s> <mask> <pad> <cls> <sep>)",
                                                   nargs="+")
    null_tokenizer_eod_id: Optional[int] = opt(None, "NullTokenizer: the end-of-document id (default --vocab-size "
                                               "- 1, as Megatron-LM; megatron-core 0.16.1 used --vocab-size itself)")
    null_tokenizer_pad_id: int = opt(-1, "NullTokenizer: the padding id, its labels left out of the loss (-1: none)")
    vocab_file: Optional[str] = opt(None, "GPT-2 vocab.json")
    merge_file: Optional[str] = opt(None, "GPT-2 merges.txt")
    data_cache_path: Optional[str] = opt(None, "folder for cached sample indices")
    num_workers: int = opt(2, "data loader processes per split reading the next micro-batches ahead "
                           "(0: read in the training process)")
    eod_mask_loss: bool = opt(False, "loss mask 0 on EOD input tokens", action="store_true")
    reset_position_ids: bool = opt(False, "positions restart after each EOD token", action="store_true")
    reset_attention_mask: bool = opt(False, "tokens attend only within their document (packed sequences)",
                                     action="store_true")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "checkpoint directory to write")
    load: Optional[str] = opt(None, "checkpoint directory to resume from")
    save_interval: Optional[int] = opt(None, "iterations between checkpoints (and one at the end)")
    finetune: bool = opt(False, "load only the model weights from --load: iteration and consumed samples "
                         "start at 0, with a fresh optimizer, LR schedule and RNG", action="store_true")
    no_load_optim: bool = opt(False, "do not load the optimizer state (Adam moments, step, loss scale) nor, "
                              "as in Megatron, the LR schedule; fp32 master weights are rebuilt from the "
                              "loaded weights", action="store_true")
    no_load_rng: bool = opt(False, "do not load the RNG states (python, numpy, torch, dropout streams)",
                            action="store_true")
    override_opt_param_scheduler: bool = opt(
        False, "on --load, take the LR schedule's settings (--lr, --min-lr, --lr-decay-style, warm-up and "
        "decay lengths) from this run's flags; without it a checkpoint saved with other settings is refused, "
        "as in Megatron", flag="--override-opt_param-scheduler", aliases=("--override-opt-param-scheduler",),
        action="store_true")
    use_checkpoint_opt_param_scheduler: bool = opt(
        False, "on --load, take the LR schedule's settings from the checkpoint, not from this run's flags",
        flag="--use-checkpoint-opt_param-scheduler", aliases=("--use-checkpoint-opt-param-scheduler",),
        action="store_true")
    keep_checkpoints: int = opt(2, "after each save, delete the complete checkpoints beyond the newest N "
                                "(at least 2: the latest may be the one a crash damaged)", metavar="N")
    verify_integrity: bool = opt(False, "before loading, compare every file's SHA-256 with the manifest "
                                 "(sizes are always compared; a mismatch falls back to the previous "
                                 "checkpoint)", action="store_true")
    async_save: bool = opt(False, "write checkpoints in the background: the state is copied to host memory "
                           "before training goes on, then written while it trains; one save at a time, "
                           "the latest only once every rank has written it", action="store_true")


@dataclass
class LoggingConfig:
    run_dir: Optional[str] = opt(None, "run directory (default runs/<time>)")
    log_dir: Optional[str] = opt(None, "where metrics.jsonl goes (default <run-dir>/logs)")
    tensorboard_dir: Optional[str] = opt(None, "write TensorBoard scalars here")
    log_params_norm: bool = opt(False, "log the L2 norm of the fp32 master weights on each log line (\"params norm\"; "
                                "a collective on log iterations)", action="store_true")
    log_num_zeros_in_grad: bool = opt(False, "log the number of zero gradient elements of the last step (\"num "
                                      "zeros\"; one pass over the gradients a step)", action="store_true")
    heartbeat_interval: float = opt(60.0, "seconds between heartbeat lines in each rank's log (0: off)",
                                    metavar="SECONDS")
    # profiling (Megatron's ProfilingConfig; training/profiling.py)
    profile: bool = opt(False, "profile iterations --profile-step-start+1 … --profile-step-end on --profile-ranks: "
                        "with --use-pytorch-profiler a torch profiler trace in <run-dir>/torch_profile, else "
                        "cudaProfilerStart/Stop for `nsys profile --capture-range=cudaProfilerApi`",
                        action="store_true")
    profile_step_start: int = opt(10, "profiling starts after this many iterations")
    profile_step_end: int = opt(12, "profiling stops after this iteration")
    profile_ranks: list[int] = opt([], "global ranks to profile (default: all)", nargs="+")
    use_pytorch_profiler: bool = opt(False, "--profile records a torch profiler trace (Perfetto, TensorBoard)",
                                     action="store_true")
    pytorch_profiler_collect_shapes: bool = opt(False, "the torch profiler records tensor shapes",
                                                action="store_true")
    pytorch_profiler_collect_callstack: bool = opt(False, "the torch profiler records Python call stacks",
                                                   action="store_true")
    nvtx_ranges: bool = opt(False, "NVTX ranges (forward, backward, each collective, optimizer step) during "
                            "the --profile steps, for Nsight Systems; with the torch profiler the same "
                            "ranges appear as user annotations", action="store_true")


@dataclass
class Config:
    """The whole run. ``model_preset`` names the --model preset that filled ``model``, if any."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model_preset: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        if "model" in d and "bias_gelu_fusion" not in d["model"]:  # saved before the flag: exact GeLU
            cfg.model.bias_gelu_fusion = False
        apply_mapping(cfg, d, source="dict")
        cfg.model_preset = d.get("model_preset")
        return cfg


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "model_preset"]


def config_fields():
    """Yield (section, dataclass field) for every config field (one per flag)."""
    for sec in SECTIONS:
        cls = Config.__dataclass_fields__[sec].default_factory
        for f in dataclasses.fields(cls):
            yield sec, f


def flag_of(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _index():
    """name (field name, flag name without dashes, either spelling) → (section, field)."""
    idx = {}
    for sec, f in config_fields():
        for key in (f.name, flag_of(f)[2:]):
            idx[key] = (sec, f)
            idx[key.replace("-", "_")] = (sec, f)
    return idx


def _coerce(f, value, where: str):
    """Convert a YAML value to the field's kind; raise ConfigError naming the key and the kind (also
    for a null, ``key: ~`` or ``key:``, of a field that has no unset state: a traceback before)."""
    if value is None:
        if "Optional" in str(f.type):
            return None
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        raise ConfigError(f"{where}: {flag_of(f)[2:]} is null but has no unset state; give "
                          f"{WORDS[kind_of(f)]} (default {default!r}) or leave the key out")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: {flag_of(f)[2:]}={value!r} is not one of {', '.join(choices)}")
    kind = kind_of(f)
    try:
        return coerce(kind, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {flag_of(f)[2:]}={value!r} is not {expected(kind, value)}") from None


def value_problem(mapping: dict) -> Optional[str]:
    """The first value of a saved run's config (config.yaml or a checkpoint's config.json, nested
    by section) that is not of its field's kind, as ``_coerce`` words it, or None. Keys this meshlm
    does not know are passed over (a run of another version), unlike ``apply_mapping``."""
    idx = _index()
    for key, value in _flatten(mapping):
        if key in idx and key != "model_preset":
            try:
                _coerce(idx[key][1], value, "")
            except ConfigError as e:
                return str(e).removeprefix(": ")
    return None


def _flatten(mapping: dict) -> list:
    """(key, value) pairs of a flat or section-nested mapping; a ``model: NAME`` string names a preset."""
    pairs = []
    for key, value in mapping.items():
        if key in SECTIONS and isinstance(value, dict):
            pairs += value.items()
        elif key in ("model", "model_preset") and isinstance(value, str):
            pairs.append(("model_preset", value))
        else:
            pairs.append((key, value))
    return pairs


def apply_mapping(cfg: Config, mapping: dict, source: str) -> None:
    """Set fields from a flat or section-nested mapping (YAML). Unknown keys are errors, and so is
    a field given twice (in two spellings, or flat and in its section)."""
    idx = _index()
    problems, given, unknown = [], {}, []
    for key, value in _flatten(mapping):
        if key in SECTIONS:  # `model: 3`: the section holds no mapping (was called an unknown key)
            problems.append(f"{source}: {key!r} is a section: give a mapping of its keys (e.g. {key}: "
                            f"{{{next(f.name for s, f in config_fields() if s == key)}: …}})" +
                            (" or a preset name" if key == "model" else "") + f", not {value!r}")
            continue
        if key != "model_preset" and key not in idx:
            unknown.append(key)
            continue
        field_key = "model_preset" if key == "model_preset" else idx[key][1].name
        if field_key in given:
            how = "flat and in its section" if given[field_key] == key else f"also as {given[field_key]!r}"
            problems.append(f"{source}: {key!r} is given twice ({how}); keep one")
            continue
        given[field_key] = key
        if key == "model_preset":
            continue
        sec, f = idx[key]
        # YAML spelling of inverted switches: disable_bias_linear: true → add_bias_linear False
        try:
            value = _coerce(f, value, source)
            if f.metadata.get("action") == "store_false" and key.replace("-", "_") != f.name:
                value = not value
            setattr(getattr(cfg, sec), f.name, value)
        except ConfigError as e:
            problems.extend(e.problems)
    if unknown:  # all in one line, as unknown command-line flags are
        problems.insert(0, f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
                           f"{', '.join(map(repr, unknown))}")
    if problems:
        raise ConfigError(problems)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field, each defaulting to a sentinel so only given flags apply."""
    parser.add_argument("--config", default=None, help="YAML file of config keys (flat or by section)")
    from .presets import PRESETS
    parser.add_argument("--model", dest="model_preset", default=None, metavar="PRESET",
                        help=f"named model shape, one of {', '.join(PRESETS)} (flags override it)")
    for sec in SECTIONS:
        group = parser.add_argument_group(sec)
        cls = Config.__dataclass_fields__[sec].default_factory
        for f in dataclasses.fields(cls):
            m = f.metadata
            kw = {"dest": f"{sec}.{f.name}", "default": argparse.SUPPRESS, "help": _help(f)}
            if m["action"]:
                kw["action"] = m["action"]
            else:
                kw["type"] = flag_type(kind_of(f))
                if m["choices"]:
                    kw["choices"] = m["choices"]
                else:
                    kw["metavar"] = m["metavar"] or f.name.upper()
                if m["nargs"]:
                    kw["nargs"] = m["nargs"]
            group.add_argument(flag_of(f), *m.get("aliases", ()), **kw)


def _help(f) -> str:
    """A field's help, with meshlm's default and, where it differs on purpose, Megatron's."""
    from .megatron_flags import DIFFERENT_DEFAULTS
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    action = f.metadata.get("action")
    if action in ("store_true", "store_false"):  # a switch: is it given by default? (never, here)
        default = "on" if default == (action == "store_true") else "off"
    text = f"{f.metadata['help']} [default: {default}]"
    if flag_of(f) in DIFFERENT_DEFAULTS:
        megatron, why = DIFFERENT_DEFAULTS[flag_of(f)]
        text += f" (Megatron: {megatron}; differs on purpose: {why})"
    return text.replace("%", "%%")


# Exclusive ways to give one setting (as in Megatron), each a tuple of fields that go together: one
# given by a flag replaces the other ways that the --config YAML, a preset or a base mapping gave (flags
# win; before, both were refused as exclusive).
PER_SPLIT_SOURCES = ("train_data_path", "valid_data_path", "test_data_path")
ALTERNATIVES = ((("mock_data",), ("data_path",), ("data_args_path",), PER_SPLIT_SOURCES,
                 ("per_split_data_args_path",)),
                (("train_iters",), ("train_samples",)),
                (("lr_warmup_iters",), ("lr_warmup_samples",), ("lr_warmup_fraction",)),
                (("lr_decay_iters",), ("lr_decay_samples",)),
                (("lr_wsd_decay_iters",), ("lr_wsd_decay_samples",)))


def _replace_alternatives(cfg: "Config", flags: set) -> None:
    """Reset to their defaults the ways of each ALTERNATIVES group other than the one ``flags``
    (field names given on the command line) use; and the YAML's --split when they give per-split
    data (its own blend for each split) without --split."""
    fields = {f.name: sec for sec, f in config_fields()}
    defaults = Config()
    for group in ALTERNATIVES:
        used = [way for way in group if flags & set(way)]
        for name in [name for way in group if way not in used for name in way] if used else []:
            setattr(getattr(cfg, fields[name]), name, getattr(getattr(defaults, fields[name]), name))
    if flags & set(PER_SPLIT_SOURCES + ("per_split_data_args_path",)) and "split" not in flags:
        cfg.data.split = defaults.data.split


def config_from_args(args: argparse.Namespace, base: Optional[dict] = None) -> Config:
    """Build a Config: defaults, then ``base`` (a mapping of config keys, e.g. the embedded-default
    run settings), then the --model preset, then the --config YAML, then the flags given. A flag of
    an ALTERNATIVES group (a data source, --train-samples, a warm-up or decay length) replaces the
    other ways of that group given below it, as flags win."""
    cfg = Config()
    if base:
        apply_mapping(cfg, base, source="defaults")
    preset = getattr(args, "model_preset", None)
    yaml_map = {}
    if getattr(args, "config", None):
        yaml_map = load_yaml(args.config)
        preset = preset or yaml_map.get("model_preset") or (
            yaml_map.get("model") if isinstance(yaml_map.get("model"), str) else None)
    if preset:
        from .presets import apply_preset
        apply_preset(cfg, preset)
    if yaml_map:
        apply_mapping(cfg, yaml_map, source=args.config)
    _replace_alternatives(cfg, {dest.split(".", 1)[1] for dest in vars(args) if "." in dest})
    for dest, value in vars(args).items():
        if "." in dest:
            sec, name = dest.split(".", 1)
            setattr(getattr(cfg, sec), name, value)
    return cfg


def dump_yaml(cfg: Config, path: str, flag: str = "--run-dir") -> None:
    """Write the resolved config, nested by section, as a YAML file ``--config`` reads back; whole
    or not at all (a full disk: ConfigError naming ``flag``, folders.write_text_file)."""
    import yaml

    from .folders import write_text_file
    write_text_file(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False), flag)


def load_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path``; ConfigError (one line naming the file and the fix)
    when it cannot be read, is not UTF-8, is not YAML, repeats a key or is not a mapping."""
    from .yaml_file import read_mapping
    return read_mapping(path, "--config")


def explicit_fields(args: argparse.Namespace) -> set:
    """Names of the fields the user set, by a flag or a --config key (not by a preset or default)."""
    names = {dest.split(".", 1)[1] for dest in vars(args) if "." in dest}
    if getattr(args, "config", None):
        idx = _index()
        names |= {idx[key][1].name for key, _ in _flatten(load_yaml(args.config)) if key in idx}
    return names


# ----------------------------------------------------------------------------- derived values

def world_size_of(cfg: Config) -> int:
    """Processes in the job: WORLD_SIZE under torchrun (RANK set), SLURM_NTASKS under srun
    (SLURM_PROCID set), else the local worker count (a WORLD_SIZE left in a shell that launches
    its own workers does not size them)."""
    for rank, var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in os.environ and os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default_nproc(cfg)


def default_nproc(cfg: Config) -> int:
    """--nproc-per-node, else one per GPU, else what the layout needs on CPU: TP×CP×PP, times the
    smallest DP that expert parallelism needs (EP must divide DP × CP)."""
    p = cfg.parallel
    if p.nproc_per_node:
        return p.nproc_per_node
    import torch
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    ep, cp = max(1, p.expert_model_parallel_size or 1), p.context_parallel_size
    return p.tensor_model_parallel_size * cp * p.pipeline_model_parallel_size * (ep // math.gcd(ep, cp))


def dp_size(cfg: Config, world: Optional[int] = None) -> int:
    p = cfg.parallel
    world = world_size_of(cfg) if world is None else world
    return world // (p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size)


def global_batch(cfg: Config, world: Optional[int] = None) -> int:
    """--global-batch-size, else the last --step-batch-size-schedule entry's batch, else micro ×
    --gradient-accumulation-steps (default 1) × DP."""
    t = cfg.training
    if t.global_batch_size:
        return t.global_batch_size
    steps = step_schedule(cfg)
    return steps[-1][1] if steps else t.micro_batch_size * (t.gradient_accumulation_steps or 1) * dp_size(cfg, world)


def step_schedule(cfg: Config) -> Optional[tuple]:
    """--step-batch-size-schedule as ((threshold samples, batch), ...) at --seq-length, or None
    (batches.parse_step_schedule; its ValueError is validate's one line)."""
    text = cfg.training.step_batch_size_schedule
    return None if text is None else parse_step_schedule(text, cfg.model.seq_length)


def num_microbatches(cfg: Config, world: Optional[int] = None) -> int:
    """global batch / (micro batch × DP): micro-batches each DP rank runs per step (after any
    --rampup-batch-size ramp; evaluation always runs this many)."""
    return global_batch(cfg, world) // (cfg.training.micro_batch_size * dp_size(cfg, world))


def batch_schedule(cfg: Config, world: Optional[int] = None) -> BatchSchedule:
    """The global batch of every step: constant, ramped by --rampup-batch-size, or by
    --step-batch-size-schedule (batches.py)."""
    t = cfg.training
    ramp = tuple(t.rampup_batch_size) if t.rampup_batch_size else None
    return BatchSchedule(global_batch(cfg, world), t.micro_batch_size * dp_size(cfg, world), ramp, step_schedule(cfg))


def run_iterations(cfg: Config, world: Optional[int] = None) -> int:
    """Optimizer steps of the run: --train-iters; else the steps --train-samples takes (Megatron's
    update_train_iters, ramp included: BatchSchedule.iterations); else DEFAULT_TRAIN_ITERS."""
    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is not None:
        return batch_schedule(cfg, world).iterations(t.train_samples)
    return DEFAULT_TRAIN_ITERS


def run_samples(cfg: Config, world: Optional[int] = None) -> int:
    """Training samples the run asks of its data: the samples its steps take (iterations × global
    batch at a constant batch, a ramp's or step schedule's smaller steps summed), and at least
    --train-samples (Megatron's count for the training split). A run in samples may pass
    --train-samples in its last step: a step schedule's, or a ramp's whose SAMPLES reach past the run
    (Megatron's update_train_iters counts the ramp's step that starts at c = --train-samples)."""
    t = cfg.training
    taken = batch_schedule(cfg, world).consumed_after(run_iterations(cfg, world))
    return taken if t.train_samples is None else max(t.train_samples, taken)


def ffn_hidden(m: ModelConfig) -> int:
    """MLP width: given, else 4h (GeLU) or, for SwiGLU (LLaMA §2), 8h/3 rounded down to a multiple of 64
    as Megatron-LM derives it (``int((4 * h * 2 / 3) / 64) * 64``: 10,880 at h = 4,096), at least 64
    (Megatron's gives 0 below h = 24)."""
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    if m.swiglu:
        return max(64, int((4 * m.hidden_size * 2 / 3) / 64) * 64)
    return 4 * m.hidden_size


def moe_ffn(m: ModelConfig) -> int:
    """Routed expert width: --moe-ffn-hidden-size, else the dense MLP's (Megatron)."""
    return m.moe_ffn_hidden_size or ffn_hidden(m)


def moe_layer_pattern(m: ModelConfig) -> list:
    """[bool] per layer: whether its MLP is an MoE (all False without --num-experts). Megatron's
    --moe-layer-freq: an int N makes layers 0, N, 2N, … MoE; a list expression of 0/1 (``[1]*3+[0]``,
    ``([0]+[1]*3)*2``) gives each layer. Raises ConfigError naming the flag for anything else or a
    pattern whose length is not --num-layers."""
    if not m.num_experts:
        return [False] * m.num_layers
    text = str(m.moe_layer_freq).strip()
    try:
        value = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):  # RecursionError: "[1]+[1]+…" thousands of terms
        raise ConfigError(f"--moe-layer-freq {text!r}: give an integer N or a list of 0/1 per layer such as "
                          f"\"([0]+[1]*3)*2\"") from None
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"--moe-layer-freq {text}: give a positive integer")
        return [i % value == 0 for i in range(m.num_layers)]
    if any(type(v) is not int or v not in (0, 1) for v in value):
        raise ConfigError(f"--moe-layer-freq {text!r}: every entry must be 0 (dense) or 1 (MoE), one per layer, "
                          f"such as \"([0]+[1]*3)*2\"")
    if len(value) != m.num_layers:
        raise ConfigError(f"--moe-layer-freq {text!r} gives {len(value)} entries for --num-layers {m.num_layers}; "
                          f"give one 0 (dense) or 1 (MoE) per layer")
    return [bool(v) for v in value]


_PATTERN_MAX = 1 << 20  # entries a --moe-layer-freq list may reach while it is built (a layer each)


def _pattern_value(node):
    """The value of a --moe-layer-freq expression: ints, lists of them, + and * only (no eval).
    ValueError for anything else: a list added to an int or multiplied by a list, a negative
    repeat, or a list longer than _PATTERN_MAX entries (``[1]*10**11`` would fill the memory)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(a, list) != isinstance(b, list) or len(a if isinstance(a, list) else []) + \
                    len(b if isinstance(b, list) else []) > _PATTERN_MAX:
                raise ValueError(node)
            return a + b
        if isinstance(a, list) and isinstance(b, list):
            raise ValueError(node)
        items, times = (a, b) if isinstance(a, list) else (b, a)
        if isinstance(items, list) and (times < 0 or len(items) * times > _PATTERN_MAX):
            raise ValueError(node)
        return a * b
    raise ValueError(node)


def gelu_tanh(m: ModelConfig) -> bool:
    """Whether the GeLU MLP computes GeLU's tanh approximation (Hendrycks & Gimpel 2016, §2):
    under --openai-gelu, and, as Megatron-LM does, under its default --bias-gelu-fusion for a
    GeLU MLP with biases (megatron-core transformer/mlp.py: the fused bias_gelu_impl of
    fusions/fused_bias_gelu.py is the tanh form; without biases Megatron runs the exact F.gelu)."""
    return m.openai_gelu or (m.bias_gelu_fusion and m.add_bias_linear and not m.swiglu)


def query_groups(m: ModelConfig) -> int:
    """Key/value heads: --num-query-groups under --group-query-attention (1 when not given: Megatron's
    default, multi-query attention), else one per attention head (Megatron ignores --num-query-groups
    without --group-query-attention)."""
    if m.group_query_attention:
        return m.num_query_groups or 1
    return m.num_attention_heads


def head_dim(m: ModelConfig) -> int:
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def rotary_dim(m: ModelConfig) -> int:
    """The dimension RoPE's frequencies are computed for: int(head dim × --rotary-percent) when the
    percent is below 1, else the head dim (Megatron-core RotaryEmbedding.__init__). The first
    2·ceil(rotary_dim / 2) dimensions of each head are rotated (model/attention.py, Rotary)."""
    return int(head_dim(m) * m.rotary_percent) if m.rotary_percent < 1.0 else head_dim(m)


def max_positions(m: ModelConfig) -> int:
    return m.max_position_embeddings or m.seq_length


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by × TP."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


def zero_stage(p: ParallelConfig) -> int:
    """The ZeRO stage (Rajbhandari et al. 2020, §5: P_os, P_os+g, P_os+g+p) of the parallel flags:
    the highest that --data-parallel-sharding-strategy, --use-distributed-optimizer (1) and
    --use-torch-fsdp2 (3) ask for (validate.py refuses the contradictory pairs)."""
    return max(SHARDING[p.data_parallel_sharding_strategy], 1 if p.use_distributed_optimizer else 0,
               3 if p.use_torch_fsdp2 else 0)


ONE_RANK_BUCKET = 1 << 30  # elements: the default --ddp-bucket-size at DP × CP 1 (parallel/data.py)


def bf16_reduce(cfg: Config) -> bool:
    """Whether --grad-reduce-in-bf16 keeps bf16 params' gradient buckets in bf16 (parallel/data.py;
    Megatron: it turns --accumulate-allreduce-grads-in-fp32 off under --bf16)."""
    return cfg.training.bf16 and cfg.parallel.grad_reduce_in_bf16


def half_grads(cfg: Config, world: Optional[int] = None, cuda: bool = True) -> bool:
    """Whether bf16 params keep their gradient buckets in bf16, not fp32 (parallel/data.py): on
    the CUDA fast path, with one backward a step whose gradients nothing sums or rescales before
    the optimizer reads them — DP × CP 1, no SP all-reduce at TP > 1, no tied-embedding all-reduce
    at PP > 1, one micro-batch and no batch ramp or step schedule, no --overlap-grad-reduce hooks, ZeRO below 2, no
    optimizer offload. A bf16 gradient widens to fp32 exactly, so the bucket then holds what the
    fp32 one would; the optimizer widens it as it reads (optim/optimizer.py), and the fold, the grad
    norm and the update each move 2 bytes a parameter less."""
    p, t = cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    return (cuda and t.bf16 and t.fast_path != "off" and dp_size(cfg, world) * p.context_parallel_size == 1
            and not (p.sequence_parallel and tp > 1) and not (pp > 1 and not cfg.model.untie_embeddings_and_output_weights)
            and not p.overlap_grad_reduce and zero_stage(p) < 2 and num_microbatches(cfg, world) == 1
            and batch_schedule(cfg, world).sizes() == [global_batch(cfg, world)] and not cfg.optimizer.optimizer_cpu_offload)
