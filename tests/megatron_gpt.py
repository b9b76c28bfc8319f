"""megatron-core 0.16.1's GPTModel on CPU over gloo, as the reference of meshlm's model and of the
Megatron checkpoint converter (test helper; needs megatron-core, skipped without it).

megatron-core runs on CPU given (facts checked on this machine, issue 28):
- ``torch.cuda.current_device`` returning "cpu" (its memory buffer, TP all-gathers and RoPE's
  inv_freq ask for it) and ``torch.cuda.synchronize`` a no-op;
- an RNG tracker that needs no CUDA (the inference tracker: ``fork`` changes nothing; every model
  here runs without dropout);
- the checkpoint writer's results queue held by a forked Manager (its default, a spawned one,
  costs a fresh interpreter per process; a plain queue races its ``empty()`` check);
- ``moe_utils.te_general_gemm`` defined (None: 0.16.1's router reads it unset without TE), the
  MoE token dispatcher "allgather" (alltoall makes a CUDA stream);
- ``apply_rope_fusion``, ``persist_layer_norm``, ``gradient_accumulation_fusion`` off and
  ``use_cpu_initialization`` on. Sequence parallelism needs apex there and is not used.
- its optimizers (``optimizer``): tensors they make on device="cuda" made on the CPU, and CPU
  tensors' ``type()`` named as CUDA's, which is all the DistributedOptimizer's CPU build lacks
  (its grad buffers are made on ``torch.cuda.current_device()``, the CPU here);
- pipeline stages: the tied output layer's copy, which megatron-core moves to CUDA before
  synchronising it with the embedding, left on the CPU.

``build(spec, tp_size)`` initialises megatron's parallel state over the running gloo group and
returns its GPTModel of the local spec; ``spec`` is a dict of meshlm model flags (the same dict
builds meshlm's model in the tests). ``save``/``load`` are megatron-core's dist_checkpointing of
the model's sharded state dict (torch_dist), in Megatron-LM's folder layout.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch


def patch_cpu() -> None:
    """Let megatron-core's CUDA-minded code run on CPU (see the module docstring)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if filesystem_async._results_queue is None:  # its default, a spawned Manager, is a fresh interpreter (~4 s)
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 reads it unset without Transformer Engine
        moe_utils.te_general_gemm = None


def _bias_gelu_fusion(spec: dict) -> bool:
    """Megatron-LM's --bias-gelu-fusion (on unless --no-bias-gelu-fusion) for a GeLU MLP with biases."""
    return spec.get("bias_gelu_fusion", True) and spec.get("add_bias_linear", True) and not spec.get("swiglu")


def _config(spec: dict, tp: int, dtype, pp: int = 1):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend
    experts = spec.get("num_experts")
    kw = dict(num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
              num_attention_heads=spec["num_attention_heads"],
              num_query_groups=spec.get("num_query_groups"), ffn_hidden_size=spec.get("ffn_hidden_size"),
              normalization=spec.get("normalization", "LayerNorm"), layernorm_epsilon=spec.get("norm_epsilon", 1e-5),
              gated_linear_unit=spec.get("swiglu", False), add_bias_linear=spec.get("add_bias_linear", True),
              add_qkv_bias=spec.get("add_qkv_bias", False), qk_layernorm=spec.get("qk_layernorm", False),
              hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, pipeline_dtype=dtype if pp > 1 else None,
              use_cpu_initialization=True, perform_initialization=True, init_method_std=0.02,
              params_dtype=dtype, apply_rope_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, bias_activation_fusion=_bias_gelu_fusion(spec),
              masked_softmax_fusion=False, bias_dropout_fusion=False, attention_backend=AttnBackend.unfused)
    if spec.get("swiglu"):
        kw["activation_func"] = torch.nn.functional.silu
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=spec.get("moe_router_topk", 2),
                  moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"), moe_grouped_gemm=spec.get("grouped", False),
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                  expert_model_parallel_size=spec.get("ep", 1))
    return TransformerConfig(**{k: v for k, v in kw.items() if v is not None})


