"""Norm: LayerNorm or RMSNorm over the last dim, for the layers' and final norms and for the
per-head query/key norms of --qk-layernorm."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from ..parallel.tensor import new_param


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight; Zhang & Sennrich 2019) over the last dim of x
    [..., size] (size: default --hidden-size).

    Replicated over TP; under sequence parallelism each rank sees s/tp rows, so its parameters
    carry ``sequence_parallel = True`` (grads all-reduced over TP by the DDP wrapper). tp_group: the
    norm sees only this TP rank's part of the features it normalises (--qk-layernorm: its heads), so
    its weight's gradient is a partial sum; the forward reads the weight through ``comm.copy_to_tp``,
    whose backward sums it over the group (Megatron all-reduces the q/k norms' gradients over TP
    in finalize_model_grads). Under --apply-layernorm-1p the weight is zero-centred: it starts at 0
    and the norm scales by 1 + w (Megatron-LM's; the checkpoint holds w, as Megatron's does).
    """

    def __init__(self, cfg, sequence_parallel: bool, params_dtype, device, size: Optional[int] = None,
                 tp_group=None):
        super().__init__()
        self.rms, self.eps, self.one_p = cfg.normalization == "RMSNorm", cfg.norm_epsilon, cfg.apply_layernorm_1p
        self.tp_group = tp_group if comm.group_size(tp_group) > 1 else None
        start, h = torch.zeros if self.one_p else torch.ones, size or cfg.hidden_size
        self.weight = new_param(lambda: start(h, dtype=params_dtype, device=device), (h,), params_dtype, device)
        self.bias = None if self.rms else new_param(lambda: torch.zeros(h, dtype=params_dtype, device=device), (h,),
                                                    params_dtype, device)
        for p in self.parameters():
            p.no_weight_decay, p.sequence_parallel = True, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.tp_group is not None:
            weight = comm.copy_to_tp(weight, self.tp_group)
            bias = None if bias is None else comm.copy_to_tp(bias, self.tp_group)
        if self.one_p:
            weight = weight + 1
        if not self.rms:
            return F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)
        return F.rms_norm(x, x.shape[-1:], weight, self.eps)  # fp32 statistics for bf16/fp16
