"""Same-call A/B of bench/moe_bench.py over source trees (issue 31): a change against its base on one
machine within minutes, since these GPUs are power-capped and vary from call to call (bench/RESULTS.md).

Usage (lent H200, repository root; a second tree copied into an ignored folder that the call carries):
    python bench/moe_ab.py "main|.|--cases learned --iters 30 --flags '--manual-gc'" \\
                           "branch|.carry-nd|--cases learned --iters 30 --flags '--manual-gc'" ...
Each spec is ``label|tree|moe_bench arguments`` (the arguments split as a shell would); each runs as its
own moe_bench process, in the order given, with ``PYTHONPATH=tree/src`` (the tree's meshlm and its
bench). Every case's figures go to ``--out``/ab.jsonl as one row (moe_bench's row plus ``label`` and
``tree``) as soon as it is measured, the logs' tails to ``--out``/ab.log, and a table (ms a step, MFU,
peak GiB, tokens/s of each case) to stdout as it goes; a spec that fails or passes ``--timeout`` (seconds)
is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time


def run(label: str, tree: str, args: list, scratch: str, timeout: float) -> tuple:
    """One moe_bench process; (its results row or None, the last lines of its output)."""
    results = os.path.join(scratch, f"{label}.jsonl")
    cmd = [sys.executable, os.path.join(tree, "bench", "moe_bench.py"), "--out", os.path.join(scratch, label),
           "--results", results, *args]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(tree, "src")))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    row = None
    if os.path.exists(results):
        with open(results) as fh:
            lines = [ln for ln in fh if ln.strip()]
        row = json.loads(lines[-1]) if lines else None
    return row, "\n".join(str(text).splitlines()[-15:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="+", help="label|tree|moe_bench arguments")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/moe-ab-out"))
    ap.add_argument("--scratch", default="/tmp/moe-ab")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a spec at most")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.scratch, exist_ok=True)
    print("| label | case | ms/step | MFU | peak GiB | tokens/s | wall s |\n|---|---|---|---|---|---|---|", flush=True)
    for spec in a.spec:
        label, tree, args = spec.split("|", 2)
        t0 = time.time()
        row, tail = run(label, tree, shlex.split(args), a.scratch, a.timeout)
        wall = time.time() - t0
        with open(os.path.join(a.out, "ab.log"), "a") as fh:
            fh.write(f"== {label} ({tree}: {args}) {wall:.0f} s\n{tail}\n")
        if row is None:
            print(f"| {label} | failed | | | | | {wall:.0f} |", flush=True)
            continue
        row.update(label=label, tree=tree, ab_args=args)
        with open(os.path.join(a.out, "ab.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
        for name, c in row["cases"].items():
            ms, mfu, peak, tps = (c.get(k) for k in ("iter_ms", "mfu", "peak_mem_gb", "tokens_per_sec"))
            print(f"| {label} | {name} | {ms or 0:.1f} | {mfu or 0:.4f} | {peak or 0:.2f} | {tps or 0:,.0f} | "
                  f"{wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
