"""--calculate-per-token-loss: the step's loss is Σ token losses / loss tokens of the global batch
(Megatron's semantics); without it, the mean of the micro-batch means. Validation of the new
schedule and packing flags."""

import sys
import os

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from parity import Case, MaskedData, config, GLOBAL_BATCH  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.validate import validate  # noqa: E402


def _first_loss(rank, world, per_token):
    from meshlm.data.sampler import collate
    from meshlm.training import trainer

    case = Case(micro=2, per_token=per_token)
    run = trainer.build(config(case), dtype=torch.float64)
    run.train_ds = MaskedData()
    batch = collate([run.train_ds[i] for i in range(GLOBAL_BATCH)])
    with torch.no_grad():
        token_losses = run.chunks[0](batch["tokens"], labels=batch["labels"]) * batch["loss_mask"]
    if per_token:
        want = token_losses.sum() / batch["loss_mask"].sum()
    else:
        per_mb = token_losses.view(-1, 2, token_losses.shape[1]).sum((1, 2))
        want = (per_mb / batch["loss_mask"].view(-1, 2 * token_losses.shape[1]).sum(1).clamp(min=1)).mean()
    return trainer.train_step(run, trainer.TrainState()), float(want)


@pytest.mark.parametrize("per_token", [False, True])
def test_step_loss_is_the_chosen_average(per_token):
    (got, want), = run_distributed(_first_loss, 1, per_token)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("change,words", [
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=2), "--lr-warmup-fraction 0.1 and --lr-warmup-iters 2"),
    (dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction 1.5 is above 1"),
    (dict(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=50), "--lr-wsd-decay-iters 50 exceeds"),
])
def test_schedule_flags_are_checked_in_one_line(change, words):
    cfg = config(Case())
    for k, v in change.items():
        setattr(cfg.optimizer, k, v)
    cfg.optimizer.lr_warmup_iters = change.get("lr_warmup_iters", 0)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        validate(cfg, world=1, check_files=False)


def test_packing_validates_with_context_parallel():
    """Packed documents split over CP (parity: tests/test_context_parallel.py)."""
    cfg = config(Case(packed=True))
    cfg.parallel.context_parallel_size = 2
    validate(cfg, world=2, check_files=False)
