"""The μP transfer figure (issue 30) from its record: loss against learning rate, one curve per
width, μP and the standard parametrisation side by side, as one static SVG.

Reads the newest ``"bench": "mup_transfer"`` record of --results that carries per-trial losses
(``"losses": {"mup"|"standard": {width: {lr: loss or null}}}``, null: a diverged trial, not drawn;
bench/mup_transfer.py writes them) and writes --svg. The charts are meshlm's own (report/svg.py),
so the file needs nothing installed to build and opens in any browser.

Usage: PYTHONPATH=src python bench/mup_transfer_plot.py [--results bench/results.jsonl]
[--svg bench/mup_transfer.svg]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STYLE = ("text { font: 10px system-ui, sans-serif; fill: #333; } .title { font-size: 12px; font-weight: 600; } "
         ".frame { fill: none; stroke: #999; } .grid { stroke: #eee; }")
NAMES = {"mup": "μP", "standard": "standard parametrisation"}


def newest_record(path: str) -> dict:
    """The last mup_transfer record of ``path`` with per-trial losses.

    Raises SystemExit (one line) when there is none."""
    found = [r for r in map(json.loads, filter(str.strip, open(path)))
             if r.get("bench") == "mup_transfer" and "losses" in r]
    if not found:
        raise SystemExit(f"{path}: no mup_transfer record with per-trial losses; run bench/mup_transfer.py")
    return found[-1]


def figure(rec: dict) -> str:
    """One SVG: a chart per parametrisation (x: log2 lr, y: the trial's loss, a series per width)."""
    from meshlm.report import svg

    charts = []
    for k, name in NAMES.items():
        series = []
        for i, (w, row) in enumerate(sorted(rec["losses"][k].items(), key=lambda kv: int(kv[0]))):
            pts = sorted((math.log2(float(lr)), v) for lr, v in row.items() if v is not None)
            left = sum(v is None for v in row.values())
            series.append(svg.Series(f"width {w}" + (f" ({left} diverged)" if left else ""), pts, svg.color(i)))
        best = {w: v[0] for w, v in rec["best"][k].items()}
        title = f"{name}: best lr " + ", ".join(f"2^{math.log2(lr):.0f}" for _, lr in sorted(
            best.items(), key=lambda kv: int(kv[0])))
        charts.append(svg.line_chart(f"mup-transfer-{k}", title, series, "log2 lr", "validation loss"))
    w, h = svg.WIDTH, svg.HEIGHT
    head = (f"{rec['gpu']}, {rec['date']}: {rec['iters']} iterations, widths {rec['widths']}, "
            f"{'bf16' if rec.get('bf16') else 'fp32'}; best-LR spread μP {rec['spread']['mup']:.2g}×, "
            f"standard {rec['spread']['standard']:.2g}×")
    body = "".join(f'<g transform="translate({i * w} 20)">{c}</g>' for i, c in enumerate(charts))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" height="{h + 20}" '
            f'viewBox="0 0 {2 * w} {h + 20}"><style>{STYLE}</style><rect width="100%" height="100%" fill="#fff"/>'
            f'<text x="{w}" y="14" text-anchor="middle">{head}</text>{body}</svg>\n')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(HERE, "results.jsonl"))
    p.add_argument("--svg", default=os.path.join(HERE, "mup_transfer.svg"))
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    with open(args.svg, "w") as f:
        f.write(figure(newest_record(args.results)))
    print(args.svg)


if __name__ == "__main__":
    main()
