"""μP (meshlm/mup.py, Tensor Programs V Table 3) on the production path, float64:

- at width multiplier 1 (with the base head dim = the head dim) μP is the standard model, parameter
  for parameter after training, and at multiplier 2 it is not;
- at multiplier 2 (every μP rescaling ≠ 1) TP=2 with SP, PP=2 and DP=2 with ZeRO-1 equal one process;
- the coordinate check (§ "coord check", Fig. 5 of the paper): over widths 64 → 512 the RMS of each
  layer's output and of its change after a few Adam steps stays flat under μP and grows with the
  width under the standard parametrisation.
"""

import pytest
import torch

from distributed import run_distributed
from parity import STEPS, Case, MaskedData, assert_parity, config, references, rel_err

ONE = (("use_mup", True), ("mup_base_head_dim", 4.0))  # hidden 16, 4 heads: head dim 4, multiplier 1
TWO = (("use_mup", True), ("mup_base_hidden_size", 8), ("mup_embedding_mult", 2.0))  # multiplier 2


def test_mup_at_width_multiplier_one_is_the_standard_model():
    plain, one, two = references([Case(), Case(mup=ONE), Case(mup=TWO)])
    assert plain["params"].keys() == one["params"].keys()
    for name, want in plain["params"].items():
        assert rel_err(one["params"][name], want) <= 1e-12, name
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(one["losses"], plain["losses"]))
    assert rel_err(two["params"]["layers.0.mlp.linear_fc1.weight"], plain["params"]["layers.0.mlp.linear_fc1.weight"]) > 0.1


@pytest.mark.slow
def test_mup_tp_sp_pp_and_zero1_equal_one_process():
    assert_parity(Case(tp=2, sp=True, mup=TWO), Case(pp=2, mup=TWO), Case(dp=2, dist_opt=True, mup=TWO))


WIDTHS = (64, 128, 256, 512)


def _coordinates(rank: int, world: int, use_mup: bool) -> list:
    """For each width: [RMS of each layer's output at init, RMS of its change after STEPS steps]
    on one fixed batch, the layers being the embedding, each transformer layer and the logits."""
    from meshlm.training import trainer

    out = []
    for width in WIDTHS:
        case = Case(layers=2, mup=(("use_mup", True), ("mup_base_hidden_size", 64), ("mup_base_head_dim", 16.0))
                    if use_mup else ())
        cfg = config(case)
        cfg.model.hidden_size, cfg.optimizer.clip_grad, cfg.optimizer.lr = width, 0.0, 1e-2
        run = trainer.build(cfg, dtype=torch.float64)
        run.train_ds = MaskedData()
        model = run.chunks[0]
        sites = [model.embedding] + list(model.layers.values()) + [model.output_layer]
        seen = {}
        for i, site in enumerate(sites):
            site.register_forward_hook(lambda mod, args, y, i=i: seen.__setitem__(i, y.detach().clone()))
        tokens = MaskedData()[0]["tokens"][None]

        def probe():
            with torch.no_grad():
                model(tokens)
            return [seen[i] for i in range(len(sites))]

        before = probe()
        state = trainer.TrainState()
        for _ in range(STEPS):
            trainer.train_step(run, state)
        after = probe()
        rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
        out.append([[rms(b) for b in before], [rms(a - b) for a, b in zip(after, before)]])
    return out


def test_coordinate_check_flat_under_mup_growing_under_standard():
    (mup,), (standard,) = (run_distributed(_coordinates, 1, flag) for flag in (True, False))
    growth = lambda runs, k: [runs[-1][k][i] / runs[0][k][i] for i in range(len(runs[0][k]))]  # noqa: E731
    for k, what in enumerate(("output", "change of output")):
        flat, grown = growth(mup, k), growth(standard, k)
        assert all(0.5 < g < 2 for g in flat), (what, "μP", flat)
        # the layers' outputs and the logits (the embedding's init is width-free in both)
        assert max(grown[1:]) > 3, (what, "standard", grown)
