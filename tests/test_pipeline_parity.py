"""A tiny stand-in for GPTModel with the same constructor roles and forward signature.

Each layer is h → h (Linear + tanh) built from its own generator (seed, global layer index), so
any partition of the layers starts from the same weights, as GPTModel promises. Optional sleeps
give stages a fixed cost for bubble measurements.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``f`` seconds in forward and ``b`` seconds in backward."""

    @staticmethod
    def forward(ctx, x, f, b):
        ctx.b = b
        time.sleep(f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


def _init(seed: int, key: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + key)
    return torch.randn(*shape, generator=g) * 0.3


class ToyStage(nn.Module):
    """forward(tokens [b, s] | None, labels [b, s] | None, hidden_states [s, b, h] | None)
    → per-token loss [b, s] (post_process with labels) or hidden [s, b, h]."""

    def __init__(self, vocab: int, hidden: int, *, seed: int = 0, layer_ids=range(2), pre_process=True,
                 post_process=True, tied=False, sleep=(0.0, 0.0)):
        super().__init__()
        self.pre_process, self.post_process, self.sleep = pre_process, post_process, sleep
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleDict({str(i): nn.Linear(hidden, hidden) for i in self.layer_ids})
        with torch.no_grad():
            for i, layer in self.layers.items():
                layer.weight.copy_(_init(seed, 10 + int(i), (hidden, hidden)))
                layer.bias.copy_(_init(seed, 500 + int(i), (hidden,)) * 0.1)
        embedding = _init(seed, 1, (vocab, hidden))
        self.tied = tied
        if pre_process:
            self.embedding = nn.Parameter(embedding.clone())
            self.embedding.shared_embedding = tied
        if post_process:
            if tied and pre_process:
                self.output = self.embedding
            elif tied:
                self.output = nn.Parameter(embedding.clone())
                self.output.shared_embedding = True
            else:
                self.output = nn.Parameter(_init(seed, 2, (vocab, hidden)))

    def forward(self, tokens, labels=None, hidden_states=None):
        x = self.embedding[tokens].transpose(0, 1) if self.pre_process else hidden_states
        if any(self.sleep):
            x = _Sleep.apply(x, *self.sleep)
        for i in self.layer_ids:
            x = torch.tanh(self.layers[str(i)](x))
        if not self.post_process:
            return x
        logits = x.transpose(0, 1) @ self.output.t()  # [b, s, V]
        if labels is None:
            return logits
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [b, s]

    def named_global(self) -> dict:
        """Parameters by layout-independent name (layer index is global)."""
        out = {f"layers.{i}.{n}": p for i, layer in self.layers.items() for n, p in layer.named_parameters()}
        if self.pre_process:
            out["embedding"] = self.embedding
        if self.post_process and not (self.tied and self.pre_process):
            out["embedding" if self.tied else "output"] = self.output
        return out


# ----------------------------------------------------------------------------- parity harness


import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distributed import run_distributed  # noqa: E402
from meshlm.config import Config  # noqa: E402
from meshlm.parallel.mesh import ParallelState  # noqa: E402
from meshlm.parallel.pipeline import bubble_fraction, forward_backward, reduce_losses, stage_layers  # noqa: E402
from meshlm.parallel.schedules import analytic_bubble_fraction  # noqa: E402

VOCAB, HIDDEN, SEQ, MICRO, STEPS = 64, 16, 8, 2, 3


def _config(pp=1, layers=4, schedule="auto", v=None, first=None, last=None) -> Config:
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length = layers, HIDDEN, SEQ
    cfg.training.micro_batch_size = MICRO
    p = cfg.parallel
    p.pipeline_model_parallel_size, p.pipeline_schedule = pp, schedule
    p.virtual_pipeline_model_parallel_size = v
    p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = first, last
    return cfg


def _micro_batches(count: int) -> list:
    """The global batch of every step as ``count`` micro-batches (some tokens masked out)."""
    g = torch.Generator().manual_seed(100)
    return [{"tokens": torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
             "loss_mask": (torch.rand(MICRO, SEQ, generator=g) > 0.25).float()} for _ in range(count)]


def _build(cfg: Config, ps: ParallelState, tied: bool, sleep=(0.0, 0.0)) -> list:
    ranges = stage_layers(cfg)
    v, last = len(ranges) // ps.pp, len(ranges) - 1
    stages = [c * ps.pp + ps.pp_rank for c in range(v)]
    return [ToyStage(VOCAB, HIDDEN, layer_ids=ranges[s], pre_process=s == 0, post_process=s == last,
                     tied=tied, sleep=sleep) for s in stages]


def _train(cfg: Config, ps: ParallelState, m: int, tied: bool) -> dict:
    """STEPS AdamW steps; grads of tied copies summed over the embedding group, averaged over DP."""
    chunks = [c.to(ps.device) for c in _build(cfg, ps, tied)]
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    losses, timelines = [], []
    for step in range(STEPS):
        mine = _micro_batches(m * ps.dp)[ps.dp_rank * m:(ps.dp_rank + 1) * m]
        timeline = []
        out = forward_backward(chunks, iter(mine), ps=ps, cfg=cfg, num_microbatches=m, timeline=timeline)
        if ps.embedding_group is not None:
            for p in params:
                if getattr(p, "shared_embedding", False):
                    dist.all_reduce(p.grad, group=ps.embedding_group)
        if ps.dp_group is not None:
            for p in params:
                dist.all_reduce(p.grad, group=ps.dp_group)
                p.grad /= ps.dp
        opt.step()
        opt.zero_grad()
        losses.append(reduce_losses(out, ps))
        timelines.append(timeline)
    weights = {n: p.detach().cpu().clone() for c in chunks for n, p in c.named_global().items()}
    return {"losses": losses, "weights": weights, "timelines": timelines}


def _reference(layers: int, m: int, tied: bool) -> dict:
    return _train(_config(layers=layers), ParallelState.single(), m, tied)


def _pipelined(rank, world, layout: dict, m: int, tied: bool) -> dict:
    ps = ParallelState.build(pp=layout["pp"])
    cfg = _config(**{k: v for k, v in layout.items() if k != "dp"})
    return _train(cfg, ps, m, tied)


def _assert_parity(layout: dict, m: int, tied: bool = False, world: int = None) -> list:
    """Run ``layout`` over gloo and compare losses and updated weights with one process."""
    dp = layout.get("dp", 1)
    results = run_distributed(_pipelined, world or layout["pp"] * dp, layout, m, tied)
    ref = _reference(layout.get("layers", 4), m * dp, tied)
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], ref["losses"])
    seen = set()
    for r in results:
        for name, w in r["weights"].items():
            want = ref["weights"][name]
            rel = (w - want).abs().max() / want.abs().max()
            assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
            seen.add(name)
    assert seen == set(ref["weights"]), "some weights were on no stage"
    assert ref["losses"][-1] < ref["losses"][0], "the model did not train; the test would prove nothing"
    return results


