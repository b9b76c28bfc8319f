"""meshlm analyze on synthetic metrics.jsonl records: one test per kind of finding, the
predictor hook, the CLI, and the records metrics.py and comm.py write for it (fast)."""

import json

import pytest
import torch

from distributed import run_distributed
from meshlm import cli
from meshlm.parallel import comm
from meshlm.planner.analyze import analyze, format_report
from meshlm.training.metrics import MetricsLogger


def rec(i, *, iter_ms=100.0, tokens=1000.0, loss=None, **extra):
    r = {"iteration": i, "iter_ms": iter_ms, "tokens_per_sec": tokens, "lm_loss": 5.0 - 0.1 * i if loss is None
         else loss, "nan_iters": 0, "skipped_iters": 0, "mem_max_allocated_gb": None, "mem_total_gb": None}
    r.update(extra)
    return r


def config(**parallel):
    training = {k: parallel.pop(k) for k in ("micro_batch_size", "global_batch_size") if k in parallel}
    return {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                         "overlap_grad_reduce": False, "ddp_bucket_size": None, **parallel},
            "training": {"micro_batch_size": 1, "global_batch_size": 8, **training},
            "model": {"num_layers": 8}, "optimizer": {"lr": 1e-3}}


def by_kind(report, kind):
    return [f for f in report["findings"] if f["kind"] == kind]


def fix_flags(finding):
    return [flag for fix in finding["fixes"] for flag in fix["flags"]]


def warns(report):
    return [f["kind"] for f in report["findings"] if f["severity"] == "warn"]


def test_dp_communication_above_30_percent_is_dominant_with_overlap_bucket_and_accumulation_fixes():
    records = [rec(i, comm_share={"dp": 0.45}) for i in range(1, 7)]
    report = analyze(records, config(ddp_bucket_size=1000))
    assert report["dominant"] == "dp" and report["breakdown"]["dp"] == pytest.approx(0.45)
    [dp] = by_kind(report, "dp")
    assert dp["severity"] == "warn"
    flags = {k: v for fix in dp["fixes"] for k, v in fix["flags"].items()}
    assert flags["--overlap-grad-reduce"] is None and flags["--ddp-bucket-size"] == "40000000"
    assert flags["--global-batch-size"] == "16"
    # already overlapped with default buckets: those two fixes are not offered
    report = analyze(records, config(overlap_grad_reduce=True))
    assert {"--overlap-grad-reduce", "--ddp-bucket-size"}.isdisjoint(fix_flags(by_kind(report, "dp")[0]))


def test_dp_share_below_the_threshold_is_information_and_the_step_compute_bound():
    report = analyze([rec(i, comm_share={"dp": 0.12}) for i in range(1, 7)])
    assert report["dominant"] == "compute"
    assert by_kind(report, "dp")[0]["severity"] == "info" and "dp" not in warns(report)
    assert by_kind(analyze([rec(i, comm_share={"dp": 0.02}) for i in range(1, 7)]), "dp") == []


