"""Hugging Face ``config.json`` ↔ meshlm's model flags, for Llama, Mistral, Mixtral, Qwen2, Qwen3
and GPT-2.

Fields read (transformers' names; ``rope_parameters`` is transformers ≥ 5, ``rope_theta`` and
``rope_scaling`` earlier versions):

- llama / mistral: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads
  (→ --group-query-attention --num-query-groups), head_dim (→ --kv-channels), intermediate_size
  (→ --ffn-hidden-size), vocab_size, rms_norm_eps, rope theta (→ --rotary-base),
  tie_word_embeddings, attention_bias / mlp_bias (llama; → --disable-bias-linear when false),
  max_position_embeddings, hidden_act (silu only: SwiGLU), sliding_window (mistral, mixtral).
- mixtral: as mistral, plus num_local_experts (→ --num-experts, every layer MoE),
  num_experts_per_tok (→ --moe-router-topk), intermediate_size (the experts' width). Its router
  (softmax over all experts, top-k, renormalised over the k) is meshlm's default softmax routing
  (softmax over the k chosen logits): the same gates. router_jitter_noise must be 0.
  router_aux_loss_coef is neither read nor written: HF's loss is another function (it pools all
  layers' tokens and sums the top-k one-hots; Megatron's is per layer, divided by k), so one
  coefficient does not carry over; pass --moe-aux-loss-coeff.
- qwen2 / qwen3: as llama; qwen2 → --disable-bias-linear --add-qkv-bias (its q/k/v projections
  always have biases), qwen3 → --qk-layernorm (q_norm / k_norm); attention_bias and
  use_sliding_window must be false.
- gpt2: n_embd, n_layer, n_head, n_inner (default 4·n_embd), n_positions, layer_norm_epsilon,
  activation_function (gelu_new → --openai-gelu, gelu → exact GeLU: --no-bias-gelu-fusion),
  tie_word_embeddings.

A field the file leaves out takes transformers' default for that architecture (``_DEFAULTS``: e.g.
Mixtral's rms_norm_eps 1e-5 and rope_theta 1e6, Mistral's sliding_window 4096).

What meshlm cannot compute is refused, one line naming the field: RoPE scaling (llama3, yarn,
linear, dynamic), partial rotary factors, other activations, attention and MLP biases that differ,
GPT-2's per-layer attention scaling. Mistral's sliding window is accepted when it covers the whole
sequence (meshlm attends over all of it; equal to Mistral's window only then), with a note.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from .. import config as C
from ..errors import CheckpointError
from .architecture import architecture, difference, differs

ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gpt2")
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"


@dataclass
class HFModel:
    """A Hugging Face model described in meshlm's terms.

    arch: one of ARCHITECTURES. model: {ModelConfig field: value}. window: Mistral's
    sliding window in tokens (None: full attention). max_positions: the position limit.
    """

    arch: str
    model: dict
    max_positions: int
    window: Optional[int] = None
    notes: list = field(default_factory=list)

    def model_config(self, base: Optional[C.ModelConfig] = None) -> C.ModelConfig:
        """``base`` (default: ModelConfig()) with this model's fields set; a new object."""
        return dataclasses.replace(base or C.ModelConfig(), **self.model)


def read_hf_config(folder: str) -> dict:
    """The mapping in ``folder/config.json``; CheckpointError (one line) when it is unreadable."""
    path = os.path.join(folder, CONFIG)
    try:
        with open(path) as fh:
            hf = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); give a Hugging Face model folder") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: not a JSON object; give a Hugging Face model folder")
    return hf


def _need(hf: dict, key: str, where: str):
    """A positive integer field that has no default (a size or a count)."""
    if hf.get(key) is None:
        raise CheckpointError(f"{where}: field {key!r} is missing; is this a Hugging Face config.json?")
    return _int(hf, key, where)