# ----------------------------------------------------------------------------- parity tests

def test_no_pipelining_matches_one_pass_over_the_whole_batch():
    """PP=1, schedule none: grads of m micro-batches = grad of the mean of their losses."""
    cfg, ps = _config(), ParallelState.single()
    (model,) = _build(cfg, ps, tied=True)
    batches = _micro_batches(4)
    scaled = []
    out = forward_backward([model], iter(batches), ps=ps, cfg=cfg, num_microbatches=4, loss_scale=8.0,
                           no_sync=lambda: _count(scaled))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b in batches:
        per_token = model(b["tokens"], b["labels"])
        total = total + (per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()
    (total * 8.0 / 4).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7)
    assert len(out) == 4 and all(d["lm_loss"].dtype == torch.float32 for d in out)
    assert [d["num_tokens"] for d in out] == [int(b["loss_mask"].sum()) for b in batches]
    assert len(scaled) == 3, "no_sync must wrap every backward but the last"


def _count(log: list):
    import contextlib
    log.append(1)
    return contextlib.nullcontext()


def test_pp2_1f1b_matches_single_process():
    _assert_parity({"pp": 2}, m=4)


def test_pp4_1f1b_matches_single_process():
    _assert_parity({"pp": 4}, m=6)


def test_pp2_gpipe_matches_single_process():
    _assert_parity({"pp": 2, "schedule": "gpipe"}, m=3)


