"""The model flags a checkpoint must match: what decides a model's function and tensor shapes.

A resume compares them with the checkpoint's saved config (state.py ``check_model_config``), a
Hugging Face load with the HF model's (hf_config.py ``flag_problems``).
"""

from __future__ import annotations

import dataclasses

from .. import config as C
from .. import mup

GELU = "gelu"  # architecture()'s key for the GeLU's form ("tanh" / "exact"), which two flags decide


def differs(name: str, a, b) -> bool:
    """Whether entry ``name`` differs between two architectures in a way worth a line: a GeLU form
    against a SwiGLU model's None is not one (the --swiglu entry already differs)."""
    return a != b and not (name == GELU and None in (a, b))


def difference(name: str, a, b, sides: tuple) -> str:
    """One differing architecture entry as ``--flag <sides[0]>=a <sides[1]>=b`` (an inverted switch
    such as --disable-bias-linear in its own sense); the GeLU's form names the flags that give each."""
    if name == GELU:
        return (f"GeLU {sides[0]}={a} {sides[1]}={b} (tanh: --openai-gelu, or the default fused bias-GeLU with "
                f"biases; exact: --no-bias-gelu-fusion)")
    f = {f.name: f for f in dataclasses.fields(C.ModelConfig)}[name]
    if f.metadata.get("action") == "store_false":
        a, b = not a, not b
    return f"{C.flag_of(f)} {sides[0]}={a} {sides[1]}={b}"


def architecture(m: C.ModelConfig) -> dict:
    """{field name: effective value} of the ModelConfig fields that decide the model's function and
    tensor shapes (defaults resolved, e.g. --ffn-hidden-size None → 4h; MoE fields only for an
    MoE model, --moe-layer-freq as its layer pattern; under --use-mup its multipliers). Dropout, init, sequence
    length (except as the learned position table size) may change on resume and are left out, and
    so may --make-vocab-size-divisible-by (checkpoints hold the unpadded vocabulary)."""
    arch = {name: getattr(m, name) for name in (
        "num_layers", "hidden_size", "num_attention_heads", "normalization", "norm_epsilon", "apply_layernorm_1p",
        "swiglu", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
        "qk_layernorm", "vocab_size")}
    arch.update(num_query_groups=C.query_groups(m), ffn_hidden_size=C.ffn_hidden(m), kv_channels=C.head_dim(m))
    # the GeLU's form, whichever flags give it: --openai-gelu and the default fused bias-GeLU are the same
    # tanh (a GPT-2 export of the one re-imports as the other); None for SwiGLU
    arch[GELU] = None if m.swiglu else "tanh" if C.gelu_tanh(m) else "exact"
    arch["num_experts"] = m.num_experts or None
    if m.num_experts:  # what routes and where the experts are (the bias, losses and capacity may change)
        arch.update(moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=C.moe_ffn(m),
                    moe_layer_freq=str(C.moe_layer_pattern(m)),
                    moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                    moe_router_score_function=m.moe_router_score_function,
                    moe_router_pre_softmax=m.moe_router_pre_softmax)
    arch["use_mup"] = m.use_mup
    if m.use_mup:  # the multipliers a resumed run keeps (meshlm/mup.py), defaults resolved
        arch.update(mup_base_hidden_size=m.mup_base_hidden_size or m.hidden_size,
                    mup_embedding_mult=mup.embedding_mult(m), mup_output_mult=mup.output_mult(m),
                    mup_base_head_dim=m.mup_base_head_dim, mup_attn_scale_power=m.mup_attn_scale_power)
    if m.position_embedding_type == "rope":
        arch.update(rotary_base=m.rotary_base, rotary_percent=m.rotary_percent)
    else:
        arch["max_position_embeddings"] = C.max_positions(m)
    return arch