def test_tp_communication_suggests_less_tp_more_pp_with_the_runs_sizes():
    report = analyze([rec(i, comm_share={"tp": 0.5, "dp": 0.1}) for i in range(1, 5)],
                     config(tensor_model_parallel_size=8, pipeline_model_parallel_size=2))
    assert report["dominant"] == "tp"
    flags = by_kind(report, "tp")[0]["fixes"][0]["flags"]
    assert flags == {"--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "4"}


@pytest.mark.parametrize("kind,sizes", [("tp", {"tensor_model_parallel_size": 8}),
                                        ("cp", {"context_parallel_size": 4}),
                                        ("ep", {"expert_model_parallel_size": 4})])
def test_keeping_a_group_inside_a_node_is_advised_only_to_a_run_of_several_nodes(kind, sizes):
    """A one-node run was told to keep its TP/CP/EP group inside one node: it already was."""
    def advice(nodes):
        layout = {} if nodes is None else {"layout": {"tp": 1, "pp": 1, "dp": 1, "nodes": nodes}}
        found = by_kind(analyze([rec(i, comm_share={kind: 0.5}, **layout) for i in range(1, 5)], config(**sizes)),
                        kind)[0]
        return [x["why"] for x in found["fixes"] if "inside one node" in x["why"]]
    assert advice(1) == []
    assert len(advice(2)) == 1 and len(advice(None)) == 1  # several nodes, or a run that did not log them


def timeline(p, m, busy_ms):
    """One 1F1B-like timeline: each stage's F and B of every micro-batch, busy_ms[s] in total."""
    events, t = [], 0.0
    for s in range(p):
        each = busy_ms[s] / 1000 / (2 * m)
        for mb in range(m):
            for kind in "FB":
                events.append({"mb": mb, "chunk": 0, "kind": kind, "stage": s, "start": t, "end": t + each})
                t += each
    return events


def test_bubble_near_the_analytic_value_is_dominant_and_fixed_by_micro_batches_and_interleaving():
    tl = timeline(4, 2, [10.0] * 4)
    report = analyze([rec(i, bubble_fraction=0.62, pipeline_timeline=tl, comm_share={"pp": 0.5})
                      for i in range(1, 6)], config(pipeline_model_parallel_size=4))
    pl = report["pipeline"]
    assert (pl["stages"], pl["microbatches"], pl["virtual"]) == (4, 2, 1)
    assert pl["analytic"] == pytest.approx(3 / 5) and pl["analytic_of_compute"] == pytest.approx(3 / 2)
    assert report["dominant"] == "bubble"  # the PP waits are part of the bubble, never counted twice
    [bubble] = by_kind(report, "bubble")
    flags = {k: v for fix in bubble["fixes"] for k, v in fix["flags"].items()}
    assert flags["--global-batch-size"] == "16" and flags["--num-layers-per-virtual-pipeline-stage"] == "1"
    assert "--pipeline-model-parallel-size" not in flags  # measured ≈ analytic: the schedule is the cause
    assert by_kind(report, "imbalance") == []
    assert "60% analytic" in format_report(report)


def test_stage_imbalance_names_the_slow_stage_and_the_uneven_split_flag():
    tl = timeline(4, 4, [10.0, 10.0, 10.0, 20.0])
    records = [rec(i, bubble_fraction=0.55, pipeline_timeline=tl) for i in range(1, 5)]
    cfg = config(pipeline_model_parallel_size=4)
    cfg["model"]["num_layers"] = 16  # 4 a stage; the last one takes 1 so that the others split 15 evenly
    report = analyze(records, cfg)
    [imb] = by_kind(report, "imbalance")
    assert report["pipeline"]["slowest_stage"] == 3 and report["pipeline"]["imbalance"] == pytest.approx(0.6)
    assert imb["fixes"][0]["flags"] == {"--decoder-last-pipeline-num-layers": "1"}
    cfg["model"]["num_layers"] = 8  # 2 a stage: neither 7 nor 8 splits over 3 stages
    assert by_kind(analyze(records, cfg), "imbalance")[0]["fixes"][0]["flags"] == {}
    # a measured bubble far above the analytic one also offers fewer stages
    assert "--pipeline-model-parallel-size" in fix_flags(by_kind(report, "bubble")[0])


def test_a_warning_whose_flag_fixes_meshlm_refuses_says_why_instead_of_nothing():
    """An interleaved PP=2 run (4 layers, v 2) with a slow last stage got a bare [warn]: its one fix,
    --decoder-last-pipeline-num-layers 1, is refused (stages of 3 and 1 layers do not split over v 2)."""
    tl = timeline(2, 8, [50.0, 70.0])
    records = [rec(i, bubble_fraction=0.1, pipeline_timeline=tl, world_size=2) for i in range(1, 5)]
    cfg = config(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, global_batch_size=16,
                 micro_batch_size=2)
    cfg["model"].update(num_layers=4, hidden_size=64, num_attention_heads=4)
    [imb] = by_kind(analyze(records, cfg), "imbalance")
    [fix] = imb["fixes"]
    assert fix["flags"] == {} and fix["why"].startswith("no flag change meshlm accepts for this run: "
                                                        "--decoder-last-pipeline-num-layers 1")
    assert "not divisible by --virtual-pipeline-model-parallel-size 2" in fix["why"]


@pytest.mark.parametrize("peak,severity,flag", [(76.0, "warn", "--use-distributed-optimizer"),
                                                (20.0, "info", "--micro-batch-size"), (50.0, "ok", None)])
def test_memory_headroom_against_the_device(peak, severity, flag):
    records = [rec(i, mem_max_allocated_gb=peak, mem_total_gb=80.0) for i in range(1, 4)]
    [mem] = by_kind(analyze(records, config()), "memory")
    assert mem["severity"] == severity and f"{peak:.1f} GiB of 80.0 GiB" in mem["message"]
    assert flag is None or flag in fix_flags(mem)
    assert by_kind(analyze([rec(1)]), "memory")[0]["severity"] == "ok"  # CPU: not recorded


def test_a_throughput_drop_is_flagged_and_a_steady_one_is_not():
    drop = [rec(i, tokens=1000.0 if i <= 5 else 600.0) for i in range(1, 11)]
    assert "throughput" in warns(analyze(drop))
    steady = [rec(i, tokens=1000.0 + 30 * (-1) ** i) for i in range(1, 11)]
    assert by_kind(analyze(steady), "throughput")[0]["severity"] == "ok"


def test_loss_spikes_from_the_trainers_flag_or_a_jump_and_nans_are_warnings():
    records = [rec(i) for i in range(1, 11)]
    assert by_kind(analyze(records), "loss_spike") == []
    records[6]["lm_loss"] = 9.0
    records[8]["loss_spike"] = True
    [spike] = by_kind(analyze(records), "loss_spike")
    assert "iteration(s) 7, 9" in spike["message"] and "--lr" in fix_flags(spike)
    records[-1]["nan_iters"] = 2
    [nan] = by_kind(analyze(records), "nan")
    assert nan["severity"] == "warn" and "2 iteration(s)" in nan["message"]


def test_the_loss_fixes_start_from_the_runs_settings():
    """An fp32 run clipping at 1.0 was told `--clip-grad 1.0` and "bf16 instead of fp16"; a
    --train-samples run `--lr-warmup-iters`, which it refuses; and "--lr lower" named no value."""
    records = [rec(i) for i in range(1, 11)]
    records[8]["loss_spike"], records[-1]["nan_iters"] = True, 1
    cfg = config()
    cfg["optimizer"].update(clip_grad=1.0, lr_warmup_iters=0)
    cfg["training"].update(train_iters=500, fp16=False, bf16=False)
    report = analyze(records, cfg)
    [spike], [nan] = by_kind(report, "loss_spike"), by_kind(report, "nan")
    spike_flags = {k: v for fix in spike["fixes"] for k, v in fix["flags"].items()}
    assert spike_flags == {"--lr": "0.0005", "--lr-warmup-iters": "50"}
    assert [fix["flags"] for fix in nan["fixes"]] == [{"--lr": "0.0005"}]
    cfg["optimizer"].update(clip_grad=0.0, lr_warmup_samples=800)
    cfg["training"].update(train_iters=None, train_samples=80_000, fp16=True)
    report = analyze(records, cfg)
    spike_flags = {k: v for fix in by_kind(report, "loss_spike")[0]["fixes"] for k, v in fix["flags"].items()}
    assert spike_flags == {"--lr": "0.0005", "--lr-warmup-samples": "1600", "--clip-grad": "1.0"}
    assert {"--bf16": None} in [fix["flags"] for fix in by_kind(report, "nan")[0]["fixes"]]


def test_every_switch_a_fix_names_is_a_pretrain_switch():
    """A fix with a flag and no value is typed as a switch: `--recompute-granularity` (drop recompute)
    was one, and pretrain refuses it without a value."""
    import argparse
    from meshlm.config import add_config_args
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    switches = {o for a in parser._actions if a.nargs == 0 for o in a.option_strings}
    cfg = config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2,
                 expert_model_parallel_size=2, data_parallel_sharding_strategy="optim_grads_params")
    cfg["training"]["recompute_granularity"] = "selective"
    shares = {"dp": 0.4, "tp": 0.4, "cp": 0.4, "ep": 0.4, "zero": 0.4, "pp": 0.4}
    timeline = [{"stage": s, "chunk": 0, "mb": m, "kind": k, "start": 0.01 * m, "end": 0.01 * m + 0.005}
                for s in (0, 1) for m in range(4) for k in "FB"]
    for mem in (10.0, 79.0):
        records = [rec(i, comm_share=shares, mem_max_allocated_gb=mem, mem_total_gb=80.0, nan_iters=1,
                       loss_spike=i == 5, bubble_fraction=0.5, pipeline_timeline=timeline) for i in range(1, 8)]
        named = [(flag, f["kind"]) for f in analyze(records, cfg)["findings"] for fix in f["fixes"]
                 for flag, value in fix["flags"].items() if value is None]
        assert named and all(flag in switches for flag, _ in named), named


