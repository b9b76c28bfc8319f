"""Data parallelism: gradient buffers, buckets, and their reduction (parallel/data.py).

The toy model here (``Toy``) is shared with the optimizer tests: a tiny language model whose
parameters carry the attributes the real GPTModel sets (no_weight_decay on biases and norms).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_distributed
from meshlm.config import Config
from meshlm.dtypes import at_least_fp32
from meshlm.parallel.data import DistributedDataParallel
from meshlm.parallel.mesh import ParallelState

VOCAB, HIDDEN, SEQ = 48, 16, 8


class Toy(nn.Module):
    """Embedding → LayerNorm → MLP (residual) → output layer → per-token cross-entropy; float64
    unless told (the tests compare with one process at float64 rounding)."""

    def __init__(self, seed: int = 0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)
        for name, p in self.named_parameters():
            if name.endswith("bias") or name.startswith("norm"):
                p.no_weight_decay = True
        self.to(dtype)

    def forward(self, tokens, labels):
        x = self.emb(tokens)
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        logits = at_least_fp32(self.out(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_cfg(**parallel) -> Config:
    cfg = Config()
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def dp_backward(model, ddp, tokens, labels, dp_rank, dp, micro):
    """This DP rank's samples in `micro` micro-batches; all but the last under no_sync."""
    mine = tokens.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
    pieces = list(zip(mine[0].chunk(micro), mine[1].chunk(micro)))
    for i, (t, l) in enumerate(pieces):
        loss = model(t, l) / micro
        if i < micro - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    ddp.finish_grad_sync()


def _dp_run(ps, overlap, dist_opt):
    model = Toy()
    ddp = DistributedDataParallel([model], ps, make_cfg(ddp_bucket_size=300, overlap_grad_reduce=overlap,
                                                         use_distributed_optimizer=dist_opt))
    tokens, labels = batch(8)
    dp_backward(model, ddp, tokens, labels, ps.dp_rank, ps.dp, micro=2)
    (buf,) = ddp.buffers
    shards = [b.shard(ddp.rank, ddp.size) if dist_opt else (b.start, b.end) for b in buf.buckets]
    # this rank's reduced elements of each param: (name, offset in the flat param, values)
    frags = []
    for n, p in model.named_parameters():
        ps_, pe = buf.index[p]
        for s, e in shards:
            lo, hi = max(s, ps_), min(e, pe)
            if lo < hi:
                frags.append((n, lo - ps_, _grads(buf)[lo:hi].clone()))
    return {"frags": frags, "grad_data": _grads(buf).clone(), "shards": shards,
            "buckets": len(buf.buckets), "bytes": ddp.stats.bytes_reduced}


def _grads(buf):
    """The buffer's gradients as one flat tensor (buckets are contiguous ranges of it)."""
    return torch.cat([b.grad for b in buf.buckets])


def _dp_grads(rank, world, runs):
    ps = ParallelState.build()
    return [_dp_run(ps, overlap, dist_opt) for overlap, dist_opt in runs]


def _full_batch_grads():
    model = Toy()
    tokens, labels = batch(8)
    model(tokens, labels).backward()
    return {n: p.grad.reshape(-1) for n, p in model.named_parameters()}


def test_dp2_average_equals_single_process_full_batch_gradient_plain_and_zero1():
    ref = _full_batch_grads()
    zero_covered = 0
    for plain, zero in run_distributed(_dp_grads, 2, [(True, False), (True, True)]):
        assert plain["buckets"] >= 3, "the test must span several buckets"
        assert plain["bytes"] == sum(g.numel() * 8 for g in ref.values())
        for run in (plain, zero):
            for name, off, values in run["frags"]:
                torch.testing.assert_close(values, ref[name][off:off + len(values)], rtol=1e-12, atol=1e-15)
        zero_covered += sum(len(v) for _, _, v in zero["frags"])
    assert zero_covered == sum(g.numel() for g in ref.values()), "ZeRO-1 shards partition the params"


def test_overlap_on_equals_off_bitwise_for_all_reduce_and_reduce_scatter():
    runs = [(True, False), (False, False), (True, True), (False, True)]
    for plain_on, plain_off, zero_on, zero_off in run_distributed(_dp_grads, 2, runs):
        assert torch.equal(plain_on["grad_data"], plain_off["grad_data"])
        for s, e in zero_on["shards"]:
            assert torch.equal(zero_on["grad_data"][s:e], zero_off["grad_data"][s:e])


def test_buckets_follow_backward_order_and_cover_every_param():
    """Buckets take the params in backward order; each lays its own out by update group (decayed
    first, then the biases and norms: one flat-AdamW run each), in backward order within a group."""
    from meshlm.parallel.grad_buffer import update_group
    model = Toy()
    ddp = DistributedDataParallel([model], ParallelState.single(), make_cfg(ddp_bucket_size=300))
    (buf,) = ddp.buffers
    params = [p for b in buf.buckets for p in b.params]
    backward = [id(p) for p in list(model.parameters())[::-1]]
    rank = {i: n for n, i in enumerate(backward)}
    assert [id(p) for b in buf.buckets for p in sorted(b.params, key=lambda p: rank[id(p)])] == backward
    assert any(update_group(p)[0] for p in params) and any(not update_group(p)[0] for p in params)
    for b in buf.buckets:
        keys = [(update_group(p), rank[id(p)]) for p in b.params]
        assert keys == sorted(keys)
        assert [buf.index[p] for p in b.params] == sorted(buf.index[p] for p in b.params)
    for b, nxt in zip(buf.buckets, buf.buckets[1:]):
        assert b.end == nxt.start
        last = max(b.params, key=lambda p: rank[id(p)])  # the param that filled it
        assert b.end - b.start >= 300 > b.end - b.start - last.numel()
    assert buf.buckets[-1].end == buf.numel == sum(p.numel() for p in params)
    for b in buf.buckets:
        for p in b.params:
            s, e = buf.index[p]
            assert p.main_grad.data_ptr() == b.grad_range(s, e).data_ptr()
    for p in params:
        s, e = buf.index[p]
        assert p.data_ptr() == buf.param_data[s:e].data_ptr()
        assert p.main_grad.dtype == torch.float64  # float64 params keep float64 grads


