"""A learning rate and global batch for the run's compute budget, from a published scaling law.

DeepSeek LLM (DeepSeek-AI 2024, arXiv:2401.02954) §3.1, Eq. (1), fitted on small runs with
compute budgets C from 1e17 to 2e19 FLOPs (their Figure 3):

    eta_opt = 0.3118 · C^(−0.1250)        B_opt = 0.2920 · C^(0.3271)   (B in tokens)

with C = M · D, D the training tokens and M the non-embedding FLOPs per token of §3.2, Eq. (2):
M = 72 · n_layer · d_model² + 6 · n_layer · d_model · l_seq. The 72·L·h² term is 6 × the 12·h²
weights of a layer with a 4h GeLU MLP; here it is 6 × the layer's real matrix weights (QKV with
GQA, attention output, the MLP or, for MoE, the top-k experts and the shared one), which is
DeepSeek's M for their shape and the same count for others. The fit was made with AdamW and their
multi-step schedule on their data; a budget outside [1e17, 2e19] is an extrapolation, and
``recommend`` says so. The global batch is B_opt in sequences rounded to the nearest multiple of
micro-batch × DP of the flags' layout (at least one such multiple), so the recommended
--global-batch-size is one the layout can run (Megatron requires a multiple of micro-batch × DP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import dp_size, ffn_hidden, head_dim, moe_ffn, query_groups, run_samples

SOURCE = "DeepSeek LLM (arXiv:2401.02954) §3.1 Eq. (1)"
FITTED = (1e17, 2e19)  # FLOPs: the compute budgets of the fit


@dataclass(frozen=True)
class Recommendation:
    """compute: C in FLOPs; lr: eta_opt; batch_tokens: B_opt in tokens; global_batch: B_opt in
    sequences of --seq-length rounded to a multiple of ``step`` = micro-batch × DP (at least one
    step); inside: C within the fitted range."""

    compute: float
    lr: float
    batch_tokens: float
    global_batch: int
    inside: bool
    step: int = 1

    def line(self) -> str:
        """One line for `meshlm plan`: the values, the formula, the fitted range, the source."""
        where = "inside" if self.inside else "OUTSIDE (an extrapolation)"
        return (f"hyperparameters: --lr {self.lr:.3g} --global-batch-size {self.global_batch} "
                f"({self.batch_tokens:,.0f} tokens, rounded to a multiple of micro-batch × DP = {self.step}) for C = {self.compute:.3g} FLOPs; eta = 0.3118·C^-0.1250, "
                f"B = 0.2920·C^0.3271 tokens, fitted for C in [{FITTED[0]:.0e}, {FITTED[1]:.0e}] ({where}), "
                f"{SOURCE}")

    def to_json(self) -> dict:
        return {"compute_flops": self.compute, "lr": self.lr, "batch_tokens": self.batch_tokens,
                "global_batch_size": self.global_batch, "global_batch_multiple_of": self.step, "inside_fitted_range": self.inside,
                "fitted_range_flops": list(FITTED), "source": SOURCE}


def flops_per_token(m) -> float:
    """M: non-embedding training FLOPs per token, 6 × layer matrix weights + 6·h·s per layer."""
    h, d = m.hidden_size, head_dim(m)
    attention = h * (m.num_attention_heads + 2 * query_groups(m)) * d + m.num_attention_heads * d * h
    width = (moe_ffn(m) * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0)) if m.num_experts \
        else ffn_hidden(m)
    mlp = h * width * (3 if m.swiglu else 2)
    return m.num_layers * (6 * (attention + mlp) + 6 * h * m.seq_length)


def recommend(cfg, world: int, tokens: Optional[float] = None) -> Recommendation:
    """The recommendation for the run's model and token budget (``tokens``: plan's --train-tokens,
    else --train-iters or --train-samples × --seq-length) on ``world`` GPUs; its global batch a
    multiple of the flags' micro-batch × DP."""
    tokens = tokens if tokens is not None else run_samples(cfg, world) * cfg.model.seq_length
    c = flops_per_token(cfg.model) * tokens
    batch = 0.2920 * c ** 0.3271
    step = cfg.training.micro_batch_size * max(1, dp_size(cfg, world))
    sequences = max(1, round(batch / cfg.model.seq_length / step)) * step
    return Recommendation(c, 0.3118 * c ** -0.1250, batch, sequences, FITTED[0] <= c <= FITTED[1], step)
