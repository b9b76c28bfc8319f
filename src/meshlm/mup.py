"""μP, the Maximal Update Parametrization (Yang et al. 2022, "Tensor Programs V", arXiv:2203.03466),
under Megatron-Core's flag names and semantics (``--use-mup`` and the ``--mup-*`` flags).

The rule followed is Table 8 of the paper (μP for Adam in its equivalent "output multiplier" form,
the one its `mup` package and Megatron-Core implement; Table 3 is the same μP with the output
weights' init and LR rescaled instead), written relative to a base model (§4): with width
multiplier m = hidden_size / --mup-base-hidden-size,

=================  ===================  ==================  ====================
weights            init std             forward multiplier  Adam learning rate
=================  ===================  ==================  ====================
input (embedding)  std                  --mup-embedding-mult lr
hidden matrices    std / √m             1                   lr / m
output (logits)    std (tied or not)    --mup-output-mult    lr
biases, norms      0 and 1              1                   lr
=================  ===================  ==================  ====================

Hidden matrices are the QKV, attention-output and both MLP weights (both of whose dims grow with
the width); the output multiplier defaults to 1/m (Megatron: a --mup-output-mult left at 1.0 is
set to 1/m), and attention logits use softmax_scale = √(--mup-base-head-dim) / d^power (d the head
dim, power --mup-attn-scale-power, 1: the paper's 1/d attention, §4; without a base head dim the
numerator is 1, as in Megatron). So at m = 1 with --mup-base-head-dim = d, μP is the standard
model: every rescaling is 1. Everything here is arithmetic on the flags (derived values, never
stored twice); the model and optimizer apply them.
"""

from __future__ import annotations

import math

from .config import head_dim


def width_mult(m) -> float:
    """hidden_size / --mup-base-hidden-size (the base defaults to hidden_size); 1.0 without μP."""
    if not m.use_mup:
        return 1.0
    return m.hidden_size / (m.mup_base_hidden_size or m.hidden_size)


def output_mult(m) -> float:
    """The multiplier of the logits: --mup-output-mult, or 1/m when it is left at 1.0 (Megatron)."""
    if not m.use_mup:
        return 1.0
    return 1.0 / width_mult(m) if m.mup_output_mult == 1.0 else m.mup_output_mult


def embedding_mult(m) -> float:
    """The multiplier of the embedding's output (words + positions): --mup-embedding-mult."""
    return m.mup_embedding_mult if m.use_mup else 1.0


def softmax_scale(m) -> float:
    """The attention logits' scale: 1/√d without μP; √(base head dim) / d^power under μP."""
    d = head_dim(m)
    if not m.use_mup:
        return 1.0 / math.sqrt(d)
    base = 1.0 if m.mup_base_head_dim is None else math.sqrt(m.mup_base_head_dim)
    return base / d ** m.mup_attn_scale_power


def query_scale(m) -> float:
    """The factor on q that turns SDPA's default 1/√d into ``softmax_scale`` (1.0 without μP)."""
    return 1.0 if not m.use_mup else softmax_scale(m) * math.sqrt(head_dim(m))


def hidden_init_std(m) -> float:
    """The init std of the hidden matrices: --init-method-std / √m (variance ∝ 1/fan_in)."""
    return m.init_method_std / math.sqrt(width_mult(m))


def hidden_lr_mult(m) -> float:
    """The factor on Adam's LR for the hidden matrices: 1/m."""
    return 1.0 / width_mult(m)

