"""Checkpoint saves on one GPU: how long a save blocks the training loop, synchronous versus
--async-save, for the llama-1b model of bench/bench.py, with the distributed optimizer off and on.

Usage (on the lent H200 machine, from the repository root):
    PYTHONPATH=src python bench/ckpt_save.py --out $OUT [--steps 4] [--saves 2]
    PYTHONPATH=src python bench/ckpt_save.py --tiny        # smoke test on CPU: a tiny GPT, seconds

Per optimizer setting the run is built as `meshlm pretrain` builds it (trainer.build, --mock-data,
bf16 on the GPU) and trains --steps steps; then --saves synchronous saves and --saves background
saves (trainer.save_checkpoint, the production path), each after one more step:
- blocked: the save call's wall time, i.e. how long the loop waited (a background save's first
  call also allocates its pinned host buffers; later ones reuse them);
- written: from the save call until the checkpoint is complete (for a background save: the loop
  trains meanwhile, and "step while writing" is the median step time then, against "step", the
  median of the steps before the saves, which shows what the writer thread costs the loop);
- size: the checkpoint folder's bytes. Each checkpoint is deleted once measured (disk space).
Step times are wall clock with a CUDA sync on both sides. The table goes to stdout and to
<out>/ckpt_save.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import COMMON, LLAMA_1B  # noqa: E402  (the flags of bench/bench.py's llama-1b cases)

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "512", "--mock-data", "--lr", "1e-3"]


def _config(flags: list):
    from meshlm.cli import build_parser
    from meshlm.config import config_from_args
    from meshlm.validate import validate
    args = build_parser("pretrain").parse_args(["pretrain", *flags])
    cfg = config_from_args(args)
    validate(cfg, world=1, check_files=False)
    return cfg


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_step(run, state) -> float:
    from meshlm.training import trainer
    _sync()
    start = time.perf_counter()
    trainer.train_step(run, state)
    _sync()
    return time.perf_counter() - start


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(flags: list, save_dir: str, steps: int, saves: int) -> list:
    """[row for sync, row for async] of one optimizer setting (see the module docstring)."""
    import torch
    from meshlm.checkpoint.async_save import AsyncSaver
    from meshlm.training import trainer
    cfg = _config([*flags, "--save", save_dir])
    run = trainer.build(cfg)
    state = trainer.TrainState()
    steps_s = [_timed_step(run, state) for _ in range(steps)][1:] or [float("nan")]  # the first compiles
    rows = []
    for background in (False, True):
        run.saver = AsyncSaver(run.ps.world_size) if background else None
        blocked, written, during, size = [], [], [], 0
        for _ in range(saves):
            _timed_step(run, state)
            _sync()
            start = time.perf_counter()
            path = trainer.save_checkpoint(run, state)
            blocked.append(time.perf_counter() - start)
            if background:
                while run.saver.in_flight():
                    during.append(_timed_step(run, state))
                run.saver.wait()
            written.append(time.perf_counter() - start)
            size = _folder_bytes(path)
            shutil.rmtree(path)
        rows.append({"distributed_optimizer": cfg.parallel.use_distributed_optimizer,
                     "save": "async" if background else "sync", "blocked_s": blocked, "written_s": written,
                     "step_ms": 1000 * statistics.median(steps_s),
                     "step_while_writing_ms": 1000 * statistics.median(during) if during else None,
                     "steps_while_writing": len(during), "size_gib": size / 2**30})
    del run
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def table(rows: list) -> str:
    def secs(values):
        return " / ".join(f"{v:.3f}" for v in values)
    lines = ["| distributed optimizer | save | blocked s (each save) | written s (each save) | step ms | "
             "step ms while writing (steps) | checkpoint GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        during = "n/a" if r["step_while_writing_ms"] is None else \
            f"{r['step_while_writing_ms']:.1f} ({r['steps_while_writing']})"
        lines.append(f"| {'on' if r['distributed_optimizer'] else 'off'} | {r['save']} | {secs(r['blocked_s'])} | "
                     f"{secs(r['written_s'])} | {r['step_ms']:.1f} | {during} | {r['size_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the checkpoints and ckpt_save.md go "
                    "(default: a temporary folder, removed)")
    ap.add_argument("--steps", type=int, default=4, help="training steps before the saves")
    ap.add_argument("--saves", type=int, default=2, help="saves of each kind")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (CPU smoke test)")
    args = ap.parse_args()
    model = TINY if args.tiny else [*LLAMA_1B["flags"], *COMMON]
    flags = [*model, "--micro-batch-size", "2" if args.tiny else "4", "--global-batch-size", "2" if args.tiny else "4",
             "--train-iters", "100000", "--log-interval", "100000", "--eval-interval", "100000", "--eval-iters", "0"]
    out = args.out or tempfile.mkdtemp(prefix="ckpt_save-")
    rows = []
    for dist_opt in (False, True):
        rows += measure(flags + (["--use-distributed-optimizer"] if dist_opt else []),
                        os.path.join(out, f"ckpt-distopt-{dist_opt}"), args.steps, args.saves)
    text = table(rows)
    print(text, flush=True)
    if args.out:
        with open(os.path.join(out, "ckpt_save.md"), "w") as fh:
            fh.write(text + "\n")
    else:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
