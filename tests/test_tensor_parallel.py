"""Tensor (and sequence) parallelism computes the same function as one process (issue 3).

Every worker trains the single-process model and the TP model from the same seed for 3 AdamW
steps on the same batches, then compares each step's loss and every updated weight (the TP
shards gathered back to full TP=1 weights) within 1e-5 relative, fp32 on CPU.
"""

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from meshlm.config import ModelConfig
from meshlm.parallel import comm
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.cross_entropy import vocab_parallel_cross_entropy
from meshlm.parallel.tensor import gather_full_state_dict
from meshlm.model.transformer import GPTModel

SEED, STEPS, BATCH, SEQ = 7, 3, 2, 16

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
           hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=48,
             group_query_attention=True, num_query_groups=2)


def _batches(vocab, dp_size=1):
    """One batch (BATCH samples per DP rank), repeated every step so the loss must fall."""
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, vocab, (BATCH * dp_size, SEQ + 1), generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _train(model, ps, batches, dp_rank=0, sp=False):
    """3 AdamW steps; returns the losses. SP-replicated grads summed over TP, DP grads averaged.

    eps=1e-6: the key bias has an exactly zero gradient (softmax is shift-invariant), so its
    computed grad is rounding noise that Adam with a tiny eps would blow up to ±lr in any layout.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    losses, norm_grads_equal = [], []
    for tokens, labels in batches:
        if ps.dp > 1:
            tokens, labels = tokens.chunk(ps.dp)[dp_rank], labels.chunk(ps.dp)[dp_rank]
        loss = model(tokens, labels).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=ps.tp_group)
            if ps.dp > 1:
                dist.all_reduce(p.grad, group=ps.dp_group)
                p.grad /= ps.dp
        if sp:
            norm_grads_equal.append(_same_on_tp_ranks(model.layers["0"].input_layernorm.weight.grad, ps))
        opt.step()
        loss = loss.detach()
        if ps.dp > 1:
            dist.all_reduce(loss, group=ps.dp_group)
            loss /= ps.dp
        losses.append(loss.item())
    return losses, norm_grads_equal


def _same_on_tp_ranks(t, ps):
    parts = [torch.empty_like(t) for _ in range(ps.tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
    return all(torch.equal(parts[0], q) for q in parts)


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _parity_worker(rank, world, model_kw, vocab, tp, sp):
    """Train TP (× DP) and, on rank 0, the single-process reference; compare there."""
    cfg = ModelConfig(**model_kw)
    batches = _batches(vocab, world // tp)
    ps = ParallelState.build(tp=tp)
    model = GPTModel(cfg, ps, vocab, seed=SEED, sequence_parallel=sp)
    losses, norm_grads_equal = _train(model, ps, batches, ps.dp_rank, sp)
    full = gather_full_state_dict(model, ps)
    out = {"losses": losses, "norm_grads_equal": norm_grads_equal, "model": model_state(model)}
    if rank == 0:
        ref_losses, ref_full = _reference(cfg, vocab, batches)
        assert full.keys() == ref_full.keys()
        out.update(ref_losses=ref_losses, errors={n: _rel_err(full[n], ref_full[n]) for n in ref_full})
    return out


def _reference(cfg, vocab, batches):
    """The single-process run: losses and full weights after the steps."""
    single = ParallelState.single()
    ref = GPTModel(cfg, single, vocab, seed=SEED)
    ref_losses, _ = _train(ref, single, batches)
    return ref_losses, gather_full_state_dict(ref, single)


def model_state(model):
    """What the vocabulary tests inspect: the output weight's padding rows and the raw logits."""
    w = model.output_weight().detach()
    pad = model.padded_logits
    model.eval()
    logits = model(torch.arange(SEQ).unsqueeze(0) % model.vocab_size)
    return {"padding_rows": w[pad].clone(), "padded_logits": logits[..., pad].clone()}


def _check_parity(results):
    ref_losses = results[0]["ref_losses"]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
    bad = {n: e for n, e in results[0]["errors"].items() if e > 1e-5}
    assert not bad, f"weights differ from the single-process run: {bad}"
    assert ref_losses[-1] < ref_losses[0]  # the steps did train


def test_gpt_tp2_matches_single_process():
    _check_parity(run_distributed(_parity_worker, 2, GPT, 100, 2, False))


def test_gpt_tp4_matches_single_process():
    _check_parity(run_distributed(_parity_worker, 4, GPT, 100, 4, False))


def test_llama_tp2_matches_single_process():
    """RoPE, RMSNorm, SwiGLU, untied output, GQA with 2 groups ≥ TP (each rank owns one group)."""
    _check_parity(run_distributed(_parity_worker, 2, LLAMA, 100, 2, False))


def test_llama_tp4_with_two_query_groups_matches_single_process():
    """2 query groups < TP=4: two ranks read each key/value group."""
    _check_parity(run_distributed(_parity_worker, 4, LLAMA, 100, 4, False))


def test_sequence_parallel_tp2_matches_single_process():
    results = run_distributed(_parity_worker, 2, GPT, 100, 2, True)
    _check_parity(results)
    for r in results:  # after the TP all-reduce of SP grads, every rank steps the same norm weights
        assert r["norm_grads_equal"] == [True] * STEPS


