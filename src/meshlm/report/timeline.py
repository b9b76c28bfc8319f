"""The pipeline timeline as SVG: one row per pipeline rank, one bar per forward (F) and backward
(B) of each micro-batch and model chunk, placed at its measured (or predicted) start and end.

Events are the dicts ``training/trainer.py`` logs as ``pipeline_timeline`` (``pipeline.forward_
backward``'s timeline, tagged with the pipeline rank): {"stage": pipeline rank, "chunk": local
model chunk, "mb": micro-batch, "kind": "F" | "B", "start", "end": seconds}. A predicted
timeline (the planner's) is drawn by the same function from events of the same form.
"""

from __future__ import annotations

from html import escape

from ..parallel.schedules import analytic_bubble_fraction

KIND_COLORS = {"F": ("#4c8bd6", "#9dc1ee"), "B": ("#3aa65b", "#97d6a9")}  # chunk 0, chunk ≥ 1
ROW, LABEL, WIDTH = 30, 70, 940


def shape(events: list) -> dict:
    """{"pp": pipeline rows, "m": micro-batches, "v": model chunks per rank} seen in ``events``."""
    return {"pp": 1 + max(e["stage"] for e in events), "m": 1 + max(e["mb"] for e in events),
            "v": 1 + max(e.get("chunk", 0) for e in events)}


def analytic_bubble(pp: int, m: int, v: int = 1) -> dict:
    """The bubble of equal-cost stages (Narayanan et al. 2021 §2.2): (p − 1)/(v·m) of the compute
    time, which is (p − 1)/(v·m + p − 1) of the step's wall time (the measured one's unit)."""
    return {"of_compute": (pp - 1) / (v * m), "of_wall": analytic_bubble_fraction(pp, m, v)}


def timeline_svg(events: list, key: str = "measured", title: str = "") -> str:
    """``<svg class="timeline" data-timeline=KEY>`` with a ``<g class="stage" data-stage=R
    data-bars=N>`` row per pipeline rank and a ``<rect class="bar" data-kind data-mb data-chunk>``
    per event (its <title> gives the times in ms). ValueError for an empty ``events``."""
    if not events:
        raise ValueError("timeline_svg needs at least one event")
    s = shape(events)
    t0 = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - t0 or 1.0
    height = 34 + ROW * s["pp"] + 26
    scale = (WIDTH - LABEL - 10) / span
    out = [f'<svg class="timeline" data-timeline="{escape(key)}" '
           f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">',
           f'<text x="{LABEL}" y="16" class="title">{escape(title)}</text>']
    for stage in range(s["pp"]):
        y = 28 + ROW * stage
        mine = sorted((e for e in events if e["stage"] == stage), key=lambda e: e["start"])
        bars = []
        for e in mine:
            x, w = LABEL + (e["start"] - t0) * scale, max((e["end"] - e["start"]) * scale, 0.8)
            fill = KIND_COLORS[e["kind"]][min(e.get("chunk", 0), 1)]
            name = f'{"forward" if e["kind"] == "F" else "backward"} mb {e["mb"]}' + \
                (f' chunk {e["chunk"]}' if s["v"] > 1 else "")
            label = f'<text x="{x + w / 2:.1f}" y="{y + 17}" text-anchor="middle" class="bar-label">' \
                    f'{e["kind"]}{e["mb"]}</text>' if w > 18 else ""
            bars.append(f'<rect class="bar" data-kind="{e["kind"]}" data-mb="{e["mb"]}" '
                        f'data-chunk="{e.get("chunk", 0)}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" '
                        f'height="{ROW - 6}" fill="{fill}"><title>{name}: {1000 * (e["start"] - t0):.2f}–'
                        f'{1000 * (e["end"] - t0):.2f} ms</title></rect>{label}')
        out.append(f'<g class="stage" data-stage="{stage}" data-bars="{len(mine)}">'
                   f'<text x="4" y="{y + 19}">stage {stage}</text>{"".join(bars)}</g>')
    axis_y = 28 + ROW * s["pp"] + 14
    out.append(f'<text x="{LABEL}" y="{axis_y}">0 ms</text><text x="{WIDTH - 10}" y="{axis_y}" '
               f'text-anchor="end">{1000 * span:.1f} ms</text></svg>')
    return "".join(out)


def bubble_line(events: list, measured, v: int) -> str:
    """One sentence: the measured bubble (share of the step's wall time idle, averaged over the
    stages) beside the analytic one for this p, m and v."""
    s = shape(events)
    v = max(v, s["v"])
    a = analytic_bubble(s["pp"], s["m"], v)
    formula = f"(p−1)/(v·m) = {s['pp'] - 1}/({v}·{s['m']})" if v > 1 else f"(p−1)/m = {s['pp'] - 1}/{s['m']}"
    got = "not recorded" if measured is None else f"{100 * measured:.1f}% of the wall time of the step"
    return (f"measured bubble: {got}; analytic (equal-cost stages) {formula} = {100 * a['of_compute']:.1f}% "
            f"of the compute time, i.e. {100 * a['of_wall']:.1f}% of the wall time")