def test_zero1_buckets_are_padded_to_equal_shards():
    model = Toy(dtype=torch.bfloat16)
    ddp = DistributedDataParallel([model], ParallelState.single(), make_cfg(
        ddp_bucket_size=300, use_distributed_optimizer=True))
    buf = ddp.buffers[0]
    assert buf.param_data.dtype == torch.bfloat16 and buf.buckets[0].grad.dtype == torch.float32
    assert all((b.end - b.start) % 64 == 0 for b in buf.buckets)


@pytest.mark.parametrize("overlap", [False, True])
def test_backward_accumulates_micro_batches_into_main_grad_and_frees_grad(overlap):
    """Per-param hooks (overlap) or one multi-tensor add at the end of each backward: the same."""
    model = Toy()
    ddp = DistributedDataParallel([model], ParallelState.single(), make_cfg(overlap_grad_reduce=overlap))
    tokens, labels = batch(4)
    with ddp.no_sync():
        model(tokens[:2], labels[:2]).backward()
    model(tokens[2:], labels[2:]).backward()
    ddp.finish_grad_sync()
    ref = Toy()
    (ref(tokens[:2], labels[:2]) + ref(tokens[2:], labels[2:])).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)
    ddp.zero_grad()
    assert all(b.grad is None for buf in ddp.buffers for b in buf.buckets)
    assert all(p.main_grad is None for p in model.parameters())


def test_grad_memory_is_held_only_from_a_buckets_first_gradient_to_zero_grad():
    """zero_grad frees every bucket's grad; under --overlap-grad-reduce backward allocates a bucket
    (zeroed) when its first gradient arrives, so the last layers' buckets exist while the first
    layers' do not yet; finish_grad_sync allocates a bucket no gradient reached. Gradients equal
    a fresh model's."""
    model = Toy()
    ddp = DistributedDataParallel([model], ParallelState.single(),
                                  make_cfg(ddp_bucket_size=300, overlap_grad_reduce=True))
    (buf,) = ddp.buffers
    tokens, labels = batch(4)
    for step in range(2):
        ddp.zero_grad()
        assert all(b.grad is None for b in buf.buckets)
        seen = []  # per gradient arriving: which buckets hold memory at that moment
        hooks = [p.register_post_accumulate_grad_hook(
            lambda p: seen.append([b.grad is not None for b in buf.buckets])) for p in model.parameters()]
        model(tokens, labels).backward()
        for h in hooks:
            h.remove()
        assert seen[0][0] and not any(seen[0][1:]), "the first gradient allocates only its own bucket"
        ddp.finish_grad_sync()
        ref = Toy()
        ref(tokens, labels).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-12, atol=1e-15, msg=f"step {step} {n}")
    ddp.zero_grad()
    frozen = buf.buckets[-1]
    ddp.finish_grad_sync()  # no backward at all: every bucket comes back zeroed
    assert frozen.grad is not None and float(frozen.grad.abs().sum()) == 0


def _marked_grads(rank, world, tp, pp, sequence_parallel):
    """Each rank sets its marked params' grads to rank + 1; return main_grads after the sync."""
    ps = ParallelState.build(tp=tp, pp=pp)
    model = Toy()
    model.norm.weight.sequence_parallel = True
    model.emb.weight.shared_embedding = True
    cfg = make_cfg(sequence_parallel=sequence_parallel, tensor_model_parallel_size=tp,
                   pipeline_model_parallel_size=pp)
    ddp = DistributedDataParallel([model], ps, cfg)
    for p in model.parameters():
        p.main_grad.fill_(rank + 1.0)
    ddp.finish_grad_sync()
    return {"norm": float(model.norm.weight.main_grad[0]), "emb": float(model.emb.weight.main_grad[0, 0]),
            "other": float(model.fc1.weight.main_grad[0, 0])}


def test_sequence_parallel_norm_grads_are_summed_over_tp():
    for r in run_distributed(_marked_grads, 2, 2, 1, True):
        assert r == {"norm": 1.0 + 2.0, "emb": r["other"], "other": r["other"]}
        assert r["other"] in (1.0, 2.0)


def test_shared_embedding_grads_are_summed_over_first_and_last_stage():
    for r in run_distributed(_marked_grads, 2, 1, 2, False):
        assert r["emb"] == 1.0 + 2.0
        assert r["norm"] == r["other"] in (1.0, 2.0)


def test_a_bucket_first_written_by_a_fold_has_no_stale_element(monkeypatch):
    """Without overlap, a bucket's first gradients of the step are copied into uninitialised
    memory (NaN here): every element, ZeRO-1 padding included, must be written."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    model = Toy()
    ddp = DistributedDataParallel([model], ParallelState.single(),
                                  make_cfg(ddp_bucket_size=300, use_distributed_optimizer=True))
    (buf,) = ddp.buffers
    assert any(b.end - b.start > sum(p.numel() for p in b.params) for b in buf.buckets), "needs padding"
    tokens, labels = batch(4)
    ddp.zero_grad()
    model(tokens, labels).backward()
    ddp.finish_grad_sync()
    assert all(torch.isfinite(b.grad).all() for b in buf.buckets)
    ref = Toy()
    ref(tokens, labels).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.main_grad, q.grad), n
