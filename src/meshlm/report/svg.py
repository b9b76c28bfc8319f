"""Hand-made SVG line charts (no plotting library: the page stays one small file that needs
nothing installed to build and no network to view).

Each chart is ``<svg class="chart" data-chart=KEY>``; each series one ``<g class="series"
data-series=NAME data-points=N>`` holding a polyline (and a dot per point), so a test or a
reader's script can count what was drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
WIDTH, HEIGHT = 460, 260
LEFT, RIGHT, TOP, BOTTOM = 62, 12, 28, 40


@dataclass
class Series:
    """One line: ``points`` [(x, y)] in data units; dashed for a secondary quantity (validation)."""

    name: str
    points: list
    color: str
    dashed: bool = False


def color(index: int) -> str:
    """The colour of the index-th run (cycling through PALETTE)."""
    return PALETTE[index % len(PALETTE)]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 × 10^k)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = [round(first, 12)]
    while ticks[-1] < hi - step * 1e-9:
        ticks.append(round(first + step * len(ticks), 12))
    return ticks


def fmt(v: float) -> str:
    """A tick label: 12k, 3.4M, 0.002, 1.5e-05 …"""
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a == 0 or a >= 1e-3:
        return f"{v:.4g}"
    return f"{v:.1e}"


def finite(series: Series) -> Series:
    """``series`` without its points whose x or y is NaN or infinite (a diverged run's values);
    its name then says how many were left out."""
    kept = [(x, y) for x, y in series.points if math.isfinite(x) and math.isfinite(y)]
    left = len(series.points) - len(kept)
    name = f"{series.name} ({left} NaN/inf not drawn)" if left else series.name
    return Series(name, kept, series.color, series.dashed)


MAX_POINTS = 1000  # a series drawn with more: its lowest and highest point of each of MAX_POINTS / 2 runs


def thin(series: Series, limit: int = MAX_POINTS) -> Series:
    """``series`` with at most ``limit`` points: consecutive runs of points each reduced to their
    lowest and highest (in x order), so a spike survives. A 100,000-iteration run logged every
    step drew every point (and a dot each) in each chart: a 33 MB page for a 460-pixel-wide chart."""
    pts = series.points
    if len(pts) <= limit:
        return series
    runs = limit // 2
    kept = []
    for i in range(runs):
        run = pts[i * len(pts) // runs:(i + 1) * len(pts) // runs]
        ends = sorted({min(range(len(run)), key=lambda j: run[j][1]), max(range(len(run)), key=lambda j: run[j][1])})
        kept += [run[j] for j in ends]
    return Series(series.name, kept, series.color, series.dashed)


def line_chart(key: str, title: str, series: list, x_label: str, y_label: str) -> str:
    """An SVG line chart of ``series`` (those without finite points are left out of the plot and
    the legend; NaN/inf points are skipped, see ``finite``; more than ``MAX_POINTS`` are thinned,
    see ``thin``); the caller shows a note instead when none has a finite point (see ``has_points``)."""
    drawn = [thin(s) for s in map(finite, series) if s.points]
    xs = [x for s in drawn for x, _ in s.points]
    ys = [y for s in drawn for _, y in s.points]
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x):
        return LEFT + (x - x0) / (x1 - x0 or 1) * pw

    def py(y):
        return TOP + ph - (y - y0) / (y1 - y0 or 1) * ph

    out = [f'<svg class="chart" data-chart="{escape(key)}" '
           f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">',
           f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="title">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="frame"/>']
    for t in xt:
        out.append(f'<line x1="{px(t):.1f}" y1="{TOP}" x2="{px(t):.1f}" y2="{TOP + ph}" class="grid"/>'
                   f'<text x="{px(t):.1f}" y="{TOP + ph + 14}" text-anchor="middle">{fmt(t)}</text>')
    for t in yt:
        out.append(f'<line x1="{LEFT}" y1="{py(t):.1f}" x2="{LEFT + pw}" y2="{py(t):.1f}" class="grid"/>'
                   f'<text x="{LEFT - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(12 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    for s in drawn:
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        dots = "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{s.color}"/>'
                       for x, y in s.points)
        out.append(f'<g class="series" data-series="{escape(s.name)}" data-points="{len(s.points)}">'
                   f'<title>{escape(s.name)}</title><polyline points="{pts}" fill="none" '
                   f'stroke="{s.color}" stroke-width="1.6"{dash}/>{dots}</g>')
    out.append(_legend(drawn))
    out.append("</svg>")
    return "".join(out)


def _legend(series: list) -> str:
    rows = []
    for i, s in enumerate(series):
        y = TOP + 12 + 14 * i
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        rows.append(f'<line x1="{LEFT + 8}" y1="{y - 4}" x2="{LEFT + 26}" y2="{y - 4}" stroke="{s.color}" '
                    f'stroke-width="2"{dash}/><text x="{LEFT + 30}" y="{y}" class="legend">'
                    f'{escape(s.name)}</text>')
    return f'<g class="legend">{"".join(rows)}</g>'


def has_points(series: list) -> bool:
    """Whether any of ``series`` has a point to draw (a finite one)."""
    return any(finite(s).points for s in series)


def non_finite(series: list) -> int:
    """How many points of ``series`` are NaN or infinite (not drawn)."""
    return sum(len(s.points) - len(finite(s).points) for s in series)
