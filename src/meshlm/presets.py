"""Named model shapes for ``--model``: GPT-2/GPT-3, Llama, Mistral and Mixtral families.

Each preset sets ModelConfig fields only (shape, norm, activation, positions, tying, bias,
dropout); it is applied on top of the defaults and below ``--config`` YAML and flags, so
``--model llama3-8b --num-layers 2`` is a two-layer Llama-3 block. The vocabulary is never
fixed here: it comes from the tokenizer (or ``--vocab-size`` with mock data).

Sources:
  gpt2-125m … gpt3-175b: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    (layers, d_model, heads); GPT-2 architecture (LayerNorm, GeLU, learned positions, tied
    embeddings, biases). gpt2-* use sequence 1024 as in Megatron-LM's GPT-2 examples, gpt3-* 2048.
    Table 2.1 gives the 1.3B model 24 heads of 128 (3072 ≠ d_model 2048); we use 16 heads of 128
    as Megatron-LM's examples do, and 5120 (not 5140) for 13B.
  llama2-*: Touvron et al. 2023, "Llama 2", Table 1 and the released configs (RMSNorm eps 1e-5,
    SwiGLU, RoPE base 10000, context 4096, untied, no biases).
  llama-1b, llama-3b, llama3-*: the released Llama 3 / 3.2 configs (Dubey et al. 2024, Table 3):
    RoPE base 500000, GQA with 8 KV heads, context 8192; 3.2-1B/3B tie input and output embeddings.
    Llama 3.1+ long-context RoPE scaling is not modelled.
  mistral-7b: Mistral-7B-v0.3 config (GQA 8, RoPE base 1e6, no sliding window).
  mixtral-8x7b: Mixtral-8x7B-v0.1 config (Jiang et al. 2024, "Mixtral of Experts", Table 1): the
    Mistral-7B block with every MLP an MoE of 8 SwiGLU experts of 14336, top-2 softmax routing;
    load-balancing coefficient 1e-2 as in Megatron-LM's Mixtral example.
  mixtral-tiny, mixtral-small: the same design at test size (seconds per step on a CPU core) and
    at bench size (16 layers of 1024, 8 experts of 3584, top-2: with a 32k vocabulary 1.5B
    parameters, 0.5B used per token), shapes of our choosing.
"""

from __future__ import annotations

from .errors import ConfigError

_DENSE = dict(num_experts=None, moe_router_topk=2, moe_aux_loss_coeff=0.0)  # a preset leaves no MoE behind

_GPT = dict(_DENSE, normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False,
            position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
            add_bias_linear=True, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
            group_query_attention=False, num_query_groups=None, ffn_hidden_size=None, kv_channels=None)

_LLAMA = dict(_DENSE, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, position_embedding_type="rope",
              untie_embeddings_and_output_weights=True, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, init_method_std=0.02, group_query_attention=False,
              num_query_groups=None, kv_channels=None)


def _gpt(layers: int, hidden: int, heads: int, seq: int = 1024) -> dict:
    return dict(_GPT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                seq_length=seq, max_position_embeddings=seq)


def _llama(layers: int, hidden: int, heads: int, ffn: int, *, groups=None, seq: int, base: float,
           max_pos=None, tied: bool = False) -> dict:
    return dict(_LLAMA, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                ffn_hidden_size=ffn, seq_length=seq, max_position_embeddings=max_pos or seq,
                rotary_base=base, group_query_attention=groups is not None, num_query_groups=groups,
                untie_embeddings_and_output_weights=not tied)


def _mixtral(layers: int, hidden: int, heads: int, ffn: int, *, groups: int, experts: int = 8, seq: int,
             max_pos=None) -> dict:
    return dict(_llama(layers, hidden, heads, ffn, groups=groups, seq=seq, base=1000000.0, max_pos=max_pos),
                num_experts=experts, moe_router_topk=2, moe_aux_loss_coeff=1e-2)


PRESETS: dict[str, dict] = {
    # a laptop/test model: seconds per step on one CPU core
    "tiny": dict(_gpt(2, 64, 4, 128), hidden_dropout=0.0, attention_dropout=0.0),
    "gpt2-125m": _gpt(12, 768, 12),
    "gpt2-350m": _gpt(24, 1024, 16),
    "gpt2-760m": _gpt(24, 1536, 16),
    "gpt2-1.3b": _gpt(24, 2048, 16),
    "gpt3-2.7b": _gpt(32, 2560, 32, 2048),
    "gpt3-6.7b": _gpt(32, 4096, 32, 2048),
    "gpt3-13b": _gpt(40, 5120, 40, 2048),
    "gpt3-175b": _gpt(96, 12288, 96, 2048),
    "llama-1b": _llama(16, 2048, 32, 8192, groups=8, seq=8192, base=500000.0, max_pos=131072, tied=True),
    "llama-3b": _llama(28, 3072, 24, 8192, groups=8, seq=8192, base=500000.0, max_pos=131072, tied=True),
    "llama2-7b": _llama(32, 4096, 32, 11008, seq=4096, base=10000.0),
    "llama2-13b": _llama(40, 5120, 40, 13824, seq=4096, base=10000.0),
    "llama2-70b": _llama(80, 8192, 64, 28672, groups=8, seq=4096, base=10000.0),
    "llama3-8b": _llama(32, 4096, 32, 14336, groups=8, seq=8192, base=500000.0),
    "llama3-70b": _llama(80, 8192, 64, 28672, groups=8, seq=8192, base=500000.0),
    "mistral-7b": _llama(32, 4096, 32, 14336, groups=8, seq=8192, base=1000000.0, max_pos=32768),
    "mixtral-tiny": _mixtral(2, 64, 4, 128, groups=2, experts=4, seq=128),
    "mixtral-small": _mixtral(16, 1024, 16, 3584, groups=8, seq=2048),
    "mixtral-8x7b": _mixtral(32, 4096, 32, 14336, groups=8, seq=4096, max_pos=32768),
}


def apply_preset(cfg, name: str) -> None:
    """Set ``cfg.model`` to the named shape and record it in ``cfg.model_preset``.

    Raises ConfigError naming ``--model`` and every valid choice when the name is unknown.
    """
    if name not in PRESETS:
        raise ConfigError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        setattr(cfg.model, key, value)
    cfg.model_preset = name