def test_llama_sequence_parallel_tp2_matches_single_process():
    _check_parity(run_distributed(_parity_worker, 2, LLAMA, 100, 2, True))


def test_vocab_not_divisible_by_tp_pads_and_never_predicts_padding():
    """517 tokens, --make-vocab-size-divisible-by 1, TP=2: 518 rows, the last one padding."""
    kw = dict(GPT, make_vocab_size_divisible_by=1)
    results = run_distributed(_parity_worker, 2, kw, 517, 2, False)
    _check_parity(results)
    pad = results[1]["model"]
    assert pad["padding_rows"].shape == (1, 32)
    assert torch.equal(pad["padding_rows"], torch.zeros(1, 32))  # never received a gradient
    assert torch.isneginf(pad["padded_logits"]).all()
    assert results[0]["model"]["padding_rows"].numel() == 0


def test_dropout_tp2_reproduces_single_process_masks():
    kw = dict(GPT, hidden_dropout=0.2, attention_dropout=0.2)
    results = run_distributed(_parity_worker, 2, kw, 100, 2, True)
    _check_parity(results)
    without, _ = _reference(ModelConfig(**GPT), 100, _batches(100))
    for with_dropout, plain in zip(results[0]["ref_losses"], without):  # dropout really is on
        assert with_dropout != pytest.approx(plain, rel=1e-5)


def test_tp2_dp2_matches_single_process():
    _check_parity(run_distributed(_parity_worker, 4, GPT, 100, 2, False))


# ----------------------------------------------------------------------------- communication volume

def _layer_comm_worker(rank, world, sp):
    cfg = ModelConfig(**dict(GPT, num_layers=1))
    ps = ParallelState.build(tp=world)
    layer = GPTModel(cfg, ps, 100, seed=SEED, pre_process=False, post_process=False, sequence_parallel=sp)
    rows = SEQ // world if sp else SEQ
    x = torch.randn(rows, BATCH, cfg.hidden_size, requires_grad=True)
    comm.reset_stats()
    layer(None, hidden_states=x).sum().backward()
    return comm.snapshot_stats()


def test_layer_communication_matches_korthikanti_count():
    """Korthikanti et al. 2022 §4: per layer, TP moves 2 all-reduces of s·b·h forward and 2 backward;
    SP replaces each by an all-gather plus a reduce-scatter of the same ring volume."""
    tp, h, elem = 2, GPT["hidden_size"], 4
    sbh = SEQ * BATCH * h * elem  # bytes of one [s, b, h] fp32 activation
    tp_stats = run_distributed(_layer_comm_worker, tp, False)[0]
    assert tp_stats.keys() == {"all_reduce"}
    assert tp_stats["all_reduce"]["calls"] == 4
    assert tp_stats["all_reduce"]["bytes"] == 4 * sbh

    sp_stats = run_distributed(_layer_comm_worker, tp, True)[0]
    assert sp_stats.keys() == {"all_gather", "reduce_scatter"}
    assert sp_stats["all_gather"] == {"calls": 4, "bytes": 4 * sbh // tp, "ring_bytes": 4 * sbh / tp * (tp - 1)}
    assert sp_stats["reduce_scatter"]["calls"] == 4
    assert sp_stats["reduce_scatter"]["bytes"] == 4 * sbh
    sp_ring = sp_stats["all_gather"]["ring_bytes"] + sp_stats["reduce_scatter"]["ring_bytes"]
    assert sp_ring == pytest.approx(tp_stats["all_reduce"]["ring_bytes"])


# ----------------------------------------------------------------------------- cross-entropy

def _cross_entropy_worker(rank, world):
    """Vocabulary 10 padded to 12 over TP=2: loss and grad equal F.cross_entropy on the full logits."""
    ps = ParallelState.build(tp=world)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 10, generator=g, dtype=torch.float64)
    target = torch.randint(0, 10, (3, 2), generator=g)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), reduction="none")
    padded = torch.cat([logits, torch.full((3, 2, 2), float("-inf"), dtype=torch.float64)], dim=-1)
    local = padded.chunk(world, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, 6 * rank, ps.tp_group)
    weights = torch.arange(6, dtype=torch.float64).view(3, 2)
    (loss * weights).sum().backward()
    full = logits.clone().requires_grad_(True)
    (torch.nn.functional.cross_entropy(full.reshape(-1, 10), target.reshape(-1), reduction="none")
     * weights.reshape(-1)).sum().backward()
    expected_grad = torch.cat([full.grad, torch.zeros(3, 2, 2, dtype=torch.float64)], -1).chunk(world, -1)[rank]
    return (torch.allclose(loss.float(), expected.view(3, 2).float(), rtol=1e-6),
            torch.allclose(local.grad, expected_grad, rtol=1e-6, atol=1e-12))


def test_vocab_parallel_cross_entropy_matches_full_softmax():
    assert run_distributed(_cross_entropy_worker, 2) == [(True, True), (True, True)]