def _int(hf: dict, key: str, where: str, default: Optional[int] = None) -> int:
    """The positive integer field ``key`` (``default`` when absent or null); CheckpointError naming
    the field for any other value (text, a fraction, a bool, 0 or less: a traceback or a
    division by zero before)."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{where}: {key}={value!r} is not a positive integer; fix config.json (is this "
                              f"a Hugging Face config.json?)")
    return value


def _float(hf: dict, key: str, where: str, default: float, low: float = 0.0, below: Optional[float] = None,
           open_low: bool = True) -> float:
    """The number field ``key`` (``default`` when absent or null), > ``low`` (≥ with open_low False)
    and < ``below``; CheckpointError naming the field and the range otherwise."""
    value = hf.get(key)
    value = default if value is None else value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (value > low if open_low else value >= low) and (value < below if below is not None else value < math.inf)
    if not ok:
        words = f"in [{low:g}, {below:g})" if below is not None else f"a number {'>' if open_low else '≥'} {low:g}"
        raise CheckpointError(f"{where}: {key}={value!r} is not {words}; fix config.json")
    return float(value)


def _refuse(where: str, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={value!r} is not supported by meshlm ({why})")


# transformers' defaults for fields a config.json may leave out (LlamaConfig, MistralConfig, MixtralConfig,
# Qwen2Config, Qwen3Config):
# the model transformers builds from such a file is the one meshlm must compute
_DEFAULTS = {"llama": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048, sliding_window=None,
                           num_key_value_heads=None),
             "mistral": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096 * 32, sliding_window=4096,
                             num_key_value_heads=8),
             "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=4096 * 32, sliding_window=None,
                             num_key_value_heads=8),
             # Qwen2Config, Qwen3Config (their sliding window applies only under use_sliding_window, refused)
             "qwen2": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, sliding_window=None,
                           num_key_value_heads=32),
             "qwen3": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, sliding_window=None,
                           num_key_value_heads=32)}


def _rope_theta(hf: dict, where: str, default: float = 10000.0) -> float:
    """The RoPE base; refuses any scaling (``rope_parameters.rope_type`` or ``rope_scaling``)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise _refuse(where, key, value, "give an object of RoPE settings or null")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise _refuse(where, "rope_parameters.rope_type", kind, "meshlm's RoPE has no scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type") or "default") != "default":
        raise _refuse(where, "rope_scaling", scaling, "meshlm's RoPE has no scaling")
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise _refuse(where, "partial_rotary_factor", factor, "meshlm rotates the whole head")
    return _float(params if "rope_theta" in params else hf, "rope_theta", where, default)


