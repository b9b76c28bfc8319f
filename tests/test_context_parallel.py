"""Context parallelism trains what one process trains: the production step (tests/parity.py) at
CP = 2 and 4 with both --cp-comm-type values, GPT (learned positions) and Llama (RoPE, GQA), with
DP, TP + SP, PP, ZeRO-1 and packed documents, in float64 against one process at 1e-10; a CP rank
whose tokens are all masked; a CP = 2 checkpoint resumed at CP = 1; the validation rules."""

import re

import pytest

from parity import Case, assert_parity, config

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

LLAMA = dict(pos="rope", norm="RMSNorm", swiglu=True, groups=2, tied=False)


def test_cp2_gpt_and_llama_both_comm_types_match_single_process():
    assert_parity(Case(cp=2), Case(cp=2, cp_comm="all_gather", **LLAMA))


def test_cp4_both_comm_types_match_single_process():
    assert_parity(Case(cp=4, **LLAMA), Case(cp=4, cp_comm="all_gather"))


def test_dp2_cp2_equals_dp4_and_single_process():
    """The same global batch of 8: DP=2 × CP=2 (ZeRO-1, overlapped reduction) and DP=4."""
    assert_parity(Case(dp=2, cp=2, dist_opt=True, overlap_grad=True, **LLAMA), Case(dp=4, **LLAMA))


def test_cp2_with_tp2_sp_and_with_pp2_match_single_process():
    """And hidden dropout at CP 2 × TP 2 with SP: each rank's mask is one process's mask at the
    rows it holds (its SP share of its CP rank's two chunks; each CP rank drew the mask of its
    first s/CP positions before)."""
    assert_parity(Case(cp=2, tp=2, sp=True, **LLAMA), Case(cp=2, pp=2, cp_comm="all_gather", micro=2),
                  Case(cp=2, tp=2, sp=True, hidden_dropout=0.1))


def test_cp_rank_with_every_token_masked_and_packed_documents_match_single_process():
    """CP rank 0 holds positions 0, 1, 6, 7 of 8 (chunks 0 and 3): all masked in every sample, so
    its loss is 0 over the sequence's tokens, never 0/0. Packed documents: the document mask per
    block, positions reset per document, EOD loss masking; with and without per-token loss."""
    assert_parity(Case(cp=2, masked=(0, 1, 6, 7)), Case(cp=2, masked=(0, 1, 6, 7), per_token=True, **LLAMA),
                  Case(cp=2, packed=True, **LLAMA), Case(cp=2, packed=True, cp_comm="all_gather"))


def test_cp2_checkpoint_resumes_at_cp1(tmp_path):
    import test_checkpoint_reshard as reshard
    from distributed import run_distributed
    from parity import TOL, rel_err

    model = reshard.MODEL
    root = str(tmp_path)
    run_distributed(reshard._train, 2, Case(cp=2, **model), root, None, reshard.SAVED_AT, "saved")
    (resumed,) = run_distributed(reshard._train, 1, Case(**model), root, "saved",
                                 reshard.STEPS - reshard.SAVED_AT, None)
    (whole,) = run_distributed(reshard._train, 1, Case(**model), root, None, reshard.STEPS, None)
    assert resumed["iteration"] == whole["iteration"] == reshard.STEPS
    for a, b in zip(resumed["losses"], whole["losses"][reshard.SAVED_AT:]):
        assert abs(a - b) <= TOL * abs(b)
    for name, t in whole["params"].items():
        assert rel_err(resumed["params"][name], t) <= TOL, name


@pytest.mark.parametrize("change,words", [
    (dict(seq=12, cp=4), "--seq-length 12 is not divisible by 2 × --context-parallel-size 4"),
    (dict(seq=20, cp=2, tp=4, sp=True), "--seq-length 20 / --context-parallel-size 2 is not divisible by "
                                         "--tensor-model-parallel-size 4"),
    (dict(dropout=0.2, cp=2), "--attention-dropout 0.2: the context-parallel attention has no dropout"),
    (dict(dropout=0.1, cp=2), "--attention-dropout 0.1 (the default, as Megatron's): the context-parallel"),
])
def test_context_parallel_layout_rules(change, words):
    from meshlm.errors import ConfigError
    from meshlm.validate import validate

    cfg = config(Case())
    p, m = cfg.parallel, cfg.model
    p.context_parallel_size = change["cp"]
    p.tensor_model_parallel_size, p.sequence_parallel = change.get("tp", 1), change.get("sp", False)
    m.seq_length, m.attention_dropout = change.get("seq", m.seq_length), change.get("dropout", 0.0)
    with pytest.raises(ConfigError, match=re.escape(words)):
        validate(cfg, world=change["cp"] * change.get("tp", 1), check_files=False)
    m.seq_length, m.attention_dropout = 8 * change["cp"] * change.get("tp", 1), 0.0
    validate(cfg, world=change["cp"] * change.get("tp", 1), check_files=False)  # the fixed config passes
