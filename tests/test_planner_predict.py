"""The planner's predictions for recorded runs: the analyzer's fix gains (planner/predict.py) and
the predicted pipeline timeline (planner/timeline.py) against the schedule and the step-time model."""

import json

import pytest

from meshlm import cli
from meshlm.parallel.schedules import build_schedule
from meshlm.planner.analyze import analyze, format_report
from meshlm.planner.cost import p2p_seconds, stage_times
from meshlm.planner.gpus import PRESETS
from meshlm.planner.layout import Layout
from meshlm.planner.predict import planner_predictor, with_flags
from meshlm.planner.search import evaluate
from meshlm.planner.timeline import predicted_timeline
from test_analyze import config, rec
from test_planner_search import cfg_of

H200 = PRESETS["H200-141GB"]


def small_config(**parallel):
    c = config(**parallel)
    c["model"].update(hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100)
    return c


def dp_bound(**extra):
    return [rec(i, comm_share={"dp": 0.45}, world_size=2, **extra) for i in range(1, 7)]


def gains(report, kind):
    [f] = [f for f in report["findings"] if f["kind"] == kind]
    return {next(iter(fix["flags"]), ""): fix["predicted_gain"] for fix in f["fixes"]}


def test_the_dp_fixes_of_a_comm_bound_run_get_the_planners_positive_gain():
    cfg = small_config(ddp_bucket_size=1000)
    predictor, note = planner_predictor(cfg, dp_bound(device="NVIDIA H200"))
    assert "planner" in note and "2 × H200-141GB" in note and "NVIDIA H200" in note
    report = analyze(dp_bound(), cfg, predictor)
    g = gains(report, "dp")
    assert g["--ddp-bucket-size"] > 0.05  # 1,000-element buckets: one collective latency (and a flat run) each
    assert g["--global-batch-size"] > 0.05  # the same reduction over twice the samples
    assert g["--overlap-grad-reduce"] is None or g["--overlap-grad-reduce"] >= 0
    text = format_report(report)
    assert "(planner: " in text and "% faster)" in text


def test_a_run_that_let_meshlm_derive_its_global_batch_gets_numbers_and_gains_for_its_batch_fixes():
    """With no --global-batch-size in config.yaml the DP fixes read `--global-batch-size ×2` (advice, no
    gain) and `--micro-batch-size 2` got no gain: the predictor held the batch at the derived 2, where a
    launch with that flag derives 4."""
    cfg = small_config(ddp_bucket_size=1000, global_batch_size=None)
    records = [dict(r, global_batch_size=2) for r in dp_bound(device="NVIDIA H200")]
    predictor, _ = planner_predictor(cfg, records)
    report = analyze(records, cfg, predictor)
    [dp] = [f for f in report["findings"] if f["kind"] == "dp"]
    flags = {k: v for fix in dp["fixes"] for k, v in fix["flags"].items()}
    assert flags["--global-batch-size"] == "4" and flags["--micro-batch-size"] == "2"
    g = gains(report, "dp")
    assert g["--global-batch-size"] > 0.1 and g["--micro-batch-size"] > 0.1


def test_with_flags_applies_values_and_switches_and_refuses_advice():
    base = cfg_of("--micro-batch-size", "1")
    c = with_flags(base, {"--micro-batch-size": "4", "--overlap-grad-reduce": None})
    assert c.training.micro_batch_size == 4 and c.parallel.overlap_grad_reduce
    assert base.training.micro_batch_size == 1 and not base.parallel.overlap_grad_reduce
    assert with_flags(base, {"--lr": "lower"}) is None and with_flags(base, {"--micro-batch-size": "×2"}) is None


