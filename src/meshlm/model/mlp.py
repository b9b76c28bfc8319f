"""The feed-forward block, split over TP: column-parallel fc1, row-parallel fc2.

GeLU (GPT): fc1 [ffn, h] → gelu → fc2 [h, ffn]; the tanh approximation of Hendrycks & Gimpel 2016
§2 (OpenAI's GPT-2, Megatron's openai_gelu and its default fused bias-GeLU, HF's gelu_new) under
--openai-gelu or with biases (config.gelu_tanh), else exact (erf) GeLU (--no-bias-gelu-fusion).
SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"; LLaMA): the full fc1 weight is
[gate (ffn); up (ffn)] rows; rank r holds gate rows and up rows [r·ffn/tp, (r+1)·ffn/tp), so
silu(gate) · up is computed locally on matching halves. Checkpoints store gate and up as two
logical tensors (checkpoint/model_space.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ffn_hidden, gelu_tanh
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, contiguous_index


class MLP(nn.Module):
    """x [s, b, h] ([s/tp, b, h] under SP) → same shape; hidden [s, b, ffn/tp] on each rank."""

    def __init__(self, cfg, ps, init, scaled_init, *, sequence_parallel: bool, params_dtype):
        super().__init__()
        ffn, tp = ffn_hidden(cfg), ps.tp  # ffn % tp == 0: checked by meshlm.validate
        self.swiglu = cfg.swiglu
        self.gelu_approximate = "tanh" if gelu_tanh(cfg) else "none"
        rows = contiguous_index(ffn, tp, ps.tp_rank)
        if self.swiglu:
            rows = torch.cat([rows, rows + ffn])
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, len(rows) * tp, ps, init("mlp.linear_fc1.weight"), bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel, rows=rows, params_dtype=params_dtype,
            parts=(("linear_fc1_gate", ffn), ("linear_fc1_up", ffn)) if self.swiglu else None)
        self.linear_fc2 = RowParallelLinear(
            ffn, cfg.hidden_size, ps, scaled_init("mlp.linear_fc2.weight"), bias=cfg.add_bias_linear,
            sequence_parallel=sequence_parallel, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.linear_fc2(y)