def test_the_recompute_fix_of_a_run_near_out_of_memory_is_one_pretrain_accepts():
    """A selective-recompute run near OOM was told `--recompute-granularity full --recompute-method
    uniform`, which pretrain refuses without --recompute-num-layers; a full-recompute run was told
    full recompute again."""
    from meshlm.config import Config, apply_mapping
    from meshlm.planner.predict import with_flags
    from meshlm.validate import _recompute_problems
    records = [rec(i, mem_max_allocated_gb=79.0, mem_total_gb=80.0) for i in range(1, 6)]
    cfg = config()
    cfg["training"]["recompute_granularity"] = "selective"
    [mem] = by_kind(analyze(records, cfg), "memory")
    [fix] = [fix for fix in mem["fixes"] if "--recompute-granularity" in fix["flags"]]
    base = Config()
    apply_mapping(base, cfg, "test")
    applied = with_flags(base, fix["flags"])
    assert applied.training.recompute_granularity == "full"
    assert _recompute_problems(applied.training, applied.model.num_layers) == []
    cfg["training"].update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert "--recompute-granularity" not in fix_flags(by_kind(analyze(records, cfg), "memory")[0])


def test_a_rank_slow_in_most_iterations_is_a_straggler():
    slow = [rec(i, rank_iter_s=[0.10, 0.10, 0.14, 0.10]) for i in range(1, 7)]
    [s] = by_kind(analyze(slow), "straggler")
    assert s["severity"] == "warn" and s["message"].startswith("rank 2 ")
    assert "compute time outside collectives is 40% above the median rank's" in s["message"]
    noisy = [rec(i, rank_iter_s=[0.10, 0.105, 0.10, 0.10]) for i in range(1, 7)]
    assert by_kind(analyze(noisy), "straggler")[0]["severity"] == "ok"
    # rank_iter_s is time outside collectives (training/stragglers.py): a lag under the live watch's
    # MIN_EXCESS_S is noise however large its ratio, as in the straggler line the trainer prints
    tiny = [rec(i, rank_iter_s=[0.001, 0.001, 0.0025, 0.001]) for i in range(1, 7)]
    assert by_kind(analyze(tiny), "straggler")[0]["severity"] == "ok"


