"""meshlm report's pieces on synthetic data: charts, timeline, trace, findings, profiling flags,
progress bar. The report of real runs (and Chromium) is tests/test_report_run.py."""

import io
import json

import pytest

from meshlm import profile_ranges
from meshlm.config import Config
from meshlm.errors import DataError
from meshlm.parallel.schedules import analytic_bubble_fraction, compute_order
from meshlm.report import page, svg, timeline, trace
from meshlm.report.data import RunData, load_run
from meshlm.training import profiling, progress
from report_html import parse_html


def schedule_events(pp, m, v=1, name="1f1b"):
    """F/B events of every rank, one time unit per action in the rank's own order (layout only)."""
    events = []
    for rank in range(pp):
        t = float(rank)
        for group in compute_order(name, pp, rank, m, v):
            for a in group:
                events.append({"stage": rank, "chunk": a.chunk, "mb": a.mb, "kind": a.kind,
                               "start": t, "end": t + 0.9})
                t += 1.0
    return events


@pytest.mark.parametrize("pp,m,v,name", [(2, 4, 1, "1f1b"), (3, 6, 1, "gpipe"), (2, 4, 2, "interleaved")])
def test_timeline_has_one_row_per_stage_and_an_f_and_b_bar_per_microbatch_chunk(pp, m, v, name):
    doc = parse_html(timeline.timeline_svg(schedule_events(pp, m, v, name)))
    rows = doc.find_all("g", "stage")
    assert [r.attrs["data-stage"] for r in rows] == [str(s) for s in range(pp)]
    for r in rows:
        bars = r.find_all("rect", "bar")
        assert len(bars) == int(r.attrs["data-bars"]) == 2 * m * v
        assert sorted((b.attrs["data-kind"], b.attrs["data-mb"], b.attrs["data-chunk"]) for b in bars) == \
            sorted((k, str(mb), str(c)) for k in "FB" for mb in range(m) for c in range(v))


def test_analytic_bubble_is_narayanans_and_the_schedules_module_s():
    a = timeline.analytic_bubble(4, 8, 2)
    assert a["of_compute"] == pytest.approx(3 / 16)
    assert a["of_wall"] == analytic_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    line = timeline.bubble_line(schedule_events(2, 4), 0.3, 1)
    assert "30.0%" in line and "(p−1)/m = 1/4 = 25.0%" in line and "20.0% of the wall time" in line


def test_trace_is_chrome_json_with_one_process_per_stage_and_complete_events(tmp_path):
    events = schedule_events(3, 4)
    path = tmp_path / "t.json"
    trace.write_trace([("a", events), ("b", schedule_events(2, 2))], str(path))
    d = json.loads(path.read_text())
    evs = d["traceEvents"]
    assert {e["ph"] for e in evs} == {"X", "M"}
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "a stage 0", 1: "a stage 1", 2: "a stage 2", 1000: "b stage 0", 1001: "b stage 1"}
    xs = [e for e in evs if e["ph"] == "X" and e["pid"] < 1000]
    assert len(xs) == 2 * 4 * 3 and {e["tid"] for e in xs} == {1, 2}
    first = min(events, key=lambda e: (e["stage"], e["start"]))
    x0 = next(e for e in xs if e["pid"] == 0 and e["ts"] == 0)
    assert x0["name"] == f'{first["kind"]}{first["mb"]}' and x0["dur"] == pytest.approx(0.9e6)


def _run(name, records, evals=(), pp=2):
    return RunData(name=name, path=name, train=list(records), evals=list(evals),
                   config={"model": {"seq_length": 8}, "parallel": {"pipeline_model_parallel_size": pp}})


def _records(n, **extra):
    return [dict({"iteration": i, "consumed_samples": 4 * i, "lm_loss": 5.0 - 0.1 * i, "lr": 1e-3,
                  "grad_norm": 1.0, "iter_ms": 100.0, "tokens_per_sec": 320.0}, **extra) for i in range(1, n + 1)]