def build(spec: dict, tp: int, vocab: int, seq: int, dtype=torch.float32, seed: int = 1234, pp: int = 1):
    """megatron-core GPTModel (local spec) of the meshlm model flags ``spec`` at TP ``tp``, inside
    a running gloo group; returns the model (in eval mode, no dropout anywhere). pp > 1: this
    rank's pipeline stage (its layers, the embedding on the first, the output layer on the last;
    a tied output layer's copy is synchronised on CPU, where megatron-core moves it to CUDA)."""
    patch_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import random as mrandom
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=spec.get("ep", 1))
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    cfg = _config(spec, tp, dtype, pp)
    layer = get_gpt_layer_local_spec(num_experts=spec.get("num_experts"), moe_grouped_gemm=spec.get("grouped", False),
                                     qk_layernorm=spec.get("qk_layernorm", False), normalization=cfg.normalization)
    rope = spec.get("position_embedding_type", "learned_absolute")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the local spec's norms are made in the default dtype
    try:
        with _tensors_stay_on_cpu():  # the tied output layer's copy (pp > 1)
            model = GPTModel(cfg, layer, vocab_size=vocab, max_sequence_length=seq,
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage(),
                             share_embeddings_and_output_weights=not spec.get("untie_embeddings_and_output_weights",
                                                                              False),
                             position_embedding_type=rope, rotary_percent=spec.get("rotary_percent", 1.0),
                             rotary_base=int(spec.get("rotary_base", 10000)))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


@contextlib.contextmanager
def _tensors_stay_on_cpu():
    """``Tensor.cuda()`` returning the tensor itself: megatron-core moves a few CPU tensors to CUDA
    to communicate them (the tied output layer's copy at PP > 1, the distributed optimizer's
    fully_reshardable gather)."""
    plain = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = plain


def forward(model, tokens: torch.Tensor, labels=None):
    """Logits [b, s, V/tp] (this TP rank's vocabulary slice), or the per-token loss [b, s] with labels."""
    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked
    return model(tokens, position_ids, mask, labels=labels)


def save(model, root: str, iteration: int = 1, args=None, singleton: bool = False, optimizer=None,
         sharding: str = "") -> str:
    """Megatron-LM's checkpoint layout of the model: ``root/iter_NNNNNNN`` (torch_dist: common.pt,
    metadata.json, DCP files) and the tracker; ``args`` (a Namespace) goes into common.pt as
    Megatron-LM's training loop puts it; singleton: one key per expert (megatron-core's
    ``singleton_local_shards``, the other expert layout). Collective over the job."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    folder = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    sharded = model.sharded_state_dict(metadata={"singleton_local_shards": True} if singleton else None)
    state = {"model": sharded, "iteration": iteration, "checkpoint_version": 3.0}
    if optimizer is not None:  # the plain optimizer's per-parameter state in model space; the distributed
        # optimizer's as Megatron-LM asks for it (``sharding``: "dp_reshardable" by default, "fully_reshardable"
        # under --dist-ckpt-optim-fully-reshardable)
        meta = {"distrib_optim_sharding_type": sharding} if sharding else None
        with _tensors_stay_on_cpu():
            state["optimizer"] = optimizer.sharded_state_dict(model.sharded_state_dict(), metadata=meta)
    if args is not None:
        state["args"] = args
    dist_checkpointing.save(state, folder)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    dist.barrier()
    return folder


def load(model, folder: str) -> None:
    """Load a torch_dist folder (Megatron-LM's ``iter_NNNNNNN``) into the model, strictly: every
    tensor and object the model asks for must be there."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder,
                                    strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state["model"])


