"""Model FLOPs and the GPUs' peak: the arithmetic training/metrics.py (TFLOP/s/GPU, MFU) and the
planner (planner/cost.py, gpus.py, calibrate.py) share, from the model flags alone.

FLOPs per iteration (model FLOPs, the numerator of MFU) follow Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §5.1,
generalised to grouped-query attention and SwiGLU. Per token and layer, forward, counting a
multiply-add as 2 FLOPs (h hidden, a query heads, g key/value groups, d head dim, f MLP width,
s the *training* sequence length, V the padded vocabulary):

    QKV projection     2·h·d·(a + 2g)
    attention core     4·s·a·d          (Q·Kᵀ and softmax·V over the full s×s, as in the paper)
    output projection  2·a·d·h
    MLP                2·h·f·2  (GeLU: fc1, fc2)   or  2·h·f·3  (SwiGLU: gate, up, down)
    logits (once)      2·h·V
    MoE layer's MLP    2·h·(k·f_e + f_s)·(2 or 3) + 2·h·E   (k routed experts of width f_e, the
                       shared expert's f_s, the router over E experts: what one token computes)

    FLOPs/iteration = 3 · B · s · (L · per-layer + 2·h·V)     (backward = 2× forward)

With a = g, a·d = h and f = 4h this is the paper's 72·B·s·L·h²·(1 + s/6h + V/12Lh). Activation
recomputation is *not* counted (the paper's 96 variant counts it): MFU is model FLOPs over peak,
as defined in PaLM (Chowdhery et al. 2022, appendix B). Norms, softmax and element-wise ops are
ignored, as in Megatron.

MFU is reported only where the dense bf16/fp16 tensor-core peak of the device is known
(``PEAK_TFLOPS``); on CPU, on an unknown GPU or for an fp32 run it is None and printed "n/a".
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from .config import ModelConfig, ffn_hidden, head_dim, moe_ffn, moe_layer_pattern, query_groups

# Dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s, from NVIDIA's data sheets. Matched
# against the words of torch.cuda.get_device_name() (``device_words``) in order: the first entry
# whose words all occur wins, so "NVIDIA L40" is not an L4 and "H800 PCIe" not the SXM part.
PEAK_TFLOPS = [
    (("H200", "NVL"), 835.0),
    (("H200",), 989.4),
    (("GH200",), 989.4),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.4),            # SXM / HBM3
    (("H800", "PCIE"), 756.0),
    (("H800",), 989.4),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("A800",), 312.0),
    (("L40S",), 362.0),
    (("L40",), 181.0),
    (("L4",), 121.0),
    (("A10G",), 70.0),
    (("A10",), 125.0),
    (("V100",), 125.0),            # fp16 only
]


def peak_tflops(device_name: Optional[str], dtype: torch.dtype) -> Optional[float]:
    """Dense tensor-core peak TFLOP/s for bf16/fp16 on ``device_name``; None when not known.

    None for CPU (device_name None), for GPUs missing from PEAK_TFLOPS and for fp32 training
    (its peak depends on TF32 settings we do not control), so MFU is never a made-up number.
    """
    if device_name is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    words = device_words(device_name)
    for needles, tflops in PEAK_TFLOPS:
        if all(n in words for n in needles):
            return tflops
    return None


def device_words(device_name: str) -> set:
    """The upper-cased words of a device name, split at anything not a letter or digit:
    "NVIDIA A100-SXM4-80GB" → {"NVIDIA", "A100", "SXM4", "80GB"} (so "L4" is not in "NVIDIA L40")."""
    return set(re.split(r"[^A-Z0-9]+", device_name.upper())) - {""}


def mlp_flops_per_token(m: ModelConfig, moe: bool) -> float:
    """Forward FLOPs one token spends in one layer's MLP (module doc): the dense MLP, or (moe) the
    k routed experts it is sent to, the shared expert and the router."""
    h, mats = m.hidden_size, 3 if m.swiglu else 2
    if not moe:
        return 2 * h * ffn_hidden(m) * mats
    return 2 * h * (m.moe_router_topk * moe_ffn(m) + (m.moe_shared_expert_intermediate_size or 0)) * mats \
        + 2 * h * m.num_experts


def flops_per_iteration(m: ModelConfig, global_batch: int, padded_vocab: int) -> float:
    """Model FLOPs of one training iteration (forward + backward), formula in the module doc."""
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    a, g, d = m.num_attention_heads, query_groups(m), head_dim(m)
    attention = 2 * h * d * (a + 2 * g) + 4 * s * a * d + 2 * a * d * h
    mlps = sum(mlp_flops_per_token(m, moe) for moe in moe_layer_pattern(m))
    return 3.0 * global_batch * s * (L * attention + mlps + 2 * h * padded_vocab)
