"""Tensor (and sequence) parallelism: vocabulary padding, dropout streams, communication volume
and the vocab-parallel cross-entropy. Training parity of every TP/SP layout against one process
is tests/test_parity_matrix.py."""

import pytest
import torch

from distributed import run_distributed
from meshlm.config import ModelConfig
from meshlm.parallel import comm
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.cross_entropy import vocab_parallel_cross_entropy
from meshlm.model.transformer import GPTModel

SEED, BATCH, SEQ = 7, 2, 16

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
           hidden_dropout=0.0, attention_dropout=0.0)


def _tokens(vocab, n=BATCH):
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _padding_worker(rank, world):
    """517 tokens, --make-vocab-size-divisible-by 1, TP=2: 518 rows, the last (rank 1's) padding."""
    cfg = ModelConfig(**GPT, make_vocab_size_divisible_by=1)
    ps = ParallelState.build(tp=world)
    model = GPTModel(cfg, ps, 517, seed=SEED, params_dtype=torch.float64)
    tokens, labels = _tokens(517)
    model(tokens, labels).sum().backward()
    w, pad = model.output_weight(), model.output_layer.padded_logits
    model.eval()
    logits = model(tokens)
    return {"rows": w[pad].detach().clone(), "grad": w.grad[pad].clone(), "logits": logits[..., pad].detach()}


def test_vocab_not_divisible_by_tp_pads_and_never_predicts_padding():
    first, second = run_distributed(_padding_worker, 2)
    assert first["rows"].numel() == 0
    assert torch.equal(second["rows"], torch.zeros(1, 32, dtype=torch.float64))
    assert torch.equal(second["grad"], torch.zeros(1, 32, dtype=torch.float64))  # never gets a gradient
    assert torch.isneginf(second["logits"]).all()


def _dropout_worker(rank, world, dropout):
    """Per-token losses of one training-mode forward at TP=world, and at TP=1 on every rank."""
    cfg = ModelConfig(**dict(GPT, hidden_dropout=dropout, attention_dropout=dropout))
    tokens, labels = _tokens(100)
    out = []
    for ps in (ParallelState.build(tp=world), ParallelState.single()):
        model = GPTModel(cfg, ps, 100, seed=SEED, sequence_parallel=ps.tp > 1, params_dtype=torch.float64)
        out.append(model(tokens, labels).detach())
    return out


def test_dropout_tp2_reproduces_single_process_masks():
    for tp2, single in run_distributed(_dropout_worker, 2, 0.2):
        assert float((tp2 - single).norm() / single.norm()) < 1e-12
    plain, _ = run_distributed(_dropout_worker, 2, 0.0)[0]
    assert float((plain - single).norm() / single.norm()) > 1e-3  # dropout really is on


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
    # + 2 all-gathers in backward: QKV and FC1 save only their s/tp input shard and re-gather it (§4.2.2)
    assert sp_stats["all_gather"] == {"calls": 6, "bytes": 6 * sbh // tp, "ring_bytes": 6 * sbh / tp * (tp - 1)}
    assert sp_stats["reduce_scatter"]["calls"] == 4
    assert sp_stats["reduce_scatter"]["bytes"] == 4 * sbh
    sp_ring = sp_stats["all_gather"]["ring_bytes"] + sp_stats["reduce_scatter"]["ring_bytes"]
    assert sp_ring == pytest.approx(1.25 * tp_stats["all_reduce"]["ring_bytes"])


def _saved_shapes_worker(rank, world):
    cfg = ModelConfig(**dict(GPT, num_layers=1))
    ps = ParallelState.build(tp=world)
    layer = GPTModel(cfg, ps, 100, seed=SEED, pre_process=False, post_process=False, sequence_parallel=True)
    x = torch.randn(SEQ // world, BATCH, cfg.hidden_size, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(None, hidden_states=x)
    y.sum().backward()
    return shapes


def test_sequence_parallel_saves_only_the_shard_of_the_column_parallel_inputs():
    """Korthikanti et al. 2022 §4.2.2: no [s, b, h] activation is kept, only [s/tp, b, h] shards."""
    for shapes in run_distributed(_saved_shapes_worker, 2):
        assert (SEQ // 2, BATCH, GPT["hidden_size"]) in shapes
        assert (SEQ, BATCH, GPT["hidden_size"]) not in shapes


# ----------------------------------------------------------------------------- cross-entropy

def _cross_entropy_worker(rank, world):
    """Vocabulary 10 padded to 12 over TP=2: loss and grad equal F.cross_entropy on the full logits,
    whatever values the padded columns hold (large ones here: they must be ignored, not masked)."""
    ps = ParallelState.build(tp=world)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 10, generator=g, dtype=torch.float64)
    target = torch.randint(0, 10, (3, 2), generator=g)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), reduction="none")
    padded = torch.cat([logits, torch.full((3, 2, 2), 50.0, dtype=torch.float64)], dim=-1)
    local = padded.chunk(world, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, 6 * rank, ps.tp_group, valid=6 if rank == 0 else 4)
    weights = torch.arange(6, dtype=torch.float64).view(3, 2)
    (loss * weights).sum().backward()
    full = logits.clone().requires_grad_(True)
    (torch.nn.functional.cross_entropy(full.reshape(-1, 10), target.reshape(-1), reduction="none")
     * weights.reshape(-1)).sum().backward()
    expected_grad = torch.cat([full.grad, torch.zeros(3, 2, 2, dtype=torch.float64)], -1).chunk(world, -1)[rank]
    return (torch.allclose(loss, expected.view(3, 2), rtol=1e-12, atol=0),
            torch.allclose(local.grad, expected_grad, rtol=1e-12, atol=1e-15))


def test_vocab_parallel_cross_entropy_matches_full_softmax():
    assert run_distributed(_cross_entropy_worker, 2) == [(True, True), (True, True)]