def test_comm_share_by_kind_from_comm_s_else_exposed_comm_share_as_dp():
    by_kind = _run("a", _records(3, comm_s={"dp": 0.01, "tp": 0.02}))
    dp_only = _run("b", _records(3, exposed_comm_share=0.25))
    specs = {k: s for k, _, s, *_ in page.chart_specs([by_kind, dp_only])}
    series = {s.name: s.points for s in specs["comm"]}
    assert [c for p in series["a dp"] for c in p] == pytest.approx([0.1, 0.1, 0.2, 0.1, 0.3, 0.1])
    assert [y for _, y in series["a tp"]] == [pytest.approx(0.2)] * 3
    assert [y for _, y in series["b dp"]] == [0.25] * 3
    # tokens = consumed samples × seq length
    assert {s.name: s.points for s in specs["loss"]}["a train"][0] == (32.0, 4.9)


def test_page_has_findings_first_one_series_per_run_and_a_predicted_timeline():
    runs = [_run("a", _records(4, pipeline_timeline=schedule_events(2, 2), bubble_fraction=0.4),
                 [{"iteration": 4, "consumed_samples": 16, "val_loss": 4.0}]),
            _run("b", _records(2))]
    findings = [{"title": "DP comm exposed", "detail": "<40% of the step>", "fix": "--overlap-grad-reduce"}]
    html = page.build_page(runs, findings, predicted={"a": schedule_events(2, 2)})
    doc = parse_html(html)
    assert html.index('id="findings"') < html.index('id="summary"') and "&lt;40% of the step&gt;" in html
    charts = {c.attrs["data-chart"]: c for c in doc.find_all("svg", "chart")}
    assert [g.attrs["data-series"] for g in charts["lr"].find_all("g", "series")] == ["a", "b"]
    assert [g.attrs["data-series"] for g in charts["loss"].find_all("g", "series")] == \
        ["a train", "a validation", "b train"]
    assert {d.attrs["data-chart"] for d in doc.find_all("div", "note")} == {"mfu", "memory", "comm"}
    assert [t.attrs["data-timeline"] for t in doc.find_all("svg", "timeline")] == ["measured", "predicted"]
    assert "http://" not in html and "https://" not in html


def test_load_run_names_a_missing_run_and_a_bad_line(tmp_path):
    with pytest.raises(DataError, match="no logs/metrics.jsonl"):
        load_run(str(tmp_path))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text(json.dumps(_records(1)[0]) + "\n{oops\n")
    with pytest.raises(DataError, match="line 2: not JSON"):
        load_run(str(tmp_path))
    corpus = tmp_path / "corpus.jsonl"  # a jsonl that is not a metrics file: one line naming it
    corpus.write_text('{"text": "hello"}\n{"text": "world"}\n')
    with pytest.raises(DataError, match=f"^{corpus}: not a meshlm metrics file"):
        load_run(str(corpus))


def test_nice_ticks_cover_the_range():
    for lo, hi in [(4.845, 4.87), (1e-4, 6e-4), (0, 1), (100, 512), (3, 3)]:
        t = svg.nice_ticks(lo, hi)
        assert t[0] <= lo and t[-1] >= hi and len(t) >= 2


def test_profiling_flag_checks_and_notes():
    cfg = Config()
    lg = cfg.logging
    lg.profile, lg.profile_step_start, lg.profile_step_end, lg.profile_ranks = True, 5, 5, [0, 7]
    problems = profiling.problems(cfg, 4)
    assert any("--profile-step-end 5 must be greater" in p for p in problems)
    assert any("--profile-ranks 7: no such rank" in p for p in problems)
    lg.profile, lg.nvtx_ranges = False, True
    assert profiling.notes(cfg) == ["--nvtx-ranges --profile-ranks ignored without --profile (as in Megatron); "
                                    "add --profile"]


def test_annotate_is_the_shared_null_context_when_profiling_is_off():
    assert profile_ranges.annotate("F", 0) is profile_ranges.annotate("optimizer step") is profile_ranges.NULL


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_on_the_terminal_only_and_clears_before_lines(monkeypatch):
    term, log = _Terminal(), _Terminal()
    monkeypatch.setattr("sys.stdout", log)
    bar = progress.for_run(True, 10, 0, terminal=term)
    assert isinstance(bar, progress.ProgressBar)
    bar.update(1, 5.5)
    bar.update(10, 5.25)
    print(" iteration 10/10 | lm loss ...")
    bar.close()
    shown = term.getvalue()
    assert "10/10" in shown and "ETA 0:00" in shown and "lm loss 5.25" in shown and "\x1b[2K" in shown
    assert log.getvalue() == " iteration 10/10 | lm loss ...\n"  # no bar in the log
    assert progress.for_run(False, 10, 0, terminal=term).__class__.__name__ == "_NoBar"
    assert progress.for_run(True, 10, 0, terminal=io.StringIO()).__class__.__name__ == "_NoBar"


