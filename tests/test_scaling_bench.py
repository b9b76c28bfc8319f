"""bench/scaling.py on CPU (--tiny: gloo, the tiny model, 2 processes): the table, the JSON rows
with measured and planner figures, scaling against the same run's 1-process case, and the cases
that need more processes than are "visible" skipped."""

import json
import os
import subprocess
import sys

import pytest

from test_launch import clean_env

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)


def test_planner_best_layout_is_a_layout_meshlm_accepts():
    import scaling
    from meshlm.validate import validate
    from runs import COMMON, config_of
    model = scaling.MODELS["llama3-8b"][0]
    flags = scaling.planner_best(model, 8)
    assert "--micro-batch-size" in flags
    validate(config_of(model + COMMON + flags), world=8, check_files=False, cuda=True)


@pytest.mark.slow
def test_tiny_run_prints_the_table_and_appends_rows_with_planner_figures(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "scaling.py"), "--tiny", "--out", str(tmp_path),
                          "pp2", "dp8"], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["case"], r["gpus"]) for r in rows] == [("1gpu", 1), ("pp2", 2)]  # the 1-process case first
    one, pp2 = rows
    for r in rows:
        assert r["tokens_per_sec"] > 0 and r["measured_step_ms"] > 0 and r["tflops_per_gpu"] > 0
        assert r["predicted_peak_gib"] > 0 and r["predicted_step_ms"] > 0  # planner columns filled
        assert r["step_error"] == pytest.approx(r["predicted_step_ms"] / r["measured_step_ms"] - 1, abs=1e-3)
        assert r["peak_mem_gib"] is None and r["peak_error"] is None  # CPU: no CUDA memory statistics
    assert one["scaling_vs_1gpu"] == 1.0
    assert pp2["scaling_vs_1gpu"] == pytest.approx(pp2["tokens_per_sec"] / one["tokens_per_sec"], rel=1e-3)
    assert 0 < pp2["bubble_fraction"] < 1 and pp2["exposed_comm_share"]["pp"] > 0  # analyze's breakdown
    assert one["bubble_fraction"] is None and one["exposed_comm_share"] == {}
    assert pp2["layout"] == "--pipeline-model-parallel-size 2"
    table = out.stdout[out.stdout.index("| case |"):]
    lines = table.splitlines()
    assert lines[2].startswith("| 1gpu | 1 |") and lines[3].startswith("| pp2 | 2 |")
    assert f"| {pp2['scaling_vs_1gpu']:.3f} |" in lines[3]
    assert "- dp8: skipped, needs 8 GPUs (2 visible)" in table
    assert (tmp_path / "scaling.md").read_text().strip() == table.strip()