def test_pp2_interleaved_two_virtual_stages_matches_single_process():
    _assert_parity({"pp": 2, "v": 2}, m=4)


def test_uneven_first_stage_matches_single_process():
    """PP=3, 5 layers: 1 on the first stage, 2 on each of the others."""
    _assert_parity({"pp": 3, "layers": 5, "first": 1}, m=3)


def test_tied_embeddings_across_pp2_match_single_process():
    _assert_parity({"pp": 2}, m=4, tied=True)


def test_pp2_dp2_matches_single_process():
    """Ranks (pp, dp): each DP replica runs its half of the micro-batches through its pipeline."""
    _assert_parity({"pp": 2, "dp": 2}, m=2)


# ----------------------------------------------------------------------------- memory and bubble

def _peak_in_flight(rank, world, schedule: str, m: int) -> int:
    ps = ParallelState.build(pp=world)
    cfg = _config(pp=world, schedule=schedule)
    timeline = []
    forward_backward(_build(cfg, ps, tied=False), iter(_micro_batches(m)), ps=ps, cfg=cfg,
                     num_microbatches=m, timeline=timeline)
    return max(e["in_flight"] for e in timeline)


def test_1f1b_first_stage_holds_at_most_pp_microbatches_gpipe_holds_all():
    pp, m = 2, 6
    assert run_distributed(_peak_in_flight, pp, "1f1b", m) == [2, 1]
    assert run_distributed(_peak_in_flight, pp, "gpipe", m) == [m, m]


def _measured_bubble(rank, world, layout: dict, m: int, cost: float) -> float:
    ps = ParallelState.build(pp=world)
    cfg = _config(**layout)
    v = layout.get("v") or 1
    chunks = _build(cfg, ps, tied=False, sleep=(cost / v, cost / v))
    timeline = []
    dist.barrier()
    forward_backward(chunks, iter(_micro_batches(m)), ps=ps, cfg=cfg, num_microbatches=m, timeline=timeline)
    return bubble_fraction(timeline)


@pytest.mark.parametrize("layout,m", [({"pp": 4}, 4), ({"pp": 2, "v": 2}, 2)])
def test_measured_bubble_of_equal_cost_stages_matches_analytic(layout, m):
    """Stages that sleep 100 ms per forward and per backward: the first stage idles (p−1)/(v·m+p−1)."""
    pp, v = layout["pp"], layout.get("v") or 1
    measured = run_distributed(_measured_bubble, pp, layout, m, 0.1)[0]
    expected = analytic_bubble_fraction(pp, m, v)
    assert abs(measured - expected) < 0.05, (measured, expected)


def _forward_only_vs_training(rank, world) -> tuple:
    ps = ParallelState.build(pp=world)
    cfg = _config(pp=world)
    chunks = _build(cfg, ps, tied=False)
    evaluated = forward_backward(chunks, iter(_micro_batches(3)), ps=ps, cfg=cfg, num_microbatches=3,
                                 forward_only=True)
    no_grads = all(p.grad is None for c in chunks for p in c.parameters())
    trained = forward_backward(chunks, iter(_micro_batches(3)), ps=ps, cfg=cfg, num_microbatches=3)
    return [float(d["lm_loss"]) for d in evaluated], [float(d["lm_loss"]) for d in trained], no_grads


def test_forward_only_pipeline_gives_the_training_losses_and_no_grads():
    first, last = run_distributed(_forward_only_vs_training, 2)
    assert first == ([], [], True)
    evaluated, trained, no_grads = last
    assert no_grads and len(evaluated) == 3
    assert evaluated == pytest.approx(trained, rel=1e-6)