def test_report_command_puts_the_analyzers_findings_first_and_the_planners_timeline_beside_the_measured(
        tmp_path, capsys):
    from meshlm import cli
    from meshlm.config import dump_yaml
    from test_trainer import tiny_config
    cfg = tiny_config(str(tmp_path), pp=2, micro=1, global_batch=4)  # 4 micro-batches of 1
    dump_yaml(cfg, str(tmp_path / "config.yaml"))
    measured = schedule_events(2, 4)
    records = _records(4, pipeline_timeline=measured, bubble_fraction=0.45, comm_share={"pp": 0.3},
                       world_size=2, device="cpu")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["report", str(tmp_path), "--output", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    doc = parse_html(html)
    [block] = doc.find_all("section")[:1]
    assert block.attrs["id"] == "findings" and "pipeline bubble" in html and "45% of the step" in html
    assert "(planner: " in html  # the bubble fixes carry the planner's predicted gain
    tls = {t.attrs["data-timeline"]: t for t in doc.find_all("svg", "timeline")}
    assert set(tls) == {"measured", "predicted"}
    for kind in ("measured", "predicted"):
        rows = tls[kind].find_all("g", "stage")
        assert [r.attrs["data-bars"] for r in rows] == ["8", "8"]  # F and B of 4 micro-batches a stage
    assert cli.main(["report", str(tmp_path), "--output", str(tmp_path / "n.html"), "--no-predict"]) == 0
    plain = (tmp_path / "n.html").read_text()
    assert 'data-timeline="predicted"' not in plain and "(planner: " not in plain and 'id="findings"' in plain


def test_report_refuses_to_overwrite_a_file_of_the_run_and_replaces_its_own_earlier_output(tmp_path, capsys):
    from meshlm import cli
    (tmp_path / "logs").mkdir()
    metrics = tmp_path / "logs" / "metrics.jsonl"
    kept = "".join(json.dumps(r) + "\n" for r in _records(2, pipeline_timeline=schedule_events(2, 2)))
    metrics.write_text(kept)
    (tmp_path / "config.yaml").write_text("model: {seq_length: 8}\n")
    (tmp_path / "logs" / "rank0.log").write_text("worker log\n")
    for flags in (["--output", str(metrics)], ["--trace", str(tmp_path / "config.yaml")],
                  ["--output", str(tmp_path / "logs" / "rank0.log")], ["--trace", str(metrics)]):
        assert cli.main(["report", str(tmp_path), "--no-predict", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"meshlm: error: {flags[0]} ") and "give another file" in err[0]
        if flags == ["--output", str(metrics)]:
            assert "is the metrics.jsonl the report reads" in err[0]
    assert metrics.read_text() == kept and (tmp_path / "config.yaml").read_text() == "model: {seq_length: 8}\n"
    assert (tmp_path / "logs" / "rank0.log").read_text() == "worker log\n"
    assert not (tmp_path / "report.html").exists()
    # the report's own earlier outputs (and new files) may be written, and written again
    for _ in range(2):
        assert cli.main(["report", str(tmp_path), "--no-predict", "--output", str(tmp_path / "r.html"),
                         "--trace", str(tmp_path / "t.json")]) == 0
    assert cli.main(["report", str(tmp_path), "--no-predict", "--output", str(tmp_path / "r.html"),
                     "--trace", str(tmp_path / "r.html")]) == 2
    assert "--trace" in capsys.readouterr().err


def test_a_run_given_twice_is_shown_once_with_a_note(tmp_path, capsys):
    """`report run1 run1` drew every series twice (legend "run1", "run1 (2)") and said nothing."""
    from meshlm import cli
    run = tmp_path / "run1"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(2)))
    out = tmp_path / "r.html"
    assert cli.main(["report", str(run), str(run / "logs" / "metrics.jsonl"), "--no-predict", "-o", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 1 and "is the run" in notes[0] and "shown once" in notes[0]
    assert "run1 (2)" not in out.read_text() and "run1" in out.read_text()


@pytest.mark.parametrize("flag", ["--output", "--trace"])
def test_report_refuses_to_overwrite_any_other_file_but_an_empty_one(tmp_path, capsys, flag):
    """Only the reported runs' files were protected: --output another_run/logs/metrics.jsonl, a
    checkpoint's tracker or a corpus was replaced by the report."""
    from meshlm import cli
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(2)))
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    tracker.parent.mkdir()
    tracker.write_text("8\n")
    assert cli.main(["report", str(run), "--no-predict", flag, str(tracker)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"meshlm: error: {flag} {tracker} exists and is not an earlier meshlm {flag[2:].replace('output', 'report')}: "
        f"refusing to overwrite it; give another file (e.g. {'report.html' if flag == '--output' else 'timeline.json'}), "
        f"or remove it first")
    assert tracker.read_text() == "8\n"
    empty = tmp_path / "empty"
    empty.write_text("")
    assert cli.main(["report", str(run), "--no-predict", flag, str(empty)]) == 0


@pytest.mark.parametrize("form", ["strings", "bare tokens"])
def test_a_run_whose_validation_loss_is_nan_is_reported_and_analyzed(tmp_path, capsys, form):
    """Its report crashed with a ValueError (nice_ticks of NaN); old files hold bare NaN, new ones "NaN"."""
    from importlib import import_module

    from meshlm import cli
    records = [dict(r, lm_loss=None, grad_norm=float("inf")) for r in _records(3)]
    records += [{"iteration": 0, "consumed_samples": 0, "val_loss": float("nan"), "val_ppl": float("nan")},
                {"iteration": 3, "consumed_samples": 12, "val_loss": float("nan"), "val_ppl": float("nan")}]
    dump = json.dumps if form == "bare tokens" else import_module("meshlm.metrics_json").dumps
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(dump(r) + "\n" for r in records))
    assert cli.main(["report", str(tmp_path), "--no-predict"]) == 0
    html = (tmp_path / "report.html").read_text()
    summary = html[html.index('<table id="summary">'):html.index("</table>")]
    assert '<span class="diverged">NaN (diverged)</span>' in summary  # the last validation loss
    notes = {d.attrs["data-chart"]: d.text for d in parse_html(html).find_all("div", "note")}
    assert notes["loss"] == "loss: only NaN/inf values recorded (2: the run diverged); nothing to draw"
    assert "only NaN/inf values recorded (3: " in notes["grad_norm"]  # every grad norm is inf
    capsys.readouterr()
    assert cli.main(["analyze", str(tmp_path), "--no-predict", "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda token: pytest.fail(f"bare {token}"))


def test_a_chart_skips_non_finite_points_and_says_how_many():
    s = svg.Series("a", [(1.0, 2.0), (2.0, float("nan")), (3.0, float("inf")), (4.0, 1.0)], "#000")
    doc = parse_html(svg.line_chart("k", "t", [s], "x", "y"))
    [g] = doc.find_all("g", "series")
    assert g.attrs["data-points"] == "2" and g.attrs["data-series"] == "a (2 NaN/inf not drawn)"
    assert "nan" not in svg.line_chart("k", "t", [s], "x", "y")


def test_a_long_series_is_thinned_to_the_charts_width_keeping_its_spikes():
    """A 100,000-iteration run logged every step drew every point and a dot each: a 33 MB report."""
    from meshlm.report.svg import MAX_POINTS, Series, line_chart, thin
    points = [(float(i), 5.0 - i * 1e-5) for i in range(50_000)]
    points[31_337] = (31_337.0, 9.0)
    thinned = thin(Series("run", points, "#000"))
    assert len(thinned.points) <= MAX_POINTS and (31_337.0, 9.0) in thinned.points
    assert thinned.points[0] == points[0] and thinned.points[-1] == points[-1]
    assert [x for x, _ in thinned.points] == sorted(x for x, _ in thinned.points)
    svg = line_chart("loss", "loss", [Series("run", points, "#000")], "iteration", "loss")
    assert f'data-points="{len(thinned.points)}"' in svg and len(svg) < 100_000
    assert thin(Series("short", points[:10], "#000")).points == points[:10]
