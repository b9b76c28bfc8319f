"""--finetune, --no-load-optim, --no-load-rng: exactly what trainer.load_checkpoint restores
(Megatron's checkpointing.py load_checkpoint), under plain DP and ZeRO-1 at DP=2.

A short run (bf16 params, so the fp32 master weights are separate tensors; dropout on, so the
dropout call counts matter) saves a checkpoint; each switch then builds a new run, loads it, and
the worker compares the live state with what the checkpoint files hold, read independently.
"""

import contextlib
import io
import os

import pytest
import torch

from distributed import run_distributed
from meshlm.checkpoint import dist as ckpt
from meshlm.config import Config
from meshlm.errors import CheckpointError
from meshlm.training import trainer
from meshlm.validate import notes

ITERS, GLOBAL = 2, 4
SWITCHES = {"none": {}, "no_load_optim": {"no_load_optim": True}, "no_load_rng": {"no_load_rng": True},
            "finetune": {"finetune": True}}


def _config(tmp: str, zero: int) -> Config:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 32, 4, 16, 100
    m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 16, 0.1, 0.1
    t.micro_batch_size, t.global_batch_size, t.train_iters = 2, GLOBAL, ITERS
    t.log_interval, t.eval_interval, t.eval_iters = 1, 100, 1
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 1e-2, 1
    cfg.parallel.data_parallel_sharding_strategy = ("no_shard", "optim", "optim_grads", "optim_grads_params")[zero]
    cfg.data.mock_data = True
    cfg.logging.log_dir = os.path.join(tmp, "logs")
    cfg.checkpoint.save = os.path.join(tmp, "ckpt")
    return cfg


def _snapshot(run) -> dict:
    """Copies of the run's weights and of its optimizer's per-parameter fp32 state pieces."""
    pieces = run.opt.state_pieces()
    run.opt.finish_param_sync()  # ZeRO-3: the weights whole, to read them
    return {"weights": [q.detach().clone() for c in run.chunks for q in c.parameters()],
            "state": [{k: v.clone() for k, v in st.items()} for _, _, st in pieces],
            "param_pieces": [p.detach().reshape(-1)[lo:lo + st["master"].numel()].float()
                             for p, lo, st in pieces]}


def _facts(run, state, ref: dict, saved_rng: torch.Tensor, fresh_rng: torch.Tensor) -> dict:
    """What the run holds after load_checkpoint. ``ref``: the _snapshot of a run loaded with no
    switch (the checkpoint's values: test_checkpoint_reshard proves that load exact)."""
    now = _snapshot(run)
    rng = torch.get_rng_state()

    def moments(kind):
        return all(torch.equal(a[kind], b[kind]) for a, b in zip(now["state"], ref["state"]))
    return {
        "iteration": state.iteration, "consumed": state.consumed_samples,
        "adam_step": run.opt.step_count, "lr_steps": run.sched.samples // run.global_batch,
        "weights": all(torch.equal(a, b) for a, b in zip(now["weights"], ref["weights"])),
        "moments": "saved" if moments("exp_avg") and moments("exp_avg_sq") else
                   "zero" if all(not st["exp_avg"].any() and not st["exp_avg_sq"].any() for st in now["state"])
                   else "other",
        "masters": "saved" if moments("master") else
                   "weights" if all(torch.equal(st["master"], w) for st, w in zip(now["state"], now["param_pieces"]))
                   else "other",
        "rng": "saved" if torch.equal(rng, saved_rng) else "fresh" if torch.equal(rng, fresh_rng) else "other",
        "dropout_calls": [c.rng.call for c in run.chunks],
    }


def _load(tmp, zero, name, switches, **model):
    cfg = _config(os.path.join(tmp, name), zero)
    cfg.checkpoint.load, cfg.checkpoint.save = os.path.join(tmp, "ckpt"), None
    for key, value in model.items():
        setattr(cfg.model, key, value)
    for key, value in switches.items():
        setattr(cfg.checkpoint, key, value)
    run = trainer.build(cfg, torch.bfloat16)
    torch.manual_seed(999)  # training leaves the default generator as seeded: make it differ
    fresh_rng = torch.get_rng_state()
    return run, trainer.load_checkpoint(run), fresh_rng


