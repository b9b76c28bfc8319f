"""RoPE, full and partial (--rotary-percent): model/attention.py's Rotary against an independent
complex-number computation, megatron-core's RotaryEmbedding + rotary application, and
transformers' GPT-NeoX partial rotary (the same convention). TP parity of a partial-rotary model:
tests/test_parity_matrix.py."""

import math
import warnings

import pytest
import torch

from meshlm.config import Config, ModelConfig, rotary_dim
from meshlm.errors import ConfigError
from meshlm.model.attention import Rotary
from meshlm.validate import validate

F64 = torch.float64
S, B, N = 8, 2, 3

# (head dim, --rotary-percent): full, a quarter, a percent that truncates (16 × 0.3 = 4.8 → 4) and
# one whose rotary dim is odd (16 × 0.3125 = 5: frequencies over 5, 6 dimensions rotated)
CASES = [(16, 1.0), (16, 0.25), (16, 0.3), (16, 0.3125), (12, 0.5)]


def _dim(d, pct):
    return rotary_dim(ModelConfig(hidden_size=d, num_attention_heads=1, rotary_percent=pct))


def _reference(x, base, dim, positions):
    """x [s, b, n, d] at positions [b, s]: pairs (j, j + r/2), j < r/2 = ceil(dim/2), rotated as the
    complex number x_j + i·x_{j+r/2} times e^{i·p·base^(−2j/dim)}; the other dimensions kept."""
    half = math.ceil(dim / 2)
    out = x.clone()
    for j in range(half):
        theta = positions.t().to(F64)[:, :, None] * base ** (-2 * j / dim)  # [s, b, 1]
        z = torch.complex(x[..., j], x[..., j + half]) * torch.polar(torch.ones_like(theta), theta)
        out[..., j], out[..., j + half] = z.real, z.imag
    return out


@pytest.mark.parametrize("d,pct", CASES)
def test_rotary_matches_an_independent_complex_rotation(d, pct):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, N, d, generator=g, dtype=F64)
    rope = Rotary(d, 500.0, 2 * S, F64, "cpu", _dim(d, pct))
    default = torch.arange(S).expand(B, S)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 0, 1, 2]])  # --reset-position-ids
    for positions, got in ((default, rope(x)), (packed, rope(x, packed))):
        want = _reference(x, 500.0, _dim(d, pct), positions)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    rotated = 2 * math.ceil(_dim(d, pct) / 2)
    assert torch.equal(rope(x)[..., rotated:], x[..., rotated:])  # passed through exactly
    assert not torch.allclose(rope(x)[1:, ..., :rotated], x[1:, ..., :rotated])


@pytest.mark.parametrize("d,pct", CASES)
def test_rotary_matches_megatron_core(d, pct):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Transformer Engine / Apex here
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    mc = RotaryEmbedding(kv_channels=d, rotary_percent=pct, rotary_base=500, use_cpu_initialization=True)
    freqs = mc.get_freqs_non_repeated(S)  # get_emb would move to CUDA; this is its table before the cat
    emb = torch.cat([freqs, freqs], -1)[:, None, None, :]
    x = torch.randn(S, B, N, d, generator=torch.Generator().manual_seed(1))
    want = _apply_rotary_pos_emb_bshd(x, emb)
    got = Rotary(d, 500.0, S, torch.float32, "cpu", _dim(d, pct))(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # megatron-core's frequencies are fp32


def test_partial_rotary_matches_transformers_gpt_neox():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb
    hf = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=500.0)
    q = torch.randn(B, 4, S, 16, dtype=F64, generator=torch.Generator().manual_seed(2))  # [b, n, s, d]
    cos, sin = GPTNeoXRotaryEmbedding(hf)(q, torch.arange(S).expand(B, S))
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = Rotary(16, 500.0, S, F64, "cpu", _dim(16, 0.25))(q.permute(2, 0, 1, 3)).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # transformers' frequencies are fp32


def _problems(**model) -> list:
    cfg = Config()
    cfg.model = ModelConfig(hidden_size=64, num_attention_heads=4, position_embedding_type="rope", **model)
    try:
        validate(cfg, world=1, check_files=False)
    except ConfigError as e:
        return e.problems
    return []


def test_rotary_percent_outside_its_range_is_refused_naming_the_flag():
    assert _problems(rotary_percent=0.25) == []
    assert _problems(rotary_percent=1.5) == ["--rotary-percent 1.5 is above 1; give the fraction of each "
                                             "head's dimensions to rotate, in (0, 1]"]
    assert _problems(rotary_percent=0.05) == ["--rotary-percent 0.05 × head dim 16 rotates no dimension; "
                                              "give at least 0.0625"]
    assert _problems(rotary_percent=0.0) == ["--rotary-percent 0.0 is out of range: give a number > 0"]
