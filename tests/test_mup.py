"""μP (meshlm/mup.py, Tensor Programs V Table 8) on the production path, float64:

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


@pytest.mark.slow
def test_mup_at_width_multiplier_one_is_the_standard_model():
    plain, one, two = references([Case(layers=2), Case(layers=2, mup=ONE), Case(layers=2, mup=TWO)])
    assert plain["params"].keys() == one["params"].keys()
    for name, want in plain["params"].items():
        assert rel_err(one["params"][name], want) <= 1e-12, name
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(one["losses"], plain["losses"]))
    fc1 = "layers.0.mlp.linear_fc1.weight"
    assert rel_err(two["params"][fc1], plain["params"][fc1]) > 0.1  # and at multiplier 2 μP changes the model


@pytest.mark.slow
def test_mup_tp_sp_pp_and_zero1_equal_one_process():
    assert_parity(*(Case(layers=2, mup=TWO, **layout) for layout in
                    (dict(tp=2, sp=True), dict(pp=2), dict(dp=2, dist_opt=True))))


WIDTHS = (64, 512)


def _coordinates(rank: int, world: int, use_mup: bool) -> list:
    """For each width: [RMS of each site's output at init, RMS of its change after STEPS steps]
    on one fixed batch; the sites: the embedding, each transformer layer and the logits (untied
    output layer: a tied one sees its own token's embedding in the residual stream)."""
    from meshlm.training import trainer

    out = []
    for width in WIDTHS:
        mup = (("use_mup", True), ("mup_base_hidden_size", 64), ("mup_base_head_dim", 16.0)) if use_mup else ()
        case = Case(layers=2, tied=False, micro=8, bucket=None, mup=mup)
        cfg = config(case)
        cfg.model.hidden_size, cfg.optimizer.clip_grad, cfg.optimizer.lr = width, 0.0, 1e-2
        run = trainer.build(cfg, dtype=torch.float64)
        run.train_ds = MaskedData()
        model = run.chunks[0]
        sites = [model.embedding] + list(model.layers.values()) + [model.output_layer]
        seen = {}
        for i, site in enumerate(sites):  # the logits with their μP multiplier
            mult = model.output_mult if site is model.output_layer else 1.0
            site.register_forward_hook(lambda mod, args, y, i=i, c=mult: seen.__setitem__(i, c * y.detach()))
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


@pytest.mark.slow
def test_coordinate_check_flat_under_mup_growing_under_standard():
    (mup,), (standard,) = (run_distributed(_coordinates, 1, flag) for flag in (True, False))
    growth = lambda runs, k: [runs[-1][k][i] / runs[0][k][i] for i in range(len(runs[0][k]))]  # noqa: E731
    # at init: the embedding and the layers (μP's logits start near 0 by design: × 1/m)
    flat, grown = growth(mup, 0)[:-1], growth(standard, 0)
    assert all(0.5 < g < 2 for g in flat), ("output at init", "μP", flat)
    assert min(grown[1:]) > 2, ("output at init", "standard", grown)  # every layer and the logits
    flat, grown = growth(mup, 1), growth(standard, 1)
    assert all(0.5 < g < 2 for g in flat), ("change after training", "μP", flat)
    assert min(grown[1:]) > 2, ("change after training", "standard", grown)


def test_mup_flags_are_checked_before_any_worker_starts_and_recorded_for_resume():
    from meshlm.checkpoint.architecture import architecture
    from meshlm.config import Config, ModelConfig
    from meshlm.errors import ConfigError
    from meshlm.validate import validate

    def problems(**model) -> str:
        cfg = Config()
        cfg.data.mock_data, cfg.model.vocab_size = True, 64
        for k, v in model.items():
            setattr(cfg.model, k, v)
        try:
            validate(cfg, world=1, check_files=False)
        except ConfigError as e:
            return str(e)
        return ""

    assert "--mup-base-hidden-size --mup-output-mult need(s) --use-mup" in problems(mup_base_hidden_size=64,
                                                                                  mup_output_mult=0.5)
    assert "--mup-width-mult 2.0 differs from --hidden-size / --mup-base-hidden-size = 4" in problems(
        use_mup=True, mup_base_hidden_size=64, mup_width_mult=2.0)
    assert "--use-mup with --num-experts" in problems(use_mup=True, num_experts=4)
    assert problems(use_mup=True, mup_base_hidden_size=64, mup_width_mult=4.0) == ""
    saved = architecture(ModelConfig(use_mup=True, mup_base_hidden_size=64))
    assert saved["mup_output_mult"] == 0.25 and saved["mup_base_hidden_size"] == 64
    assert architecture(ModelConfig(use_mup=True, mup_base_hidden_size=128)) != saved
    assert architecture(ModelConfig())["use_mup"] is False


def test_a_resumed_run_keeps_the_checkpoints_multipliers(tmp_path):
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.state import check_model_config
    from meshlm.config import Config, ModelConfig
    from meshlm.errors import CheckpointError

    def model(**kw):
        return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, **kw)

    cfg = Config()
    cfg.model = model(use_mup=True, mup_base_hidden_size=16)
    ckpt.save(str(tmp_path), 10, {"w": torch.zeros(2)}, config=cfg.to_dict())
    path = str(tmp_path / "iter_0000010")
    check_model_config(path, model(use_mup=True, mup_base_hidden_size=16, mup_output_mult=0.5))  # = the derived 1/m
    with pytest.raises(CheckpointError) as err:
        check_model_config(path, model(use_mup=True, mup_base_hidden_size=8, mup_embedding_mult=2.0))
    for diff in ("--mup-base-hidden-size saved=16 now=8", "--mup-output-mult saved=0.5 now=0.25",
                 "--mup-embedding-mult saved=1.0 now=2.0"):
        assert diff in str(err.value), diff
    with pytest.raises(CheckpointError, match="--use-mup saved=True now=False"):
        check_model_config(path, model())
    from meshlm.checkpoint.hf_config import hf_config_from_model
    with pytest.raises(CheckpointError, match="--use-mup .* True; a Hugging Face gpt2 model needs False"):
        hf_config_from_model(model(use_mup=True), 64)
