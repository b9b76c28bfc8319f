"""Every layout computes the function of one process: the production training step (trainer.build
and trainer.train_step) of each pairwise combination of the step-changing flags (tests/matrix.py),
trained in float64 over gloo, against the single-process run at 1e-10 relative (tests/parity.py).
Each ZeRO stage (--data-parallel-sharding-strategy) meets every other factor; with
--overlap-param-gather (ZeRO-1's gather after the step, ZeRO-3's per-block prefetch) every pending
parameter all-gather reads NaN until waited for."""

import itertools

import pytest

from matrix import MAX_WORLD, pairwise_cases
from parity import Case, assert_parity, config

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

CASES, IMPOSSIBLE = pairwise_cases()
BATCH = 10  # most cases per set of processes: starting 8 workers costs as much as training 2–4 cases


def _batches(cases: list) -> list:
    """The cases of each world size in the fewest sets of at most BATCH, of nearly equal sizes."""
    out = []
    for _, group in itertools.groupby(sorted(cases, key=lambda c: c.world), key=lambda c: c.world):
        group = list(group)
        n = -(-len(group) // BATCH)
        out += [group[i::n] for i in range(n)]
    return out


BATCHES = _batches(CASES)


def test_only_pairs_no_layout_allows_are_left_out_and_meshlm_accepts_every_case():
    """Every pair of levels is covered but these; none involves CP or MoE: CP 2 fits beside TP 4,
    PP 4 or DP 4 within 8 ranks, MoE at TP > 1 takes SP, and EP 2 finds an even DP × CP beside
    any other level (CP 2 where DP is 1)."""
    deep = {("pipeline", "pp3-first-1"), ("pipeline", "pp4")}
    assert IMPOSSIBLE == {
        (("tp", 1), ("sp", True)),                       # SP needs TP > 1
        (("zero", 0), ("overlap_param", True)),          # the param gather is ZeRO-1/3's
        *((("tp", 4), p) for p in deep),                 # TP 4 × PP ≥ 3 > MAX_WORLD
        (("tp", 4), ("dp", 4)),
        *((p, ("dp", 4)) for p in deep),
    }
    assert len(CASES) <= 35 and all(c.world <= MAX_WORLD for c in CASES)
    for case in CASES:
        config(case)  # meshlm's own validation accepts the layout (raises ConfigError if not)


@pytest.mark.parametrize("cases", BATCHES, ids=[f"world{b[0].world}-{i}" for i, b in enumerate(BATCHES)])
def test_pairwise_layouts_match_single_process_in_float64(cases):
    assert_parity(*cases)


def test_compiled_fast_path_matches_single_process_in_float64():
    """--fast-path on (the CUDA default; here compiled on CPU): compiled layers and loss, fused AdamW
    with clipping; ZeRO-3's per-block gathers, prefetches and frees at the compiled layers'
    boundaries; ZeRO-1 with FP8 GEMMs (emulated: the compiled layers trace the scaling and the
    quantize → dequantize; the reference is an eager one-process FP8 run), its gathers waited at
    those boundaries too. One process start for both."""
    llama = dict(tied=False, pos="rope", norm="RMSNorm", swiglu=True, fast="on")
    assert_parity(Case(dp=2, dist_opt=True, overlap_grad=True, overlap_param=True, fp8="e4m3", **llama),
                  Case(dp=2, zero=3, overlap_grad=True, overlap_param=True, **llama))


def test_partial_rotary_zero_centred_and_qk_norms_with_tp_match_single_process_in_float64():
    """--rotary-percent 0.5 (head dim 4: the first 2 dimensions rotated) under TP=2 with SP, with
    per-document positions (--reset-position-ids): the RoPE tables' other path. And
    --apply-layernorm-1p (norm weights from 0, scaling by 1 + w) under TP=2 with SP, whose norms'
    gradients are all-reduced over TP, for both norms. And --qk-layernorm, each TP rank normalising
    its own heads (the q/k norms' gradients summed over TP in autograd): RMSNorm with Qwen2's QKV-only
    biases under SP, and LayerNorm with one key/value group gathered by both TP ranks."""
    assert_parity(Case(tp=2, sp=True, pos="rope", rotary=0.5, packed=True),
                  Case(tp=2, sp=True, one_p=True, norm="RMSNorm"), Case(tp=2, sp=True, one_p=True),
                  Case(tp=2, sp=True, qk_norm=True, qkv_bias=True, pos="rope", norm="RMSNorm"),
                  Case(tp=2, groups=1, qk_norm=True, pos="rope"))
