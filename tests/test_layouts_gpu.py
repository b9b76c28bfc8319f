"""Every 2-rank layout trains like one GPU in bf16 (issue 17): TP 2 + SP, PP 2 (1F1B, interleaved),
DP 2, the distributed optimizer with both overlaps, ZeRO-2 and ZeRO-3 (issue 26), CP 2 and EP 2 (MoE), over NCCL on 2 GPUs
(marker ``gpu``) and, for a few of them, over gloo on CPU processes (bf16 parameters there too).

The run is the production path: the flags parsed and validated as `meshlm pretrain` does, then
``trainer.build`` (process groups, model chunks from one seed, DP buffers and buckets, the
optimizer, LR schedule) and ``trainer.train_step`` STEPS times, on bf16 parameters with fp32
main_grads and masters and, on CUDA, the default fast path (compiled layers, fused AdamW). The data
(``Counting``: each sample counts up mod VOCAB from its own start) are learnt at once: at a constant
lr of 5e-3 the loss falls from ln 128 ≈ 4.85 by over 40% in STEPS steps, so the weights move far
beyond rounding, and a layout that computes another function or another update leaves the curve.

Tolerance (TOL, NORM_TOL): every loss, and the grad norm of the first step, within 2e-2 relative
of the one-GPU run of the same flags; later grad norms within 2.5e-1. bf16 keeps 8 significant bits
(unit roundoff u = 2^-8 ≈ 3.9e-3). Between layouts only the order and grouping of reductions
differs (TP partial sums of row-parallel GEMMs added in bf16, the sequence and vocabulary split,
CP's merge of attention blocks, the DP average of fp32 main_grads, the pipeline's micro-batch
order), so each activation differs by a few u, and the loss, a mean over 256 tokens a step, and the
first gradient (same weights) by less. The steps then carry those differences into the weights
(Adam divides each gradient by its own running scale, so a rounding-sized gradient difference can
move a weight by a fraction of lr), and they grow from step to step: 2e-2 ≈ 5u leaves the loss that
room over STEPS steps. The grad norm, a square root of a sum dominated by the largest gradients
while the model learns fast (it rises from 1.2 to 4.5 here, clipped at 1), follows the diverging
weights more steeply: in bf16 on CPU the largest differences over the 7 layouts were 0.73% in the
loss and 8.8% in the grad norm (both CP 2; TP 2 + SP 0.38% and 3.9%), hence 2.5e-1 after step 1.
A real fault does not fit: with the DP gradient reduction switched off (each rank stepping on its
own half of the batch) the loss leaves the band at step 2 and ends 34% high, and the grad norm is
24% off at step 1 (test_the_tolerance_catches_a_missing_gradient_reduction); a gradient counted
twice or half is a factor 2 in the grad norm. float64 parity at 1e-10 (tests/test_parity_matrix.py)
is the proof of each layout; this is the second check, on the real kernels and NCCL.
"""

from __future__ import annotations

import argparse
import functools
import traceback

import numpy as np
import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # multi-process: make test-quick leaves it out

STEPS, VOCAB, SEQ, GLOBAL_BATCH = 10, 128, 32, 8
TOL, NORM_TOL = 2e-2, 2.5e-1  # relative; the module docstring says why
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB), "--mock-data", "--split", "1,0,0",
         "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(STEPS),
         "--lr", "5e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--clip-grad", "1.0", "--bf16",
         "--log-interval", "1", "--eval-interval", "1000"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64"]
LAYOUTS = {  # name: (layout flags, model flags beyond MODEL)
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], []),
    "pp2-1f1b": (["--pipeline-model-parallel-size", "2"], []),
    "pp2-interleaved": (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], []),
    "dp2": ([], []),
    "dp2-zero1-overlap": (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], []),
    "dp2-zero2": (["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce"], []),
    "dp2-zero3-overlap": (["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                           "--overlap-param-gather"], []),
    "cp2": (["--context-parallel-size", "2"], []),
    "ep2": (["--expert-model-parallel-size", "2"], MOE),
}
CPU_LAYOUTS = ["tp2-sp", "dp2-zero1-overlap"]


class Counting:
    """GLOBAL_BATCH × STEPS samples: sample i counts (a + t) mod VOCAB for t = 0 … SEQ from a start a
    drawn by a generator seeded with i (the same samples in every layout); every token counts."""

    def __len__(self) -> int:
        return GLOBAL_BATCH * STEPS

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([5, i])
        ids = torch.from_numpy((rng.integers(VOCAB) + np.arange(SEQ + 1)) % VOCAB)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(SEQ)}


