"""`meshlm report` of real CPU runs made by `meshlm pretrain`: a TP=2 × PP=2 run and a PP=2 run
profiled on rank 1 by the torch profiler. The HTML is rendered by headless Chromium with the
network off (screenshot and DOM checked) when Chromium is installed (.ci/run installs Debian's
package); without it the test says so and checks the same SVG by parsing the HTML."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

from report_html import count_color, parse_html, png_pixels
from test_launch import clean_env

pytestmark = pytest.mark.slow

TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--lr-warmup-iters", "0",
        "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--train-iters", "4"]
RUNS = {  # name → (flags, processes, micro-batches per step)
    "tp2pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--global-batch-size", "8"], 4, 4),
    "pp2": (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--profile",
             "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
             "--profile-ranks", "1", "--nvtx-ranges"], 2, 2),
}
CHART_SERIES = {"loss": ["train", "validation"], "lr": [""], "grad_norm": [""], "tokens_per_sec": [""]}
NOT_ON_CPU = {"mfu", "memory"}  # MFU and memory need a GPU
COMM_KINDS = {"tp2pp2": ["pp", "tp"], "pp2": ["pp"]}  # exposed comm timed by kind (no DP: DP × CP = 1)


def meshlm(*argv, cwd):
    out = subprocess.run([sys.executable, "-m", "meshlm", *argv], cwd=cwd, env=clean_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    for name, (flags, nproc, _) in RUNS.items():
        meshlm("pretrain", *TINY, *flags, "--nproc-per-node", str(nproc), "--run-dir", name, cwd=root)
    return root


def chromium(html, root):
    """(screenshot pixels, dumped DOM) of ``html`` in headless Chromium with networking off, or
    None (with a warning saying why) when Chromium is not installed."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        warnings.warn("chromium not installed (.ci/run installs it with apt-get; it failed or was not run): "
                      "checking the SVG by parsing the HTML only")
        return None
    common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run", "--proxy-server=127.0.0.1:9",
              "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={root / 'chromium-profile'}",
              "--window-size=1280,2600"]
    shot = root / (os.path.basename(html) + ".png")
    # one browser start for both: the screenshot is written to the file, the DOM to stdout
    dom = subprocess.run([*common, f"--screenshot={shot}", "--dump-dom", f"file://{html}"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return png_pixels(str(shot)), dom


def check_page(html_text, names):
    """Every chart has one series with points per run and quantity; every run one timeline row
    per stage with an F and a B bar per micro-batch; no external URL."""
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html_text, re.I)
    assert "http://" not in html_text and "https://" not in html_text
    doc = parse_html(html_text)
    charts = {c.attrs["data-chart"]: c for c in doc.find_all("svg", "chart")}
    assert set(charts) == set(CHART_SERIES) | {"comm"}
    assert [g.attrs["data-series"] for g in charts["comm"].find_all("g", "series")] == \
        [f"{n} {k}" for n in names for k in COMM_KINDS[n]]
    assert {d.attrs["data-chart"] for d in doc.find_all("div", "note")} == NOT_ON_CPU
    for key, parts in CHART_SERIES.items():
        series = charts[key].find_all("g", "series")
        assert [g.attrs["data-series"] for g in series] == [f"{n} {p}".strip() for n in names for p in parts], key
        for g in series:
            points = g.find_all("polyline")[0].attrs["points"].split()
            assert int(g.attrs["data-points"]) == len(points) >= 2, (key, g.attrs)
    timelines = doc.find_all("svg", "timeline")
    # each run's measured timeline, then the planner's predicted one for the same layout
    assert [t.attrs["data-timeline"] for t in timelines] == ["measured", "predicted"] * len(names)
    for tl, name in zip(timelines, [n for n in names for _ in range(2)]):
        m = RUNS[name][2]
        rows = tl.find_all("g", "stage")
        assert [r.attrs["data-stage"] for r in rows] == ["0", "1"]
        for r in rows:
            bars = r.find_all("rect", "bar")
            assert sorted((b.attrs["data-kind"], int(b.attrs["data-mb"])) for b in bars) == \
                sorted((k, mb) for k in "FB" for mb in range(m))
    assert len(doc.find_all("p", "bubble")) == len(names)
    # the analyzer's findings stand first: each PP = 2 run's bubble at least
    assert doc.find_all("section")[0].attrs["id"] == "findings"
    assert all(f"{n}: " in html_text for n in names) and "pipeline bubble" in html_text
    return doc


def test_report_of_a_tp2_pp2_run_renders_in_chromium_with_every_plot_drawn(runs):
    out = meshlm("report", "tp2pp2", "--output", "one.html", "--trace", "one.trace.json", cwd=runs)
    assert "meshlm: report one.html" in out.stdout
    html = (runs / "one.html").read_text()
    check_page(html, ["tp2pp2"])
    assert re.search(r"measured bubble: \d+\.\d% of the wall time of the step; analytic .*\(p−1\)/m = 1/4 = 25\.0%", html)
    seen = chromium(runs / "one.html", runs)
    if seen is not None:
        pixels, dom = seen
        check_page(dom, ["tp2pp2"])  # the DOM Chromium built holds the same drawing
        from meshlm.report import svg, timeline
        assert count_color(pixels, svg.color(0)) > 200  # the run's lines and dots are on screen
        for fill, _ in timeline.KIND_COLORS.values():  # forward and backward bars
            assert count_color(pixels, fill, tol=2) > 500


def test_the_report_of_two_runs_overlays_both(runs):
    meshlm("report", "tp2pp2", "pp2", "--output", "two.html", cwd=runs)
    html = (runs / "two.html").read_text()
    check_page(html, ["tp2pp2", "pp2"])
    seen = chromium(runs / "two.html", runs)
    if seen is not None:
        from meshlm.report import svg
        assert count_color(seen[0], svg.color(0)) > 200 and count_color(seen[0], svg.color(1)) > 200


def test_the_exported_trace_is_chrome_trace_json_with_one_track_per_stage(runs):
    meshlm("report", "tp2pp2", "--output", "t.html", "--trace", "t.json", cwd=runs)
    d = json.loads((runs / "t.json").read_text())
    events = d["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "M"}
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "tp2pp2 stage 0", 1: "tp2pp2 stage 1"}
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == 2 * 2 * 4 and all(e["dur"] > 0 and e["ts"] >= 0 for e in xs)
    for pid in (0, 1):  # a stage's bars never overlap: one stage computes one thing at a time
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["pid"] == pid)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))


def test_profile_writes_a_torch_trace_of_the_step_range_on_the_chosen_rank_only(runs):
    folder = runs / "pp2" / "torch_profile"
    assert sorted(os.listdir(folder)) == ["rank-1.pt.trace.json.gz"]
    trace = json.load(gzip.open(folder / "rank-1.pt.trace.json.gz"))
    user = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert sorted(n for n in user if n.startswith("iteration ")) == ["iteration 2", "iteration 3"]
    for name in ("forward mb 0", "backward mb 1", "optimizer step", "batch_isend_irecv pp"):
        assert name in user, name
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