def _save_then_load_each(rank, world, tmp, zero):
    cfg = _config(tmp, zero)
    trainer.pretrain(cfg, torch.bfloat16)
    _, saved = ckpt.load(cfg.checkpoint.save)  # read without the trainer: this rank's RNG subtree
    out = {"saved_calls": saved["dropout_call"]}
    ref = _snapshot(_load(tmp, zero, "ref", {})[0])
    for name, switches in SWITCHES.items():
        run, state, fresh_rng = _load(tmp, zero, name, switches)
        out[name] = _facts(run, state, ref, saved["rng"]["torch_cpu"], fresh_rng)
        if name == "finetune":  # it trains from iteration 0 on the loaded weights
            out["finetune_trained"] = trainer.train(run, state)["iterations"]
    # --finetune compares no architecture flags, but a model without a place for some saved weight
    # (here layer 1 and its norms) is refused: it read the rest and trained another model silently
    try:
        _load(tmp, zero, "fewer_layers", {"finetune": True}, num_layers=1)
    except CheckpointError as e:
        out["fewer_layers"] = str(e)
    said = io.StringIO()  # the same tensors under another function: trained as asked, with a note
    with contextlib.redirect_stdout(said):
        _load(tmp, zero, "layernorm_1p", {"finetune": True}, apply_layernorm_1p=True)
    out["layernorm_1p"] = said.getvalue()
    try:  # the other way round: tensors the checkpoint lacks (the q/k norms) are named with their flag too
        _load(tmp, zero, "qk_norms", {"finetune": True}, qk_layernorm=True)
    except CheckpointError as e:
        out["qk_norms"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,zero", [(1, 0), (2, 1), (2, 3)], ids=["dp1", "zero1-dp2", "zero3-dp2"])
def test_each_switch_restores_exactly_what_megatron_restores(tmp_path, world, zero):
    results = run_distributed(_save_then_load_each, world, str(tmp_path), zero)
    for r in results:
        calls = [r["saved_calls"]] * len(r["none"]["dropout_calls"])
        assert all(c > 0 for c in calls)
        loaded = dict(iteration=ITERS, consumed=ITERS * GLOBAL, weights=True)
        optim = dict(adam_step=ITERS, lr_steps=ITERS, moments="saved", masters="saved")
        # masters rebuilt from the loaded bf16 weights: they differ from the saved fp32 masters
        fresh_optim = dict(adam_step=0, lr_steps=0, moments="zero", masters="weights")
        rng, fresh_rng = dict(rng="saved", dropout_calls=calls), dict(rng="fresh", dropout_calls=[0] * len(calls))
        want = {"none": {**loaded, **optim, **rng},
                "no_load_optim": {**loaded, **fresh_optim, **rng},
                "no_load_rng": {**loaded, **optim, **fresh_rng},
                "finetune": {**loaded, "iteration": 0, "consumed": 0, **fresh_optim, **fresh_rng}}
        for name in SWITCHES:
            assert r[name] == want[name], name
        assert r["finetune_trained"] == ITERS
        assert "holds 16 weight(s) this run's model has no place for (layers.1." in r["fewer_layers"]
        assert r["fewer_layers"].endswith("pass the saved model's flags (--num-layers saved=2 now=1)")
        assert "does not fit this run's model (has no tensor 8: model/layers." in r["qk_norms"]
        assert r["qk_norms"].endswith("pass the saved model's flags (--qk-layernorm saved=False now=True)")
    assert "note: --finetune compares no architecture flags, and this run's differ from the checkpoint's: " \
           "--apply-layernorm-1p saved=False now=True; the weights fit" in results[0]["layernorm_1p"]


def test_switches_without_load_are_noted():
    cfg = Config()
    cfg.checkpoint.finetune = cfg.checkpoint.no_load_rng = True
    assert notes(cfg) == ["--finetune --no-load-rng ignored without --load (as in Megatron): the run starts "
                          "from its initial weights; add --load CHECKPOINT_DIR to start from a checkpoint"]
    cfg.checkpoint.load = "ckpt"
    assert notes(cfg) == []
    cfg.checkpoint.use_checkpoint_opt_param_scheduler = True  # the schedule it would keep is not loaded
    assert notes(cfg) == ["--use-checkpoint-opt_param-scheduler ignored with --finetune (as in Megatron): the "
                          "checkpoint's LR schedule is not loaded, so this run's flags set it, from step 0"]
    cfg.checkpoint.finetune = False
    assert notes(cfg) == []