@contextlib.contextmanager
def _cuda_as_cpu():
    """Tensors megatron-core's optimizer makes on device="cuda" (its overflow buffer, found-inf
    flags) made on the CPU instead, and CPU tensors' ``type()`` named as CUDA's (the distributed
    optimizer accepts only ``torch.cuda.FloatTensor``/``BFloat16Tensor``/``HalfTensor`` params)."""
    saved = {name: getattr(torch, name) for name in ("tensor", "zeros", "empty", "ones")}
    plain_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        name = plain_type(self, *a, **k)
        if a or k or not name.startswith("torch.") or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name.removeprefix("torch.")
    torch.Tensor.type = cuda_type

    def on_cpu(make):
        def make_on_cpu(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return make(*a, **k)
        return make_on_cpu
    for name, make in saved.items():
        setattr(torch, name, on_cpu(make))
    try:
        yield
    finally:
        torch.Tensor.type = plain_type
        for name, make in saved.items():
            setattr(torch, name, make)


def optimizer(model, distributed: bool = False, lr: float = 1e-2):
    """megatron-core's DDP and optimizer of the model (Adam: torch's AdamW without TE/apex; no
    clipping, which asserts CUDA tensors); distributed: its distributed optimizer, which shards
    the fp32 masters and moments over DP in its grad buffer's buckets. bf16 params get fp32
    masters (Megatron-LM's --bf16). Returns (ddp, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    bf16 = model.config.params_dtype == torch.bfloat16
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    with _cuda_as_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0, bf16=bf16,
                                                     use_distributed_optimizer=distributed,
                                                     params_dtype=model.config.params_dtype), [ddp])
    return ddp, opt


def step(ddp, opt, tokens, labels) -> None:
    """One optimizer step on the mean per-token loss of this DP rank's ``tokens`` (DDP averages
    the gradients over DP). Each param group's weight decay is set as Megatron-LM's
    OptimizerParamScheduler sets it before a step: weight_decay × wd_mult (0 for biases and norms)."""
    for group in opt.param_groups:
        group["weight_decay"] = opt.config.weight_decay * group.get("wd_mult", 1.0)
    ddp.module.train()
    with _cuda_as_cpu():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        forward(ddp, tokens, labels).float().mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    ddp.module.eval()


def adam_step(model, tokens, labels, lr: float = 1e-2):
    """One step of megatron-core's (not distributed) optimizer on the mean per-token loss;
    returns the optimizer."""
    ddp, opt = optimizer(model, lr=lr)
    step(ddp, opt, tokens, labels)
    return opt


def adam_state(opt, p, kind: str):
    """Adam's ``kind`` ("exp_avg", "exp_avg_sq", "step") of parameter p in megatron-core's optimizer."""
    for inner in getattr(opt, "chained_optimizers", [opt]):
        if p in inner.optimizer.state:
            return inner.optimizer.state[p][kind]
    raise KeyError("no optimizer state for this parameter")


def _grad(p):
    return p.grad


def full_grads(model, tp_group, spec: dict, vocab: int, of=_grad) -> dict:
    """{meshlm global name: full gradient} of the megatron model's parameters (collective over TP),
    or of another per-parameter tensor ``of(p)`` (an optimizer state):
    the local spec's names are meshlm's; TP shards are gathered along their partition dim, a
    SwiGLU fc1's [gate_r; up_r] shards put back as [gate; up], QKV de-interleaved, the vocabulary
    cut to ``vocab`` rows; the q/k norms' gradients (per TP rank: its heads) summed over TP."""
    import torch.distributed as dist

    from meshlm.checkpoint.megatron import _qkv_from_megatron
    tp = dist.get_world_size(tp_group)
    heads = spec["num_attention_heads"]
    groups, d = spec.get("num_query_groups") or heads, spec["hidden_size"] // heads
    out = {}
    for name, p in model.named_parameters():
        g = of(p).detach()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            if spec.get("swiglu") and "linear_fc1" in name:
                halves = [x.chunk(2, p.partition_dim) for x in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            g = torch.cat(parts, p.partition_dim)
        elif tp > 1 and of is _grad and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            g = g.clone()  # each rank's heads' part: megatron-core sums them over TP in finalize_model_grads
            dist.all_reduce(g, group=tp_group)
        name = name.removeprefix("decoder.")
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            g = _qkv_from_megatron(g, heads, groups, d)
        if name.startswith(("embedding.word_embeddings", "output_layer")):
            g = g[:vocab]
        out[name] = g
    return out


def megatron_args(spec: dict, tp: int, vocab: int, seq: int, padded: int, pp: int = 1):
    """The args Megatron-LM's training loop would put into common.pt for this model (its flag
    names, the derived sizes resolved as its arguments.py does, megatron enums included)."""
    import argparse

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    heads, groups = spec["num_attention_heads"], spec.get("num_query_groups")
    return argparse.Namespace(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=heads,
        group_query_attention=groups is not None, num_query_groups=groups or heads,
        ffn_hidden_size=spec["ffn_hidden_size"], kv_channels=spec["hidden_size"] // heads, seq_length=seq,
        max_position_embeddings=seq, normalization=spec.get("normalization", "LayerNorm"), norm_epsilon=1e-5,
        swiglu=spec.get("swiglu", False), openai_gelu=False, bias_gelu_fusion=_bias_gelu_fusion(spec),
        position_embedding_type=spec.get("position_embedding_type", "learned_absolute"),
        rotary_percent=spec.get("rotary_percent", 1.0), rotary_base=10000, rotary_interleaved=False,
        untie_embeddings_and_output_weights=spec.get("untie_embeddings_and_output_weights", False),
        add_bias_linear=spec.get("add_bias_linear", True), vocab_size=vocab, padded_vocab_size=padded,
        make_vocab_size_divisible_by=padded // tp, tokenizer_type="NullTokenizer",
        num_experts=spec.get("num_experts"), moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"),
        moe_router_topk=spec.get("moe_router_topk", 2), moe_layer_freq=1, moe_grouped_gemm=spec.get("grouped", False),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, qk_layernorm=spec.get("qk_layernorm", False),
        add_qkv_bias=spec.get("add_qkv_bias", False), hidden_dropout=0.0,
        attention_dropout=0.0,
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.unfused, params_dtype=torch.float32)
