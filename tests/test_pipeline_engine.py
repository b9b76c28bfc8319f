"""The pipeline engine on a tiny stand-in for GPTModel (same constructor roles and forward
signature): gradient accumulation, memory held by 1F1B and GPipe, forward-only evaluation, the
measured bubble. Training parity of every schedule with one process: tests/test_parity_matrix.py.

Each toy layer is h → h (Linear + tanh) built from its own generator (seed, global layer index),
in float64, so any partition of the layers starts from the same weights, as GPTModel promises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _init(seed: int, key: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + key)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3


class ToyStage(nn.Module):
    """forward(tokens [b, s] | None, labels [b, s] | None, hidden_states [s, b, h] | None)
    → per-token loss [b, s] (post_process with labels) or hidden [s, b, h]."""

    def __init__(self, vocab: int, hidden: int, *, seed: int = 0, layer_ids=range(2), pre_process=True,
                 post_process=True, tied=False):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleDict({str(i): nn.Linear(hidden, hidden, dtype=torch.float64)
                                     for i in self.layer_ids})
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

    def forward(self, tokens, labels=None, hidden_states=None, position_ids=None, document_ids=None):
        x = self.embedding[tokens].transpose(0, 1) if self.pre_process else hidden_states
        for i in self.layer_ids:
            x = torch.tanh(self.layers[str(i)](x))
        if not self.post_process:
            return x
        logits = x.transpose(0, 1) @ self.output.t()  # [b, s, V]
        if labels is None:
            return logits
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [b, s]


# ----------------------------------------------------------------------------- engine tests


import pytest  # noqa: E402

from distributed import run_distributed  # noqa: E402
from meshlm.config import Config  # noqa: E402
from meshlm.parallel.mesh import ParallelState  # noqa: E402
from meshlm.parallel.pipeline import bubble_fraction, forward_backward, stage_layers  # noqa: E402

VOCAB, HIDDEN, SEQ, MICRO = 64, 16, 8, 2


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


def _build(cfg: Config, ps: ParallelState, tied: bool) -> list:
    ranges = stage_layers(cfg)
    v, last = len(ranges) // ps.pp, len(ranges) - 1
    stages = [c * ps.pp + ps.pp_rank for c in range(v)]
    return [ToyStage(VOCAB, HIDDEN, layer_ids=ranges[s], pre_process=s == 0, post_process=s == last,
                     tied=tied) for s in stages]


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
        torch.testing.assert_close(got[n], p.grad, rtol=1e-12, atol=1e-15)
    assert len(out) == 4 and all(d["lm_loss"].dtype == torch.float64 for d in out)
    assert [d["num_tokens"] for d in out] == [int(b["loss_mask"].sum()) for b in batches]
    assert len(scaled) == 3, "no_sync must wrap every backward but the last"


def _count(log: list):
    import contextlib
    log.append(1)
    return contextlib.nullcontext()


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


def test_bubble_is_the_idle_share_of_the_step_window():
    """Busy time is the union of the F/B spans (overlaps counted once), idle the rest of the window."""
    spans = [{"start": 0.0, "end": 2.0}, {"start": 1.0, "end": 3.0}, {"start": 5.0, "end": 6.0}]
    assert bubble_fraction(spans) == pytest.approx(2.0 / 6.0, abs=1e-15)
    assert bubble_fraction(spans, window=(-2.0, 8.0)) == pytest.approx(6.0 / 10.0, abs=1e-15)


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
    assert evaluated == trained  # the same forward arithmetic
