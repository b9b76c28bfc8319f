"""μP transfer (issue 30): the loss-optimal LR at widths 128, 512 and 2048 under μP and under the
standard parametrisation, on the embedded corpus (real text: the standard library's sources).

Each parametrisation is one `meshlm sweep` (meshlm/sweep.py), the two side by side: the same LR grid in factor-2 steps at
every width, a normal `meshlm pretrain` process per trial, one GPU each. μP runs with --use-mup
--mup-base-hidden-size 128 --mup-base-head-dim (the base head dim), the standard one without. The
claim (Tensor Programs V §1, Fig. 1): under μP the best LR stays within one grid step (a factor of 2)
across the widths; under the standard parametrisation it drifts down as the width grows.

Prints a table (width → best LR and its loss, per parametrisation), appends one record to --results
(default bench/results.jsonl: the best LRs, their spread and every trial's loss, which
bench/mup_transfer_plot.py draws) and writes the two sweeps' pages (loss against LR, one curve per width)
under --out. A killed run started again with the same --out goes on where it stopped (the sweeps'
trials.jsonl).

One GPU is enough: the trials share it, --slots at a time (default: the CPU cores less two, since a
trial of these widths is bound by its host's kernel launches, not by the GPU), every one on GPU 0
(``meshlm sweep`` gives slot i GPU i mod the GPUs). The corpus is prepared once, under --out/data
(or read from --data-dir), not by every trial; a trial runs one micro-batch of the whole global batch
and, by default, eagerly (``--fast-path off``): compiling every trial's layers would cost more than
its training.

Usage (the lent H200; 2 × 21 trials):
    PYTHONPATH=src python bench/mup_transfer.py --out $OUT/mup --bf16
CPU smoke test (seconds of training per trial):
    PYTHONPATH=src python bench/mup_transfer.py --out /tmp/t --widths 32,64 --lrs 1e-3,1e-2 --iters 2 --slots 2 --record no
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LRS = ",".join(f"{2.0 ** -k:.6g}" for k in range(11, 4, -1))  # 2^-11 … 2^-5: seven steps of 2


def corpus(args) -> list:
    """The trials' data flags: the embedded corpus, prepared once (``--data-dir`` if given, else
    under --out), so that no trial trains the tokenizer again."""
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    from meshlm.data.corpus import prepare_default_corpus
    found = prepare_default_corpus(args.data_dir or args.out)
    return ["--data-path", found["data_path"][0], "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", found["tokenizer_model"]]


def sweep(out: str, mup: bool, args, data: list) -> tuple:
    """Start (or resume) one parametrisation's sweep, half of --slots; (process, its trials.jsonl)."""
    folder = os.path.join(out, "mup" if mup else "standard")
    base = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--num-layers", "4",
            "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "32",
            "--global-batch-size", "32", "--lr-warmup-iters", str(max(1, args.iters // 10)), "--lr-decay-style",
            "cosine", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "10",
            "--eval-interval", str(args.iters), "--eval-iters", "4", "--fast-path", args.fast_path, *data] \
        + (["--bf16"] if args.bf16 else [])
    smallest = min(int(w) for w in args.widths.split(","))
    if mup:
        base += ["--use-mup", "--mup-base-hidden-size", str(smallest), "--mup-base-head-dim", str(smallest // 4)]
    cmd = [sys.executable, "-m", "meshlm", "sweep", "--lr", args.lrs, "--hidden-size", args.widths,
           "--train-iters", str(args.iters), "--sweep-dir", folder, "--spike-factor", "1.2",
           "--slots", str(max(1, (args.slots or max(2, (os.cpu_count() or 4) - 2)) // 2)), "--", *base]
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd), os.path.join(folder, "trials.jsonl")


def trials(path: str) -> list:
    """The records of a sweep's trials.jsonl (none when it has not started)."""
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.isfile(path) else []


def best_lrs(trials: list) -> dict:
    """{width: (best lr, its loss)} over the ok trials."""
    out = {}
    for r in trials:
        w = r["values"]["hidden_size"]
        if r["status"] == "ok" and (w not in out or r["loss"] < out[w][1]):
            out[w] = (r["values"]["lr"], r["loss"])
    return dict(sorted(out.items()))


def losses(trials: list) -> dict:
    """{width: {lr: loss}} of every trial (None: diverged or failed), for the record's plot
    (bench/mup_transfer_plot.py)."""
    out = {}
    for r in trials:
        out.setdefault(str(r["values"]["hidden_size"]), {})[f"{r['values']['lr']:.6g}"] = r["loss"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "out", "mup_transfer"))
    p.add_argument("--widths", default="128,512,2048")
    p.add_argument("--lrs", default=LRS)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--slots", type=int, default=None)
    p.add_argument("--bf16", action="store_true", help="train in bf16 (the GPU run)")
    p.add_argument("--fast-path", default="off", help="the trials' --fast-path (off: no compile per trial)")
    p.add_argument("--data-dir", default=None, help="where the prepared corpus is (or goes); default --out")
    p.add_argument("--record", choices=["yes", "no"], default="yes")
    p.add_argument("--results", default=os.path.join(HERE, "results.jsonl"), help="the file --record appends to")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = corpus(args)
    started = {name: sweep(args.out, name == "mup", args, data) for name in ("mup", "standard")}  # side by side
    for proc, _ in started.values():
        proc.wait()
    every = {name: trials(path) for name, (_, path) in started.items()}
    found = {name: best_lrs(rows) for name, rows in every.items()}
    print(f"{'width':>6} {'μP best lr':>11} {'loss':>7} {'SP best lr':>11} {'loss':>7}")
    for w in sorted(set(found["mup"]) | set(found["standard"])):
        m, s = found["mup"].get(w, (math.nan, math.nan)), found["standard"].get(w, (math.nan, math.nan))
        print(f"{w:>6} {m[0]:>11.3g} {m[1]:>7.4f} {s[0]:>11.3g} {s[1]:>7.4f}")
    spread = {k: (max(v[0] for v in b.values()) / min(v[0] for v in b.values())) if b else None
              for k, b in found.items()}
    print(f"best-LR spread over widths (max/min): μP {spread['mup']}, standard {spread['standard']} "
          f"(μP's claim: ≤ 2)")
    if args.record == "yes":
        import torch
        rec = {"date": datetime.date.today().isoformat(), "bench": "mup_transfer",
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "widths": args.widths, "lrs": args.lrs, "iters": args.iters, "corpus": "embedded",
               "slots": args.slots, "fast_path": args.fast_path, "bf16": args.bf16,
               "best": {k: {str(w): v for w, v in b.items()} for k, b in found.items()}, "spread": spread,
               "losses": {k: losses(rows) for k, rows in every.items()}}
        with open(args.results, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