def _llama(hf: dict, arch: str, where: str) -> HFModel:
    h, heads = _need(hf, "hidden_size", where), _need(hf, "num_attention_heads", where)
    default = _DEFAULTS[arch]
    groups = _int(hf, "num_key_value_heads", where, default["num_key_value_heads"] or heads)
    d = _int(hf, "head_dim", where, h // heads or 1)
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", hf["hidden_act"], "meshlm's SwiGLU MLP uses silu")
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if arch in ("qwen2", "qwen3") and attn_bias:  # qwen2's q/k/v biases have no field; qwen3's would take o_proj's too
        raise _refuse(where, "attention_bias", attn_bias, f"{arch}'s attention biases beside an MLP without: "
                      f"meshlm's --disable-bias-linear takes biases off every linear layer or none")
    if attn_bias != mlp_bias:
        raise _refuse(where, "attention_bias", attn_bias, f"with mlp_bias={mlp_bias}: meshlm's "
                      f"--disable-bias-linear takes biases off every linear layer or none")
    if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise _refuse(where, "use_sliding_window", hf["use_sliding_window"], "meshlm has no sliding-window attention")
    positions = _int(hf, "max_position_embeddings", where, default["max_position_embeddings"])
    model = dict(
        num_layers=_need(hf, "num_hidden_layers", where), hidden_size=h, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
        kv_channels=d if h % heads or d != h // heads else None,
        ffn_hidden_size=_need(hf, "intermediate_size", where), vocab_size=_need(hf, "vocab_size", where),
        normalization="RMSNorm", norm_epsilon=_float(hf, "rms_norm_eps", where, default["rms_norm_eps"]), swiglu=True,
        openai_gelu=False, position_embedding_type="rope", rotary_base=_rope_theta(hf, where, default["rope_theta"]),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=attn_bias, max_position_embeddings=positions,
        hidden_dropout=0.0, attention_dropout=_float(hf, "attention_dropout", where, 0.0, below=1.0, open_low=False),
        init_method_std=_float(hf, "initializer_range", where, 0.02), num_experts=None,
        add_qkv_bias=arch == "qwen2", qk_layernorm=arch == "qwen3")
    if arch == "mixtral":
        if _float(hf, "router_jitter_noise", where, 0.0, open_low=False):
            raise _refuse(where, "router_jitter_noise", hf["router_jitter_noise"], "meshlm's router adds no noise")
        model.update(num_experts=_need(hf, "num_local_experts", where), moe_router_topk=_need(hf, "num_experts_per_tok", where),
                     moe_ffn_hidden_size=None, moe_layer_freq="1", moe_shared_expert_intermediate_size=None,
                     moe_router_score_function="softmax", moe_router_pre_softmax=False)
    out = HFModel(arch, model, positions)
    window = hf["sliding_window"] if "sliding_window" in hf else default["sliding_window"]
    if arch in ("mistral", "mixtral") and window is not None:
        out.window = _int({"sliding_window": window}, "sliding_window", where)
        out.notes.append(f"{where}: sliding_window={out.window}: meshlm attends over the whole sequence, "
                         f"which equals Mistral's window only for sequences of at most {out.window} tokens")
    return out


_GPT2_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def _gpt2(hf: dict, where: str) -> HFModel:
    e = _need(hf, "n_embd", where)
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_GELU:
        raise _refuse(where, "activation_function", act, f"meshlm's GeLU MLP takes {', '.join(_GPT2_GELU)}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if bool(hf.get(key, ok)) != ok:
            raise _refuse(where, key, hf[key], "meshlm scales attention by 1/sqrt(head dim) in every layer, "
                          "without cross-attention")
    positions = _int(hf, "n_positions", where, 1024)
    model = dict(
        num_layers=_need(hf, "n_layer", where), hidden_size=e, num_attention_heads=_need(hf, "n_head", where),
        group_query_attention=False, num_query_groups=None, kv_channels=None,
        ffn_hidden_size=_int(hf, "n_inner", where, 4 * e), vocab_size=_need(hf, "vocab_size", where),
        normalization="LayerNorm", norm_epsilon=_float(hf, "layer_norm_epsilon", where, 1e-5), swiglu=False,
        openai_gelu=_GPT2_GELU[act], bias_gelu_fusion=_GPT2_GELU[act], position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True), add_bias_linear=True,
        max_position_embeddings=positions, hidden_dropout=_float(hf, "resid_pdrop", where, 0.1, below=1.0, open_low=False),
        attention_dropout=_float(hf, "attn_pdrop", where, 0.1, below=1.0, open_low=False),
        init_method_std=_float(hf, "initializer_range", where, 0.02))
    return HFModel("gpt2", model, positions)


def model_from_hf(hf: dict, where: str) -> HFModel:
    """meshlm's description of the Hugging Face config ``hf`` (where: its path, for messages).

    Raises CheckpointError, one line naming the field, for another model_type or a feature meshlm
    does not compute (see the module docstring).
    """
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type={arch!r} is not supported; meshlm converts "
                              f"{', '.join(ARCHITECTURES)}")
    return _gpt2(hf, where) if arch == "gpt2" else _llama(hf, arch, where)


# ----------------------------------------------------------------------------- meshlm flags

_NOT_COMPARED = ("vocab_size", "make_vocab_size_divisible_by")  # the tokenizer and padding decide


