"""The HTML page of a ``meshlm sweep`` (sweep.py): loss against LR, one curve per width, and the
table of every trial (diverged and failed ones marked). Self-contained like page.py's report."""

from __future__ import annotations

import math
from html import escape

from . import svg
from .page import CSS


def curves(rows: list) -> list:
    """One svg.Series per width and run length (a halving rung): (log10 lr, the best ok loss at
    that LR over the other swept flags)."""
    groups = sorted({(r["values"].get("hidden_size") or 0, r["iters"]) for r in rows})
    out = []
    for i, (w, iters) in enumerate(groups):
        best = {}
        for r in rows:
            if ((r["values"].get("hidden_size") or 0), r["iters"]) == (w, iters) and r["status"] == "ok":
                x = math.log10(r["values"]["lr"])
                best[x] = min(best.get(x, math.inf), r["loss"])
        name = f"width {w}, {iters} iters" if w else f"{iters} iters"
        out.append(svg.Series(name, sorted(best.items()), svg.color(i)))
    return out


def build(rows: list) -> str:
    """The page as one HTML string; rows: trials.jsonl's records (values, iters, status, loss, note)."""
    series = curves(rows)
    chart = (svg.line_chart("sweep-loss-lr", "loss against learning rate", series, "log10 lr", "loss")
             if svg.has_points(series) else '<div class="note" data-chart="sweep-loss-lr">no trial ended ok</div>')
    keys = sorted({k for r in rows for k in r["values"]})
    head = "".join(f"<th>{escape(k)}</th>" for k in keys + ["iters", "status", "loss", "note"])
    body = []
    for r in rows:
        cls = ' class="diverged"' if r["status"] != "ok" else ""
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        cells = [escape(str(r["values"].get(k, ""))) for k in keys] + [str(r["iters"]), r["status"], loss,
                                                                    escape(r["note"])]
        body.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>meshlm sweep</title>'
            f'<style>{CSS}</style></head><body><h1>meshlm sweep</h1><div class="charts">{chart}</div>'
            f'<h2>Trials</h2><table><tr>{head}</tr>{"".join(body)}</table></body></html>')


def write_page(path: str, rows: list) -> str:
    """Write ``build(rows)`` to ``path``; returns the path."""
    with open(path, "w") as f:
        f.write(build(rows))
    return path