def _config(flags: list, world: int):
    from meshlm.config import add_config_args, config_from_args
    from meshlm.validate import validate
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(flags))
    validate(cfg, world=world, check_files=False)
    return cfg


def train(flags: list, world: int, tamper=None) -> dict:
    """{"losses", "norms"} of STEPS steps of ``meshlm pretrain FLAGS`` in this worker, on bf16
    parameters (build's choice on CUDA; asked for on CPU, where build would pick fp32).
    tamper(run), if given, is called before the first step (to plant a fault)."""
    from meshlm.training import trainer
    cfg = _config(flags, world)
    run = trainer.build(cfg, None if torch.cuda.is_available() else torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for c in run.chunks for p in c.parameters())
    run.train_ds = Counting()
    if tamper:
        tamper(run)
    norms, step = [], run.opt.step
    run.opt.step = lambda *a, **k: (lambda r: (norms.append(r.resolve().grad_norm), r)[1])(step(*a, **k))
    state = trainer.TrainState()
    losses = [trainer.train_step(run, state) for _ in range(STEPS)]
    run.opt.finish_param_sync()
    return {"losses": losses, "norms": norms}


def _worker(rank: int, world: int, runs: list) -> list:
    """train() of each flag list in turn; a failing one gives {"error": its traceback}."""
    out = []
    for flags in runs:
        try:
            out.append(train(flags, world))
        except Exception:
            out.append({"error": traceback.format_exc()})
    return out


def errors(got: dict, want: dict) -> list:
    """Lines naming each loss, and the first grad norm, farther than TOL (relative) from ``want``'s,
    and each later grad norm farther than NORM_TOL."""
    if "error" in got:
        return [got["error"]]
    return [f"step {i + 1} {what}: {a} vs {b} ({a / b - 1:+.2e})" for what in ("losses", "norms")
            for i, (a, b) in enumerate(zip(got[what], want[what]))
            if a is None or not abs(a - b) <= (TOL if what == "losses" or i == 0 else NORM_TOL) * abs(b)]


@functools.lru_cache(maxsize=None)
def results(backend: str, names: tuple) -> dict:
    """{name: (every rank's result, the one-process result of its model flags)} for the layouts."""
    models = sorted({tuple(LAYOUTS[n][1]) for n in names})
    (refs,) = run_distributed(_worker, 1, [MODEL + list(m) for m in models], backend=backend)
    ranks = run_distributed(_worker, 2, [MODEL + LAYOUTS[n][1] + LAYOUTS[n][0] for n in names], backend=backend)
    return {n: ([r[i] for r in ranks], refs[models.index(tuple(LAYOUTS[n][1]))]) for i, n in enumerate(names)}


def _check(backend: str, names: tuple, name: str) -> None:
    per_rank, ref = results(backend, names)[name]
    assert "error" not in ref, ref["error"]
    assert ref["losses"][-1] < 0.7 * ref["losses"][0], f"the model must learn: {ref['losses']}"
    bad = [f"rank {r}: {line}" for r, got in enumerate(per_rank) for line in errors(got, ref)]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_gpu_in_bf16_over_nccl(name):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check("nccl", tuple(LAYOUTS), name)


@pytest.mark.slow  # the first of them runs them all: ~60 s on 2 cores
@pytest.mark.parametrize("name", CPU_LAYOUTS)
def test_layout_matches_one_process_in_bf16_over_gloo(name):
    _check("gloo", tuple(CPU_LAYOUTS), name)


def _no_dp_reduction(run) -> None:
    run.ddp.finish_grad_sync = lambda *args: None  # each DP rank steps on its own half of the batch


def _faulty_dp2(rank, world):
    return train(MODEL, world, tamper=_no_dp_reduction)


@pytest.mark.slow  # two process starts: ~45 s on 2 cores
def test_the_tolerance_catches_a_missing_gradient_reduction():
    ((ref,),) = run_distributed(_worker, 1, [MODEL])
    bad = errors(run_distributed(_faulty_dp2, 2)[0], ref)
    assert any(" losses: " in e for e in bad) and any(e.startswith("step 1 norms") for e in bad), bad
