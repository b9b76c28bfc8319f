"""Checkpoints reshard: saved at TP=2 × PP=2 × DP=2 with the distributed optimizer, training goes on
at TP=1 × DP=4 (plain optimizer), TP=4 × DP=2 and DP=3 (ZeRO-1) exactly as an uninterrupted run.

Everything runs the production path (trainer.build / train_step / save_checkpoint /
load_checkpoint) in float64 on the parity model of tests/parity.py, Llama-flavoured to cover every
kind of piece: tied embeddings split over PP (the last stage's copy is read, never written),
fused QKV with GQA (2 groups: below TP=4) and SwiGLU stored as logical tensors, biases, a
vocabulary of 50 (not divisible by TP=4, padded at every TP > 1), ZeRO-1 shards that cut
parameters mid-row. The layouts compute the same function, so each continuation is compared
with one uninterrupted single-process run (losses, grad norms, every weight: 1e-10 relative).
"""

import os

import pytest
import torch

import parity
from distributed import run_distributed
from parity import Case, rel_err

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

STEPS, SAVED_AT, GLOBAL_BATCH = 4, 2, 12  # 12: DP 2, 3 and 4 all divide it
MODEL = dict(tied=True, pos="rope", norm="RMSNorm", swiglu=True, groups=2)
SAVED = Case(tp=2, pp=2, dp=2, dist_opt=True, bucket=None, **MODEL)  # one bucket: shards cut params
CONTINUATIONS = {
    "tp4-dp2-zero1": Case(tp=4, dp=2, dist_opt=True, bucket=300, **MODEL),  # world 8: run by the fixture
    "tp1-dp4-plain": Case(dp=4, bucket=None, **MODEL),
    "dp3-zero1": Case(dp=3, dist_opt=True, bucket=500, **MODEL),
}


class Data(parity.MaskedData):
    def __len__(self):
        return GLOBAL_BATCH * STEPS


def _train(rank, world, case, root, load, steps, save):
    """``steps`` train steps of ``case`` (after loading ``load`` if given), saving to ``save`` (if
    given) after step SAVED_AT; the losses, grad norms and full params at the end."""
    from meshlm.training import trainer
    cfg = parity.config(case, GLOBAL_BATCH)
    cfg.training.train_iters = STEPS
    cfg.checkpoint.load = load and os.path.join(root, load)
    cfg.checkpoint.save = save and os.path.join(root, save)
    run = trainer.build(cfg, dtype=torch.float64)
    run.train_ds = Data()
    state = trainer.load_checkpoint(run) if load else trainer.TrainState()
    norms, step = [], run.opt.step
    run.opt.step = lambda *a, **k: (lambda r: (norms.append(r.resolve().grad_norm), r)[1])(step(*a, **k))
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step(run, state))
        if save and state.iteration == SAVED_AT:
            trainer.save_checkpoint(run, state)
    run.opt.finish_param_sync()
    return {"iteration": state.iteration, "losses": losses, "norms": norms, "params": parity._full_params(run)}


def _continue(rank, world, case, root):
    return _train(rank, world, case, root, "saved", STEPS - SAVED_AT, None)


def _save_then_continue(rank, world, root):
    """The TP2×PP2×DP2 run's first steps and save; then, in the same 8 processes but from the
    files, the TP4×DP2 continuation (one process start fewer)."""
    first = _train(rank, world, SAVED, root, None, SAVED_AT, "saved")
    return first, _continue(rank, world, CONTINUATIONS["tp4-dp2-zero1"], root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, the TP2×PP2×DP2 run's first steps, the single-process reference: uninterrupted to
    STEPS, its checkpoint at SAVED_AT under "single", {continuation: its results} run already)."""
    root = str(tmp_path_factory.mktemp("reshard"))
    first, tp4 = zip(*run_distributed(_save_then_continue, SAVED.world, root))
    (ref,) = run_distributed(_train, 1, Case(bucket=None, **MODEL), root, None, STEPS, "single")
    return root, first, ref, {"tp4-dp2-zero1": list(tp4)}


def _close(a, b) -> bool:
    return abs(a - b) <= parity.TOL * abs(b)


def test_the_saved_tensors_are_the_single_process_checkpoint_s(saved):
    """Model space is layout-independent: every tensor the TP2×PP2×DP2 ZeRO-1 ranks wrote (model
    and optimizer state, global names and shapes) equals the one process's checkpoint at the
    same step, and both hold the same keys."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.safe_read import SafeReader
    root = saved[0]
    folders = [ckpt.checkpoint_dir(os.path.join(root, name)) for name in ("saved", "single")]
    keys = [{k for k in SafeReader(f).read_metadata().state_dict_metadata if not k.startswith("rng/")}
            for f in folders]
    assert keys[0] == keys[1]
    assert "model/layers.3.self_attention.linear_k.weight" in keys[0]
    assert "optimizer/params/layers.1.mlp.linear_fc1_gate.weight/exp_avg_sq" in keys[0]
    assert not [k for k in keys[0] if "output_layer" in k or "linear_qkv" in k or "@tp" in k]
    a, b = (ckpt.read_tensors(f, sorted(keys[0])) for f in folders)
    assert a["model/embedding.word_embeddings.weight"].shape == (parity.VOCAB, 16)  # unpadded
    bad = [k for k in a if a[k].shape != b[k].shape or not rel_err(a[k], b[k]) <= parity.TOL]
    assert not bad, bad[:5]


@pytest.mark.parametrize("name", list(CONTINUATIONS))
def test_training_continues_at_another_layout_as_if_uninterrupted(saved, name):
    root, first, ref, done = saved
    case = CONTINUATIONS[name]
    results = done.get(name) or run_distributed(_continue, case.world, case, root)
    bad = [f"saved run step {i + 1} loss: {x} vs {y}" for i, (x, y) in
           enumerate(zip(first[0]["losses"], ref["losses"])) if not _close(x, y)]
    for rank, r in enumerate(results):
        assert r["iteration"] == STEPS
        for what in ("losses", "norms"):
            bad += [f"rank {rank} step {SAVED_AT + i + 1} {what}: {x} vs {y}"
                    for i, (x, y) in enumerate(zip(r[what], ref[what][SAVED_AT:])) if x is None or not _close(x, y)]
        bad += [f"rank {rank} {n}: {rel_err(t, ref['params'][n.split(' (')[0]]):.1e}"
                for n, t in r["params"].items() if not rel_err(t, ref["params"][n.split(" (")[0]]) <= parity.TOL]
    assert not bad, "\n".join(bad[:20])
    assert set(ref["params"]) <= {n for r in results for n in r["params"]}
    assert len(results[0]["losses"]) == STEPS - SAVED_AT
    assert ref["losses"][0] != ref["losses"][-1]  # training moves: a restart from scratch would not match