def test_a_cpu_run_is_predicted_on_the_h200_preset_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibrated profile here
    cfg = small_config(ddp_bucket_size=1000)
    predictor, note = planner_predictor(cfg, dp_bound(device="cpu"))
    assert predictor is not None and "H200-141GB" in note and "the run's device cpu has no profile" in note
    assert planner_predictor(None, dp_bound()) == (None, "no predicted gains: the run's config (config.yaml) "
                                                         "was not found")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dp_bound(device="cpu")))
    import yaml
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "predicted gains are the planner's step-time model" in out and "(planner: " in out
    assert cli.main(["analyze", str(tmp_path), "--no-predict"]) == 0
    out = capsys.readouterr().out
    assert "planner" not in out
    assert cli.main(["analyze", str(tmp_path), "--json", "--gpu", "A100-80GB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "A100-80GB" in doc["predicted_by"]


def events_by(events, stage, kind):
    return {e["mb"]: e for e in events if e["stage"] == stage and e["kind"] == kind}


@pytest.mark.parametrize("pp,v,gb", [(2, 1, 8), (4, 1, 8), (2, 2, 8)])
def test_predicted_timeline_walks_the_schedule_with_the_planners_stage_times(pp, v, gb):
    cfg = cfg_of("--model", "llama-1b", "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size",
                 str(gb), "--pipeline-model-parallel-size", str(pp), "--bf16",
                 *(["--virtual-pipeline-model-parallel-size", str(v)] if v > 1 else []))
    events = predicted_timeline(cfg, pp, H200, 128256, gpus_per_node=8)
    lay = Layout.of(cfg, pp)
    times = stage_times(cfg, lay, H200, 128256, gpus_per_node=8)
    p2p = p2p_seconds(cfg, lay, H200, 8)
    name = "interleaved" if v > 1 else "1f1b"
    for r in range(pp):
        mine = sorted((e for e in events if e["stage"] == r), key=lambda e: e["start"])
        order = [(a.kind, a.mb, a.chunk) for a in build_schedule(name, pp, r, gb, v) if hasattr(a, "kind")]
        assert [(e["kind"], e["mb"], e["chunk"]) for e in mine] == order  # meshlm's own action order
        for e in mine:
            assert e["end"] - e["start"] == pytest.approx(times[e["chunk"] * pp + r][e["kind"] == "B"])
        assert all(a["end"] <= b["start"] + 1e-15 for a, b in zip(mine, mine[1:]))
    if v == 1:  # data dependencies: a micro-batch's forward goes down the stages, its backward up
        for s in range(pp - 1):
            for mb, f in events_by(events, s + 1, "F").items():
                assert f["start"] >= events_by(events, s, "F")[mb]["end"] + p2p - 1e-12
            for mb, b in events_by(events, s, "B").items():
                assert b["start"] >= events_by(events, s + 1, "B")[mb]["end"] + p2p - 1e-12
        # the makespan is the step-time model's pipeline part: (m + p − 1) micro-batch times + p2p
        t = evaluate(cfg, lay, H200, 128256, 8).time
        makespan = max(e["end"] for e in events)
        assert makespan == pytest.approx(t.total - t.optimizer - t.dp_exposed, rel=0.15)


@pytest.mark.parametrize("section, key, value, words", [
    ("parallel", "tensor_model_parallel_size", 0, "--tensor-model-parallel-size 0 is out of range"),
    ("model", "seq_length", 0, "--seq-length 0 is out of range"),
    ("model", "hidden_size", -64, "--hidden-size -64 is out of range"),
    ("parallel", "tensor_model_parallel_size", 4, "world size 2 is not divisible by TP×CP×PP = 4×1×1")])
def test_a_config_a_launch_refuses_gets_no_prediction_and_no_traceback(tmp_path, capsys, section, key, value, words):
    """A hand-edited config.yaml (TP 0, a sequence of 0, a negative width, a layout its world size
    does not fit): analyze and report ended in a ZeroDivisionError traceback from the planner."""
    cfg = small_config()
    cfg[section][key] = value
    predictor, note = planner_predictor(cfg, dp_bound())
    assert predictor is None and words in note
    import yaml
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(dict(r, consumed_samples=8 * r["iteration"]))
                                                             + "\n" for r in dp_bound()))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    for command in ("analyze", "report"):
        assert cli.main([command, str(tmp_path)]) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.err and (command == "report" or words in out.out)
