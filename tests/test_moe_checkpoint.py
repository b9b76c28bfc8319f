"""MoE checkpoints: the expert bias is saved (one global tensor per layer), so a resumed run goes on
exactly; a checkpoint saved at EP=2 (DP=4, distributed optimizer: expert states sharded over the
expert-data-parallel group) continues at EP=2 and at EP=1 as the uninterrupted single process
(float64, every loss, grad norm and weight within 1e-10 relative: tests/parity.py); one saved at
CP = 2 × EP = 2 continues at CP = 1 likewise."""

import os

import pytest
import torch

import parity
from distributed import run_distributed
from parity import Case, rel_err
from test_moe_parallel import MOE

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

STEPS, SAVED_AT = 5, 3  # an odd number of ±rate bias steps: the saved bias is not zero
FLAGS = tuple((k, 0.05 if k == "moe_router_bias_update_rate" else v) for k, v in MOE)  # a bias that moves routes
SAVED = Case(experts=4, moe=FLAGS, dp=4, ep=2, dist_opt=True, bucket=None)
SINGLE = Case(experts=4, moe=FLAGS, bucket=None)


class Data(parity.MaskedData):
    def __len__(self):
        return parity.GLOBAL_BATCH * STEPS


def _train(rank, world, case, root, load, steps, save, zero_bias=False):
    """``steps`` steps of ``case`` after loading ``root/load`` (if given), saving to ``root/save``
    after step SAVED_AT (if given); zero_bias: forget the loaded expert bias (the control)."""
    from meshlm.model.moe import Router
    from meshlm.training import trainer
    cfg = parity.config(case)
    cfg.training.train_iters = STEPS
    cfg.checkpoint.load = load and os.path.join(root, load)
    cfg.checkpoint.save = save and os.path.join(root, save)
    run = trainer.build(cfg, dtype=torch.float64)
    run.train_ds = Data()
    state = trainer.load_checkpoint(run) if load else trainer.TrainState()
    routers = [m for c in run.chunks for m in c.modules() if isinstance(m, Router)]
    if zero_bias:
        for r in routers:
            r.expert_bias.zero_()
    norms, step = [], run.opt.step
    run.opt.step = lambda *a, **k: (lambda r: (norms.append(r.resolve().grad_norm), r)[1])(step(*a, **k))
    losses, biases = [], []
    for _ in range(steps):
        losses.append(trainer.train_step(run, state))
        if save and state.iteration == SAVED_AT:
            trainer.save_checkpoint(run, state)
            biases = [r.expert_bias.clone() for r in routers]
    run.opt.finish_param_sync()
    return {"losses": losses, "norms": norms, "params": parity._full_params(run), "biases": biases}


def _saved_then_resumed(rank, world, root):
    first = _train(rank, world, SAVED, root, None, SAVED_AT, "saved")
    return first, _train(rank, world, SAVED, root, "saved", STEPS - SAVED_AT, None)


def _single_runs(rank, world, root):
    """The uninterrupted single process (saving at SAVED_AT), then from the EP=2 checkpoint: EP=1
    continuations with the saved bias and with it forgotten."""
    ref = _train(rank, world, SINGLE, root, None, STEPS, "single")
    return (ref, _train(rank, world, SINGLE, root, "saved", STEPS - SAVED_AT, None),
            _train(rank, world, SINGLE, root, "saved", STEPS - SAVED_AT, None, zero_bias=True))


def _errors(results: list, ref: dict) -> list:
    bad = []
    for rank, r in enumerate(results):
        for what in ("losses", "norms"):
            bad += [f"rank {rank} step {SAVED_AT + i + 1} {what}: {x} vs {y}" for i, (x, y) in
                    enumerate(zip(r[what], ref[what][SAVED_AT:])) if x is None or abs(x - y) > parity.TOL * abs(y)]
        bad += [f"rank {rank} {n}: {rel_err(t, ref['params'][n]):.1e}" for n, t in r["params"].items()
                if not rel_err(t, ref["params"][n]) <= parity.TOL]
    return bad


def test_ep2_checkpoint_with_its_expert_bias_resumes_at_ep2_and_ep1_exactly(tmp_path):
    from meshlm.checkpoint import dist as ckpt
    root = str(tmp_path)
    first, resumed = zip(*run_distributed(_saved_then_resumed, SAVED.world, root))
    ref, at_ep1, forgotten = run_distributed(_single_runs, 1, root)[0]
    # the bias is in the checkpoint, the same global tensor as the single process's at that step
    folder, single = (ckpt.checkpoint_dir(os.path.join(root, name)) for name in ("saved", "single"))
    keys = ["model/layers.0.mlp.router.expert_bias", "model/layers.2.mlp.router.expert_bias"]
    saved, want = ckpt.read_tensors(folder, keys), ckpt.read_tensors(single, keys)
    for key, bias in zip(keys, ref["biases"]):
        assert saved[key].abs().max() > 0 and torch.equal(saved[key], want[key]) and torch.equal(saved[key], bias)
    bad = _errors(list(resumed), ref) + _errors([at_ep1], ref)
    bad += [f"saved run step {i + 1}: {x} vs {y}" for i, (x, y) in enumerate(zip(first[0]["losses"], ref["losses"]))
            if abs(x - y) > parity.TOL * abs(y)]
    assert not bad, "\n".join(bad[:20])
    # the control: restarting the bias from zero changes the continuation (the test can fail)
    assert _errors([forgotten], ref), "a resume without the saved bias trains alike: the test proves nothing"
    print(f"losses after resume: {ref['losses'][SAVED_AT:]} (bias forgotten: {forgotten['losses']})")


def test_cp2_ep2_checkpoint_resumes_at_cp1_exactly(tmp_path):
    root = str(tmp_path)
    saved = Case(experts=4, moe=FLAGS, cp=2, ep=2, bucket=None)
    run_distributed(_train, saved.world, saved, root, None, SAVED_AT, "saved")
    ref, resumed = run_distributed(_cp1_runs, 1, root)[0]
    bad = _errors([resumed], ref)
    assert not bad, "\n".join(bad[:20])


def _cp1_runs(rank, world, root):
    """The uninterrupted single process, and its continuation from the CP = 2 checkpoint."""
    return (_train(rank, world, SINGLE, root, None, STEPS, None),
            _train(rank, world, SINGLE, root, "saved", STEPS - SAVED_AT, None))