def test_a_healthy_run_has_no_warning_and_is_compute_bound():
    report = analyze([rec(i, comm_share={"dp": 0.03}) for i in range(1, 9)])
    assert report["dominant"] == "compute" and warns(report) == []


def test_the_predictor_hook_receives_config_and_flags_and_its_gain_is_reported():
    seen = []

    def predictor(cfg, flags):
        seen.append((cfg, flags))
        return 0.25 if "--overlap-grad-reduce" in flags else None

    cfg = config()
    report = analyze([rec(i, comm_share={"dp": 0.5}) for i in range(1, 5)], cfg, predictor)
    fixes = by_kind(report, "dp")[0]["fixes"]
    assert fixes[0]["flags"] == {"--overlap-grad-reduce": None} and fixes[0]["predicted_gain"] == 0.25
    assert all(c is cfg for c, _ in seen) and all(f["predicted_gain"] is None for f in fixes[1:])
    assert "(planner: 25% faster)" in format_report(report)


def test_cli_prints_text_and_json_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [rec(i, comm_share={"dp": 0.4}) for i in range(1, 5)]
                  + [{"iteration": 4, "val_loss": 3.0}]) + "\n")
    (tmp_path / "config.yaml").write_text("parallel:\n  ddp_bucket_size: 500\n")
    assert cli.main(["analyze", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "DP gradient reduction     40.0%  ← dominant" in text and "--ddp-bucket-size 40000000" in text
    assert cli.main(["analyze", str(tmp_path / "logs" / "metrics.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dominant"] == "dp"
    assert cli.main(["analyze", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no metrics.jsonl" in err[0]


def test_metrics_record_comm_seconds_and_shares_by_kind(tmp_path, capsys):
    log = MetricsLogger(enabled=True, log_dir=str(tmp_path), train_iters=2, log_interval=2, global_batch=2,
                        seq_length=4, flops_per_iter=1.0, world_size=2, dtype=torch.float32)
    log.train_step(1, 2, lm_loss=1.0, lr=0.1, grad_norm=1.0, iter_s=1.0, comm_s=0.2)
    r = log.train_step(2, 4, lm_loss=1.0, lr=0.1, grad_norm=1.0, iter_s=0.5, comm_s=0.1,
                       timed_comm_s={"tp": 0.1, "pp": 0.05})
    assert r["comm_s"] == pytest.approx({"dp": 0.15, "tp": 0.1, "pp": 0.05})
    # dp over the interval's time; tp and pp over the log iteration they were timed in
    assert r["comm_share"] == pytest.approx({"dp": 0.2, "tp": 0.2, "pp": 0.1})
    assert "exposed comm: DP 20.0% TP 20.0% PP 10.0%" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["comm_share"]["tp"] == pytest.approx(0.2)


def _timed_collectives(rank, world):
    group = torch.distributed.new_group([0, 1])
    x = torch.ones(1000)
    comm.all_reduce(x, group)
    untimed = comm.stop_timing()
    comm.start_timing()
    comm.all_reduce(x, group)
    comm.all_gather(x, group, 0)
    comm.reduce_scatter(torch.ones(4, 10), group, 0)
    timed = comm.stop_timing()
    after = comm.stop_timing()
    comm.start_timing()  # CP's loss-token count (a TP=1, CP=2 run was told to cut TP: issue 29)
    from types import SimpleNamespace
    from meshlm.parallel.context import sequence_loss_tokens
    tokens = sequence_loss_tokens(torch.ones(1, 4), SimpleNamespace(cp=2, cp_group=group)).item()
    return untimed, timed, after, comm.stop_timing(), tokens


@pytest.mark.slow
def test_collectives_are_timed_as_tp_only_between_start_and_stop():
    for untimed, timed, after, cp_timed, tokens in run_distributed(_timed_collectives, 2):
        assert untimed == {} and after == {}
        assert set(timed) == {"tp"} and 0 < timed["tp"] < 10
        assert set(cp_timed) == {"cp"} and tokens == 8  # the loss tokens of both CP ranks, timed as CP


def test_tp_share_of_a_tp1_run_gets_no_tp_fix():
    report = analyze([rec(i, comm_share={"tp": 0.3}) for i in range(1, 5)], config(context_parallel_size=2))
    [f] = by_kind(report, "tp")
    assert f["fixes"] == [] and "TP 1" in f["message"]


def test_one_slow_logged_iteration_is_no_straggler():
    """A 2-iteration run (rank 0 slow in its checkpoint-saving iteration) was reported as
    `[warn] rank 0 is the slowest in 1 of 2 logged iterations`; the live watch needs 3 in a row."""
    rows = [rec(1, rank_iter_s=[0.30, 0.23]), rec(2, rank_iter_s=[0.15, 0.065])]
    [s] = by_kind(analyze(rows), "straggler")
    assert s["severity"] == "ok" and "1 of 2" in s["message"]
    three = [rec(i, rank_iter_s=[0.10, 0.10, 0.14, 0.10]) for i in range(1, 5)]  # the first is warm-up
    assert by_kind(analyze(three), "straggler")[0]["severity"] == "warn"


def test_a_speed_fix_the_planner_predicts_slower_is_dropped_but_a_memory_fix_is_kept():
    """A PP=2 run was told `--micro-batch-size 1 … (planner: 77% slower)` for its bubble."""
    def predictor(cfg, flags):
        return -0.77 if "--micro-batch-size" in flags else 0.1

    report = analyze([rec(i, comm_share={"dp": 0.5}) for i in range(1, 5)], config(), predictor)
    fixes = by_kind(report, "dp")[0]["fixes"]
    assert fixes and all(f["predicted_gain"] is None or f["predicted_gain"] >= 0 for f in fixes)
    assert "slower" not in format_report(report)


def test_a_fix_meshlm_would_refuse_for_the_run_is_not_offered():
    """A 2-layer TP=2 × PP=2 run was told `--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4`
    (4 stages of a 2-layer model), and a DP=8 run with global batch 8 `--micro-batch-size 2`."""
    tp = config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp["model"] = {"num_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    records = [rec(i, comm_share={"tp": 0.5}, world_size=4) for i in range(1, 5)]
    assert "--pipeline-model-parallel-size" not in fix_flags(by_kind(analyze(records, tp), "tp")[0])
    tp["model"]["num_layers"] = 8  # 2 a stage at PP 4: offered
    assert by_kind(analyze(records, tp), "tp")[0]["fixes"][0]["flags"] == {
        "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4"}
    dp = [rec(i, comm_share={"dp": 0.5}, world_size=8) for i in range(1, 5)]
    assert "--micro-batch-size" not in fix_flags(by_kind(analyze(dp, config(global_batch_size=8)), "dp")[0])
    assert "--micro-batch-size" in fix_flags(by_kind(analyze(dp, config(global_batch_size=16)), "dp")[0])


def test_a_run_resumed_at_another_layout_is_analyzed_at_its_last_layout_only(tmp_path):
    """A TP=2 run resumed at PP=2 (same world size, one metrics.jsonl, config.yaml the resume's): the
    analysis mixed both and told the PP run that 65% of its step was TP collectives."""
    tp2, pp2 = {"tp": 2, "cp": 1, "pp": 1, "dp": 1}, {"tp": 1, "cp": 1, "pp": 2, "dp": 1}
    records = [rec(i, world_size=2, layout=tp2, comm_share={"tp": 0.65}) for i in (2, 4, 6)] + \
        [rec(i, world_size=2, layout=pp2, comm_share={"pp": 0.3}) for i in (8, 10, 12)]
    report = analyze(records, config(pipeline_model_parallel_size=2))
    assert report["iterations"] == [8, 12] and "tp" not in report["breakdown"] and "pp" in report["breakdown"]
    assert report["left_out"] == ("3 earlier record(s), iterations 2–6 at TP=2 CP=1 PP=1 DP=1, left out: the run "
                                  "was resumed at TP=1 CP=1 PP=2 DP=1")
    assert f"  ({report['left_out']})" in format_report(report).splitlines()
    assert analyze(records[3:], config())["left_out"] is None  # one layout: nothing left out
    log = MetricsLogger(enabled=True, log_dir=str(tmp_path), train_iters=1, log_interval=1, global_batch=2,
                        seq_length=4, flops_per_iter=1.0, world_size=2, dtype=torch.float32, layout=pp2)
    assert log.train_step(1, 2, lm_loss=1.0, lr=0.1, grad_norm=1.0, iter_s=1.0)["layout"] == pp2


@pytest.mark.parametrize("command", ["analyze", "report"])
@pytest.mark.parametrize("record, config, words", [
    ({"iter_ms": "fast"}, None, "iter_ms is 'fast', not a number"),
    ({"comm_share": {"dp": "a"}}, None, "comm_share is {'dp': 'a'}, not a map of numbers"),
    ({"iter_ms": None}, None, "iter_ms is null, not a number"),
    ({"device": 5}, None, "device is 5, not a device name"),
    ({"layout": "tp2"}, None, "layout is 'tp2', not a map"),
    ({"loss_spike": "yes"}, None, "loss_spike is 'yes', not true or false"),
    ({"tokens_per_sec": -1}, None, "tokens_per_sec is -1: a negative count or time"),
    ({"pipeline_timeline": "x", "bubble_fraction": 0.1}, None, "pipeline_timeline is 'x', not a list of events"),
    ({"pipeline_timeline": [1], "bubble_fraction": 0.1}, None, "pipeline_timeline event 1 is 1, not"),
    ({"pipeline_timeline": [{"stage": 0, "mb": 0, "chunk": 0, "kind": "X", "start": 0, "end": 1}],
      "bubble_fraction": 0.1}, None, "pipeline_timeline event 1 is"),
    ({"layout": {"pp": 2}, "bubble_fraction": 0.1, "pipeline_timeline": [  # a report of a million rows before
        {"stage": 10 ** 6, "mb": 0, "chunk": 0, "kind": "F", "start": 0.0, "end": 1.0}]}, None, "(stage below pp 2)"),
    ({}, "parallel: 5\n", "section 'parallel' is 5, not a mapping of its settings"),
    ({}, "model:\n", "section 'model' is None, not a mapping of its settings"),
    ({}, "parallel: {ddp_bucket_size: big}\n", "ddp-bucket-size='big' is not an integer"),
    ({}, "training: {micro_batch_size: x, global_batch_size: 8}\n", "micro-batch-size='x' is not an integer"),
])
def test_a_value_of_the_wrong_kind_in_a_runs_files_is_one_line(tmp_path, capsys, command, record, config, words):
    """analyze: a TypeError ('>=' between str and float) or AttributeError ('int' has no 'get') traceback;
    a device, an iter_ms null or a timeline event of the wrong form a TypeError or KeyError in both."""
    (tmp_path / "logs").mkdir()
    rec = dict({"iteration": 1, "consumed_samples": 4, "iter_ms": 5.0, "lm_loss": 3.0}, **record)
    (tmp_path / "logs" / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    if config:
        (tmp_path / "config.yaml").write_text(config)
    assert cli.main([command, str(tmp_path), "--no-predict"]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
