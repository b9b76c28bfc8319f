"""``meshlm report RUN_DIR [RUN_DIR …]``: one self-contained HTML page of one or more runs.

The page holds, per chart, one series per run (legend by run name): training and validation loss
against tokens, learning rate, grad norm, tokens/s and MFU against time, memory, exposed
communication share by kind, and each run's pipeline timeline of its last logged iteration with
the measured bubble beside the analytic one and, under it, the planner's predicted timeline for the
same layout. The analyzer's findings (planner/analyze.py, with the planner's predicted gains) stand
at the top. Everything is inline (CSS, SVG): no script, no external URL, so it opens
with the network off and can be mailed as one file. ``--trace`` also writes the timelines as a
Chrome/Perfetto trace (trace.py).
"""

from __future__ import annotations

import argparse
import math
import os
from html import escape
from typing import Optional

from . import svg
from .data import RunData, distinct_runs, load_run, overwrite_problem, unique_names
from .svg import Series
from .timeline import bubble_line, timeline_svg
from .trace import write_trace

CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 18px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 22px; }
.charts { display: flex; flex-wrap: wrap; gap: 10px; }
svg text { font-size: 10px; fill: #333; } svg .title { font-size: 12px; font-weight: 600; }
svg .frame { fill: none; stroke: #999; } svg .grid { stroke: #eee; }
svg .bar-label { fill: #fff; font-size: 9px; }
.note { width: 460px; height: 60px; border: 1px dashed #bbb; color: #777; padding: 8px; box-sizing: border-box; }
.finding { border-left: 4px solid #d62728; background: #fff5f5; padding: 6px 10px; margin: 6px 0; }
.diverged { color: #d62728; font-weight: 600; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
"""


def _comm_series(run: RunData, index: int) -> list:
    """Exposed-communication share of the step time by kind: a record's ``comm_s`` {kind: seconds
    per iteration} over iter_ms when present, else ``exposed_comm_share`` as "dp"."""
    kinds = sorted({k for r in run.train for k in (r.get("comm_s") or {})})
    if not kinds:
        return [Series(f"{run.name} dp", run.series("exposed_comm_share", "time"), svg.color(index))]
    out = []
    for j, kind in enumerate(kinds):
        pts, clock, last = [], 0.0, 0
        for r in run.train:
            clock += r["iter_ms"] * (r["iteration"] - last) / 1000.0
            last = r["iteration"]
            s = (r.get("comm_s") or {}).get(kind)
            if s is not None and r["iter_ms"] > 0:
                pts.append((clock, 1000.0 * s / r["iter_ms"]))
        out.append(Series(f"{run.name} {kind}", pts, svg.color(index + j * len(svg.PALETTE) // 2), j > 0))
    return out


def chart_specs(runs: list) -> list:
    """[(key, title, [Series], x label, y label, note when nothing is recorded)] for ``runs``."""
    def per_run(key, x="tokens", scale=1.0):
        return [Series(r.name, [(a, b * scale) for a, b in r.series(key, x)], svg.color(i))
                for i, r in enumerate(runs)]
    loss = []
    for i, r in enumerate(runs):
        loss.append(Series(f"{r.name} train", r.series("lm_loss"), svg.color(i)))
        loss.append(Series(f"{r.name} validation", r.series("val_loss", records=r.evals), svg.color(i), True))
    memory = []
    for i, r in enumerate(runs):
        memory.append(Series(f"{r.name} allocated", r.series("mem_allocated_gb", "time"), svg.color(i)))
        memory.append(Series(f"{r.name} peak", r.series("mem_max_allocated_gb", "time"), svg.color(i), True))
    return [
        ("loss", "loss", loss, "tokens", "nats", "no loss recorded"),
        ("lr", "learning rate", per_run("lr"), "tokens", "lr", "no learning rate recorded"),
        ("grad_norm", "grad norm", per_run("grad_norm"), "tokens", "global L2 norm", "no grad norm recorded"),
        ("tokens_per_sec", "throughput", per_run("tokens_per_sec", "time"), "seconds of training", "tokens/s",
         "no throughput recorded"),
        ("mfu", "model FLOPs utilisation", per_run("mfu", "time", 100.0), "seconds of training", "MFU %",
         "MFU not recorded: the device's bf16/fp16 peak is unknown (CPU, fp32 or an unlisted GPU)"),
        ("memory", "GPU memory of the logging rank", memory, "seconds of training", "GiB",
         "memory not recorded: CPU run (torch.cuda memory statistics only)"),
        ("comm", "exposed communication share", [s for i, r in enumerate(runs) for s in _comm_series(r, i)],
         "seconds of training", "share of step time", "no exposed communication recorded (DP × CP = 1)"),
    ]


def _findings_html(findings: Optional[list]) -> str:
    if not findings:
        return ""
    def get(f, k):
        return f.get(k, "") if isinstance(f, dict) else getattr(f, k, "")
    rows = "".join(f'<div class="finding"><b>{escape(str(get(f, "title")))}</b><br>{escape(str(get(f, "detail")))}'
                   f'<br><i>fix:</i> <code>{escape(str(get(f, "fix")))}</code></div>' for f in findings)
    return f'<section id="findings"><h2>Findings</h2>{rows}</section>'


def _summary(runs: list) -> str:
    head = "<tr><th>run</th><th>TP</th><th>PP</th><th>iterations</th><th>last loss</th><th>last val loss</th>" \
           "<th>iteration (ms)</th><th>tokens/s</th></tr>"
    rows = []
    for r in runs:
        p, last = r.config.get("parallel", {}), (r.train[-1] if r.train else {})
        val = r.evals[-1]["val_loss"] if r.evals else None
        cells = [p.get("tensor_model_parallel_size", "?"), p.get("pipeline_model_parallel_size", "?"),
                 last.get("iteration", 0), last.get("lm_loss"), val, last.get("iter_ms"), last.get("tokens_per_sec")]
        rows.append(f"<tr><td>{escape(r.name)}</td>" + "".join(f"<td>{_cell(c)}</td>" for c in cells) + "</tr>")
    return f'<table id="summary">{head}{"".join(rows)}</table>'


def _cell(value) -> str:
    """A summary table cell: n/a for None, NaN/inf marked as a diverged value, floats to 4 digits."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return f'<span class="diverged">{"NaN" if math.isnan(value) else f"{value:g}"} (diverged)</span>'
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _timelines(runs: list, predicted: Optional[dict]) -> str:
    out = []
    for r in runs:
        tl = r.last_timeline()
        if tl is None:
            out.append(f'<p class="note">{escape(r.name)}: no pipeline timeline (PP = 1)</p>')
            continue
        out.append(f'<h3>{escape(r.name)}: iteration {tl["iteration"]}</h3>'
                   f'<p class="bubble">{escape(bubble_line(tl["events"], tl["bubble"], r.pipeline["v"]))}</p>')
        out.append(timeline_svg(tl["events"], "measured", f"{r.name}: measured"))
        if predicted and predicted.get(r.name):
            out.append(timeline_svg(predicted[r.name], "predicted", f"{r.name}: predicted (planner)"))
    return '<section id="timeline"><h2>Pipeline timeline</h2>' + "".join(out) + "</section>"


def build_page(runs: list, findings: Optional[list] = None, predicted: Optional[dict] = None) -> str:
    """The report of ``runs`` (RunData) as one HTML string.

    findings: optional [{title, detail, fix}] (dicts or objects with those attributes), shown first.
    predicted: optional {run name: events} (timeline.py's event form, seconds) drawn under that
    run's measured timeline, e.g. the planner's prediction for the same layout.
    """
    charts = []
    for key, title, series, xl, yl, note in chart_specs(runs):
        if not svg.has_points(series) and svg.non_finite(series):
            note = f"only NaN/inf values recorded ({svg.non_finite(series)}: the run diverged); nothing to draw"
        charts.append(svg.line_chart(key, title, series, xl, yl) if svg.has_points(series) else
                      f'<div class="note" data-chart="{key}">{escape(title)}: {escape(note)}</div>')
    names = ", ".join(r.name for r in runs)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>meshlm report: {escape(names)}'
            f'</title><style>{CSS}</style></head><body><h1>meshlm report: {escape(names)}</h1>'
            f'{_findings_html(findings)}{_summary(runs)}<h2>Curves</h2><div class="charts">{"".join(charts)}</div>'
            f'{_timelines(runs, predicted)}</body></html>')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.jsonl)")
    parser.add_argument("--output", "-o", default=None,
                        help="HTML file to write (default: <first RUN_DIR>/report.html)")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write the pipeline timelines as a Chrome/Perfetto trace (JSON trace events)")
    parser.add_argument("--no-predict", action="store_true",
                        help="leave out the planner's predictions (fix gains, predicted pipeline timeline)")


def planner_views(runs: list, predict: bool = True) -> tuple:
    """(findings, predicted) for build_page: the analyzer's warn and info findings of every run
    (planner/analyze.py, each fix with the planner's predicted gain unless not ``predict``) as
    {title, detail, fix}, and {run name: the planner's predicted timeline} (planner/predict.py)
    for the runs with a pipeline timeline."""
    from ..planner.analyze import KIND_NAMES, analyze, fix_text, stop_finding
    from ..planner.predict import planner_predictor, run_timeline
    findings, predicted = [], {}
    for r in runs:
        if not r.train:
            continue
        predictor, note = planner_predictor(r.config, r.train) if predict else (None, None)
        stopped = stop_finding(os.path.join(r.path, "logs"))
        for f in [stopped] * bool(stopped) + analyze(r.train, r.config or None, predictor)["findings"]:
            if f["severity"] == "ok":
                continue
            fixes = "; ".join(fix_text(x) for x in f["fixes"]) or "none offered"
            findings.append({"title": f"{r.name}: {f['severity']}: {KIND_NAMES.get(f['kind'], f['kind'])}",
                             "detail": f["message"] + (f" ({note})" if note and any(
                                 x["predicted_gain"] is not None for x in f["fixes"]) else ""), "fix": fixes})
        if predict and r.last_timeline():
            events, _ = run_timeline(r.config, r.train)
            if events:
                predicted[r.name] = events
    return findings, predicted


def run(args: argparse.Namespace) -> int:
    """Write the report (and the trace); print where. DataError for a path that is not a run;
    ConfigError, before anything is written, for an output that cannot be written or would replace
    a file of a run (overwrite_problem)."""
    from ..errors import ConfigError
    from ..folders import output_file_problem, write_text_file
    runs, repeats = distinct_runs([load_run(p) for p in args.runs], args.runs)
    for note in repeats:
        print(f"meshlm: note: {note}", flush=True)
    unique_names(runs)
    out = args.output or os.path.join(runs[0].path, "report.html")
    flag = "--output" if args.output else "the report"
    problems = [p for p in (output_file_problem(flag, out), overwrite_problem(flag, out, runs, "report", "report.html"),
                            args.trace and output_file_problem("--trace", args.trace, "timeline.json"),
                            args.trace and overwrite_problem("--trace", args.trace, runs, "trace", "timeline.json"))
                if p]
    if args.trace and os.path.abspath(args.trace) == os.path.abspath(out):
        problems.append(f"--trace {args.trace} is also the report's file; give the trace another file "
                        f"(e.g. timeline.json)")
    if problems:  # before anything is written
        raise ConfigError(problems)
    findings, predicted = planner_views(runs, predict=not args.no_predict)
    write_text_file(out, build_page(runs, findings, predicted), flag)
    print(f"meshlm: report {out}", flush=True)
    if args.trace:
        timelines = [(r.name, tl["events"]) for r in runs if (tl := r.last_timeline())]
        if not timelines:
            print("meshlm: note: no run has a pipeline timeline (PP = 1): no trace written", flush=True)
            return 0
        write_trace(timelines, args.trace)
        print(f"meshlm: trace {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)", flush=True)
    return 0