def flag_problems(hf_model: HFModel, m: C.ModelConfig, load: str) -> list:
    """Lines saying why a run with model flags ``m`` cannot load the Hugging Face model: each
    architecture flag that differs (``--flag hf=X now=Y``, then the flags to pass), and a
    --seq-length beyond Mistral's sliding window. [] when the run's model is the HF one."""
    want, now = architecture(hf_model.model_config()), architecture(m)
    diffs = [difference(name, want[name], now.get(name), ("hf", "now")) for name in want
             if name not in _NOT_COMPARED and differs(name, want[name], now.get(name))]
    problems = []
    if diffs:
        problems.append(f"--load {load} is a Hugging Face {hf_model.arch} model of another shape than the "
                        f"model flags ({', '.join(diffs)}); pass its flags: {model_flags(hf_model)}")
    if hf_model.window is not None and m.seq_length > hf_model.window:
        problems.append(f"--load {load}: sliding_window={hf_model.window} is shorter than --seq-length "
                        f"{m.seq_length}; meshlm has no sliding-window attention: use --seq-length "
                        f"{hf_model.window} or less")
    return problems


def model_flags(hf_model: HFModel) -> str:
    """The command-line flags that give meshlm this model: its architecture fields and its dropout
    (meshlm's default is 0.1; Llama-style models train without)."""
    fields = {f.name: f for f in dataclasses.fields(C.ModelConfig)}
    skip = {"init_method_std", "vocab_size"}
    out = []
    for name, value in hf_model.model.items():
        f, action = fields[name], fields[name].metadata.get("action")
        if name in skip or value is None:
            continue
        if action == "store_true":
            out += [C.flag_of(f)] if value else []
        elif action == "store_false":
            out += [] if value else [C.flag_of(f)]
        else:
            out += [C.flag_of(f), f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(out)


# ----------------------------------------------------------------------------- export

def _export_arch(m: C.ModelConfig, arch: Optional[str]) -> str:
    """The HF architecture for ``m``: ``arch`` if given (checked), else mixtral (MoE), qwen3/qwen2,
    llama (RoPE) or gpt2. CheckpointError naming the first flag the architecture cannot express, and
    the --hf-architecture values that can (or that none can)."""
    default = _default_arch(m)
    problem = _arch_problem(m, arch or default)
    if problem is None:
        return arch or default
    fits = [a for a in ARCHITECTURES if _arch_problem(m, a) is None]
    fix = ("leave --hf-architecture out (this model exports as " + default + ")" if default in fits else
           f"give --hf-architecture {' or '.join(fits)}") if fits else \
        f"none of the architectures meshlm exports ({', '.join(ARCHITECTURES)}) can express this model"
    raise CheckpointError(f"{problem}; {fix}")


def _default_arch(m: C.ModelConfig) -> str:
    """--to-hf's architecture without --hf-architecture: mixtral (MoE), qwen3 (--qk-layernorm), qwen2
    (QKV-only biases), llama (RoPE), else gpt2."""
    qwen = "qwen3" if m.qk_layernorm else "qwen2" if m.add_qkv_bias and not m.add_bias_linear else None
    return "mixtral" if m.num_experts else qwen or ("llama" if m.position_embedding_type == "rope" else "gpt2")


def _arch_problem(m: C.ModelConfig, arch: str) -> Optional[str]:
    """The first setting of ``m`` the HF architecture ``arch`` cannot express, in words, or None."""
    rope = m.position_embedding_type == "rope"
    llama_like = arch in LLAMA_LIKE
    wanted = [("--position-embedding-type", m.position_embedding_type, "rope" if llama_like else "learned_absolute"),
              ("--normalization", m.normalization, "RMSNorm" if llama_like else "LayerNorm"),
              ("--swiglu", m.swiglu, llama_like),
              # transformers' llama/mistral/mixtral rotate every dimension of a head (no partial rotary)
              ("--rotary-percent", m.rotary_percent if rope else 1.0, 1.0),
              ("--use-mup (its multipliers have no Hugging Face field)", m.use_mup, False)]
    if arch == "gpt2":
        wanted += [("--disable-bias-linear", not m.add_bias_linear, False),
                   ("--group-query-attention", C.query_groups(m) != m.num_attention_heads, False),
                   ("--kv-channels", C.head_dim(m), m.hidden_size // m.num_attention_heads)]
    if arch in ("mistral", "mixtral", "qwen2", "qwen3"):
        wanted.append(("--disable-bias-linear", not m.add_bias_linear, True))
    wanted += [("--qk-layernorm", m.qk_layernorm, arch == "qwen3"),
               ("--add-qkv-bias", m.add_qkv_bias and not m.add_bias_linear, arch == "qwen2")]
    if arch == "mixtral":
        moe = sum(C.moe_layer_pattern(m)) if m.num_experts else 0
        wanted += [("MoE layers (--num-experts, --moe-layer-freq)", f"{moe} of {m.num_layers}",
                    f"{m.num_layers} of {m.num_layers}"),
                   ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size, None),
                   ("--moe-router-score-function", m.moe_router_score_function, "softmax"),
                   ("--moe-router-pre-softmax", m.moe_router_pre_softmax, False)]
    else:
        wanted.append(("--num-experts", m.num_experts or None, None))
    return next((f"the checkpoint's model has {flag} {value}; a Hugging Face {arch} model needs {need}"
                 for flag, value, need in wanted if value != need), None)


def hf_config_from_model(m: C.ModelConfig, vocab_size: int, arch: Optional[str] = None) -> dict:
    """The Hugging Face config.json (a dict) of the meshlm model ``m`` with ``vocab_size`` rows.

    arch: "llama", "mistral", "mixtral", "qwen2", "qwen3" or "gpt2"; default mixtral for MoE models,
    qwen3 with --qk-layernorm, qwen2 with QKV-only biases, llama for other RoPE models, gpt2
    otherwise. Raises
    CheckpointError naming the flag that the architecture cannot express.
    """
    arch = _export_arch(m, arch)
    tied = not m.untie_embeddings_and_output_weights
    if arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
                "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
                "n_inner": C.ffn_hidden(m), "n_positions": C.max_positions(m),
                "layer_norm_epsilon": m.norm_epsilon, "activation_function": "gelu_new" if C.gelu_tanh(m) else "gelu",
                "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
                "initializer_range": m.init_method_std, "tie_word_embeddings": tied, "dtype": "float32"}
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out = {"architectures": [names[arch]],
           "model_type": arch, "vocab_size": vocab_size, "hidden_size": m.hidden_size,
           "intermediate_size": C.moe_ffn(m) if arch == "mixtral" else C.ffn_hidden(m),
           "num_hidden_layers": m.num_layers,
           "num_attention_heads": m.num_attention_heads, "num_key_value_heads": C.query_groups(m),
           "head_dim": C.head_dim(m), "hidden_act": "silu", "max_position_embeddings": C.max_positions(m),
           "rms_norm_eps": m.norm_epsilon, "rope_theta": m.rotary_base,
           "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
           "attention_dropout": m.attention_dropout, "initializer_range": m.init_method_std,
           "tie_word_embeddings": tied, "dtype": "float32"}
    if arch == "mixtral":
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk, router_jitter_noise=0.0)
    if arch in ("mistral", "mixtral"):
        out["sliding_window"] = None
    elif arch in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
        if arch == "qwen3":
            out["attention_bias"] = False
    else:
        out["attention_bias"] = out["mlp_bias"] = m.add_bias_linear
    return out


def hf_to_fine_tune(path: Optional[str]) -> bool:
    """True when --load ``path`` is a Hugging Face folder to fine-tune from (``is_hf_folder``) that
    holds no meshlm checkpoints of its own: a run given it as --save too saves there, and its
    restart resumes from those (as any --load = --save run) instead of starting over from the HF
    weights at iteration 0."""
    return is_hf_folder(path) and not os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt"))


def is_hf_folder(path: Optional[str]) -> bool:
    """True when ``path`` is a folder with a Hugging Face config.json (it has a ``model_type``)
    and safetensors weights (model.safetensors, a sharded index, or any *.safetensors)."""
    if not path or not os.path.isfile(os.path.join(path, CONFIG)):
        return False
    try:
        with open(os.path.join(path, CONFIG)) as fh:
            if "model_type" not in json.load(fh):
                return False
    except (OSError, ValueError, TypeError):
        return False
    return any(n.endswith(".safetensors") or n == INDEX for n in os.listdir(path))
