"""Usage: same_losses.py FULL CUT REST — the run dirs of an uninterrupted run, a stopped one and its resumption.

Exits 1 (naming the first iteration that differs) unless CUT's iterations and REST's, together,
are exactly FULL's with the same lm loss bit for bit, the stop falling strictly inside the run.
"""

import json
import os
import sys


def losses(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "logs", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def main(full: str, cut: str, rest: str) -> int:
    whole, first, second = losses(full), losses(cut), losses(rest)
    stop = max(first, default=0)
    if not 0 < stop < max(whole) or min(second, default=0) != stop + 1:
        print(f"ci: the stop (after iteration {stop}) and the resumption (from {min(second, default=None)}) "
              f"do not split the {max(whole)} iterations")
        return 1
    joined = {**first, **second}
    for it in sorted(whole):
        if joined.get(it) != whole[it]:
            print(f"ci: iteration {it}: lm loss {joined.get(it)} after the stop and resume, {whole[it]} uninterrupted")
            return 1
    print(f"ci: stopped after iteration {stop} by SIGTERM, resumed in a second container: "
          f"{len(whole)} losses equal to the uninterrupted run's")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
