"""`meshlm analyze RUN_DIR`: read a run's metrics.jsonl, say where the step time goes, name the
dominant cost and the meshlm flags that address each finding.

Inputs (training/metrics.py writes them on every logged iteration): ``comm_share`` (exposed
communication by kind, a share of the iteration: "dp" the wait for the gradient reduction after
backward, "tp" the inline TP/SP collectives, "cp" context parallelism's K/V exchange (ring waits,
or its all-gather and reduce-scatter), "ep" the MoE expert-parallel all-to-alls (tokens, their
gradients and the counts), "pp" the time blocked in pipeline p2p waits, "zero" the waits of
ZeRO-2/3 inside forward and backward: parameter all-gathers not hidden by the prefetch, an earlier
micro-batch's gradient reduce-scatter),
``bubble_fraction`` and ``pipeline_timeline`` (F/B events per stage) under PP > 1,
``tokens_per_sec``, ``lm_loss``, ``nan_iters``, ``mem_max_allocated_gb`` / ``mem_total_gb`` and,
where the trainer records them, ``rank_iter_s`` and ``loss_spike``. ``rank_iter_s`` is each rank's
seconds per iteration outside collectives — its step time minus the time it waited inside them
(training/stragglers.py) — so it is each rank's own compute, not the wall-clock step, which
collectives make equal on every rank; the straggler finding uses the live watch's thresholds.
RUN_DIR/config.yaml (or a checkpoint's config.json) gives the flags the fixes start from.

Step breakdown: the median over the logged iterations (the first is left out as warm-up when
there are three or more) of the DP share, the TP share and the pipeline bubble (the idle share
of the schedule, which holds the PP p2p waits: a stage waiting for its neighbour is the bubble,
so the two are one cost; "pp" is shown as its part). The largest of the three is the dominant
cost when it takes at least ``DOMINANT_MIN`` of the step; otherwise the step is compute-bound.
The analytic bubble is (p − 1)/(v·m + p − 1) of the step, i.e. (p − 1)/(v·m) of the compute
(Narayanan et al. 2021 §2.2), with p stages, m micro-batches and v chunks read from the timeline.

Predicted gains: ``analyze(..., predictor=f)`` calls ``f(config, flags)`` for each fix — config
the run's config dict (or None), flags the fix's {flag: value} changes (value None for a switch)
— and records its answer (the predicted fraction of step time saved, e.g. 0.2, or None) as the
fix's ``predicted_gain``. ``meshlm analyze`` passes the planner's (planner/predict.py: the
time per sample that cost.step_time saves under the fix's flags, for the run's recorded GPU) unless
--no-predict, and says so in its output; without a predictor the field is None.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
from typing import Callable, Optional

from ..config import SECTIONS, SHARDING, value_problem
from ..errors import ConfigError
from ..straggler_rule import CONSECUTIVE as STRAGGLER_INTERVALS, FACTOR as STRAGGLER_RATIO, MIN_EXCESS_S

COMM_WARN = 0.30        # issue 13: communication above 30% of the step is worth fixing
NOTE_MIN = 0.10         # a cost below this share is not mentioned
DOMINANT_MIN = 0.15     # the largest cost is "dominant" only from this share of the step
BUBBLE_WARN = 0.25      # measured bubble share that deserves a fix
BUBBLE_EXCESS = 0.10    # measured − analytic bubble beyond which the schedule is not the only cause
IMBALANCE_WARN = 0.15   # slowest stage's busy time over the stages' mean, minus 1
MEMORY_TIGHT = 0.90     # peak / device memory: close to an out-of-memory
MEMORY_SPARE = 0.50     # peak / device memory: room for a larger micro-batch or less recompute
THROUGHPUT_DROP = 0.25  # last-window tokens/s below the first window's by this share
SPIKE_RATIO, SPIKE_NATS = 1.2, 0.3  # loss over the median of the previous records by both

KIND_NAMES = {"dp": "DP gradient reduction", "tp": "TP/SP collectives", "pp": "PP p2p waits",
              "cp": "CP K/V exchange", "ep": "EP all-to-all", "zero": "ZeRO-2/3 gather/scatter",
              "bubble": "pipeline bubble"}

Predictor = Callable[[Optional[dict], dict], Optional[float]]
SPEED_KINDS = ("dp", "tp", "pp", "cp", "ep", "zero", "bubble", "imbalance")  # findings whose fixes are about step time


@dataclasses.dataclass
class Fix:
    """One remedy: meshlm flags to change ({flag: value}, None for a switch; empty for advice)."""

    flags: dict
    why: str
    predicted_gain: Optional[float] = None  # fraction of step time saved, from the predictor


@dataclasses.dataclass
class Finding:
    """kind: dp, tp, pp, cp, ep, bubble, imbalance, memory, throughput, loss_spike, nan, straggler.
    severity: "warn" (costs time or risks the run), "info" (worth knowing), "ok"."""

    kind: str
    severity: str
    message: str
    share: Optional[float] = None  # share of the step this cost takes
    fixes: list = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------- reading a run

def metrics_path(run_dir: str) -> str:
    """metrics.jsonl of RUN_DIR (its config.yaml's --log-dir, RUN_DIR/logs/, RUN_DIR itself, or the
    file, as meshlm report finds it); ConfigError if none."""
    log_dir = None
    if os.path.isfile(os.path.join(run_dir, "config.yaml")):  # a run with --log-dir elsewhere: "no metrics.jsonl"
        log_dir = ((_config_of(run_dir) or {}).get("logging") or {}).get("log_dir")
    for path in ([os.path.join(log_dir, "metrics.jsonl")] if log_dir else []) + [
            os.path.join(run_dir, "logs", "metrics.jsonl"), os.path.join(run_dir, "metrics.jsonl"), run_dir]:
        if os.path.isfile(path):
            return path
    raise ConfigError(f"meshlm analyze {run_dir}: no metrics.jsonl there or in its logs/ folder; give the run "
                      f"directory of a `meshlm pretrain` run (its --run-dir) or the metrics.jsonl file")


def load_run(run_dir: str) -> tuple:
    """(training records in file order, config dict or None) of a run directory.

    Training records are the metrics.jsonl lines with "iter_ms" (not evaluation or checkpoint
    lines). The config is RUN_DIR/config.yaml, else the newest checkpoint's config.json below it.
    Raises ConfigError for a missing or unreadable metrics.jsonl, or one of another program's
    records (none has an "iteration").
    """
    path = metrics_path(run_dir)
    from ..folders import read_jsonl
    from ..metrics_json import decode
    lines = read_jsonl(path, ConfigError, "a meshlm metrics.jsonl")
    if lines and not any(isinstance(rec, dict) and "iteration" in rec for rec in lines):  # not "no record yet"
        raise ConfigError(f"{path}: not a meshlm metrics file (none of its records has an \"iteration\"); give "
                          f"a run directory or the metrics.jsonl `meshlm pretrain` wrote")
    records = [decode(rec) for rec in lines if isinstance(rec, dict) and "iter_ms" in rec]
    bad = next((n for n, rec in enumerate(records, 1) if not isinstance(rec.get("iteration"), int)), None)
    if bad:  # analyze() orders and names iterations by it: a KeyError traceback before
        raise ConfigError(f"{path}: training record {bad} has no integer \"iteration\"; give the metrics.jsonl "
                          f"`meshlm pretrain` wrote")
    from ..metrics_json import record_problem
    wrong = next(((n, p) for n, rec in enumerate(records, 1) if (p := record_problem(rec))), None)
    if wrong:
        raise ConfigError(f"{path}: training record {wrong[0]}: {wrong[1]}; give the metrics.jsonl `meshlm pretrain` "
                          f"wrote")
    folder = os.path.dirname(os.path.dirname(os.path.abspath(path)))  # the file given: RUN_DIR/logs/metrics.jsonl
    if os.path.isdir(run_dir):  # RUN_DIR, or its logs/ folder, whose config is RUN_DIR's (it was not looked for)
        logs = os.path.basename(os.path.abspath(run_dir)) == "logs" and not os.path.isfile(
            os.path.join(run_dir, "config.yaml"))
        folder = os.path.dirname(os.path.abspath(run_dir)) if logs else run_dir
    return records, _config_of(folder)


def _config_of(folder: str) -> Optional[dict]:
    yaml_path = os.path.join(folder, "config.yaml")
    if os.path.isfile(yaml_path):
        from ..folders import read_yaml_mapping
        return read_yaml_mapping(yaml_path, ConfigError, SECTIONS, value_problem)
    saved = sorted(glob.glob(os.path.join(folder, "*", "iter_*", "config.json")) +
                   glob.glob(os.path.join(folder, "iter_*", "config.json")))
    if saved:
        try:
            with open(saved[-1]) as fh:
                return json.load(fh)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{saved[-1]}: not the JSON config a meshlm checkpoint holds ({e}); "
                              f"put the run's config.yaml in {folder}") from None
    return None


# Lines a worker writes only while a run goes on (training/metrics.py, trainer, checkpoint): after an
# error line in the same appended rank log they are a later attempt's.
PROGRESS = ("meshlm: world=", "loaded checkpoint", " iteration ", "saved checkpoint", " validation loss")


def stop_finding(logs_dir: str) -> Optional[dict]:
    """A "stopped" warn finding (as analyze()'s findings) when a worker's log in ``logs_dir`` ends the
    run with a ``meshlm: error:`` line (a NaN/inf loss, a hang, a crash named by meshlm): the run's
    last logged record does not say so, the worker logs do. An earlier attempt's error (the job was
    restarted or resumed and went on) does not count: a log last written before metrics.jsonl, or an
    error line followed in its (appended) log by a later attempt's progress (``PROGRESS`` lines)."""
    errors = []
    metrics = os.path.join(logs_dir, "metrics.jsonl")
    since = os.path.getmtime(metrics) - 1.0 if os.path.exists(metrics) else 0.0
    for path in sorted(glob.glob(os.path.join(logs_dir, "rank*.log"))):
        try:
            if os.path.getmtime(path) < since:
                continue
            own = []
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith("meshlm: error:"):
                        own.append(line.strip()[len("meshlm: error:"):].strip())
                    elif own and line.startswith(PROGRESS):
                        own = []  # a later attempt trained on: the error above was not the run's end
            errors += own
        except OSError:
            continue
    if not errors:
        return None
    first = errors[0]
    return dataclasses.asdict(Finding("stopped", "warn", f"the run stopped with an error: {first}", None,
                                      [Fix({}, f"see {logs_dir}/rank*.log ({len(errors)} error line(s))")]))


# ----------------------------------------------------------------------------- the analysis

def analyze(records: list, config: Optional[dict] = None, predictor: Optional[Predictor] = None) -> dict:
    """The report of one run as a JSON-able dict.

    records: training records of metrics.jsonl (``load_run``). config: the run's config dict
    (sections model, training, parallel, …) or None. predictor: see the module doc. A fix whose
    flags meshlm would refuse for this run (``predict.refusal_check``: e.g. twice the pipeline
    stages of a model with too few layers) is left out, with or without a predictor.
    Only the records at the last layout are analyzed (``last_layout``; the loss findings read them
    all). Returns {"iterations": [first, last], "left_out": note or None, "step_ms", "breakdown":
    {kind: share}, "dominant": kind or "compute", "pipeline": {...} or None, "findings": [Finding as
    dict]}; ConfigError if there is no training record.
    """
    if not records:
        raise ConfigError("metrics.jsonl has no training record yet; analyze a run after its first "
                          "--log-interval iterations")
    everything, (records, left_out) = records, last_layout(records)
    steady = records[1:] if len(records) >= 3 else records
    flags = _Flags(config, records)
    breakdown = {}
    for kind in ("dp", "tp", "cp", "ep", "zero", "pp"):
        values = [r["comm_share"][kind] for r in steady if kind in (r.get("comm_share") or {})]
        if values:
            breakdown[kind] = statistics.median(values)
    pipeline = _pipeline(steady)
    if pipeline:
        breakdown["bubble"] = pipeline["measured"]
    costs = {k: v for k, v in breakdown.items() if k != "pp"}
    top = max(costs, key=costs.get, default=None)
    dominant = top if top and costs[top] >= DOMINANT_MIN else "compute"
    findings = [_comm(kind, share, flags) for kind, share in costs.items() if kind != "bubble"]
    if pipeline:
        findings += _pipeline_findings(pipeline, breakdown.get("pp"), flags)
    findings += [_memory(records, flags), _throughput(steady), *_loss(everything, flags), _stragglers(steady)]
    findings = [f for f in findings if f is not None]
    findings.sort(key=lambda f: ({"warn": 0, "info": 1, "ok": 2}[f.severity], -(f.share or 0)))
    from .predict import refusal_check
    refused = refusal_check(config, records)
    for f in findings:
        offered = f.fixes
        why_not = [(fix, refused(fix.flags)) for fix in offered if fix.flags]
        f.fixes = [fix for fix in f.fixes if not fix.flags or refused(fix.flags) is None]
        for fix in f.fixes:
            if predictor is not None and fix.flags:
                fix.predicted_gain = predictor(config, dict(fix.flags))
        if f.kind in SPEED_KINDS:  # a speed fix the planner predicts slower is no fix (memory ones trade speed)
            f.fixes = [fix for fix in f.fixes if fix.predicted_gain is None or fix.predicted_gain >= 0]
        if offered and not f.fixes and f.severity == "warn":  # a warning with no word on what to do
            f.fixes = [_no_fix(why_not)]
    return {"iterations": [records[0]["iteration"], records[-1]["iteration"]], "left_out": left_out,
            "step_ms": statistics.median(r["iter_ms"] for r in steady),
            "breakdown": breakdown, "dominant": dominant, "pipeline": pipeline,
            "findings": [dataclasses.asdict(f) for f in findings]}


def _no_fix(why_not: list) -> Fix:
    """Advice for a warning whose every flag fix was dropped: the first one meshlm refuses for this
    run and why (e.g. an interleaved run's uneven stages), else that the planner predicts none faster."""
    refused = [(fix, reason) for fix, reason in why_not if reason]
    if refused:
        fix, reason = refused[0]
        flags = " ".join(k if v is None else f"{k} {v}" for k, v in fix.flags.items())
        return Fix({}, f"no flag change meshlm accepts for this run: {flags} ({fix.why}) is refused: {reason}")
    return Fix({}, "no flag change the planner predicts faster for this run; see `meshlm plan` for other layouts")


def _layout_text(rec: dict) -> str:
    layout = rec.get("layout") or {}
    parts = [f"{k.upper()}={layout[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if k in layout]
    return " ".join(parts + [f"world size {rec.get('world_size')}"] * (not parts))


def last_layout(records: list) -> tuple:
    """(the trailing records at the last record's layout and world size, a note on the ones left out
    or None): a run resumed at another layout appends to the earlier attempt's metrics.jsonl, and the
    config read with it is the last attempt's, so the two are not mixed (records written before the
    "layout" field compare by world size alone)."""
    def key(r):
        return r.get("layout"), r.get("world_size")
    start = len(records)
    while start > 0 and key(records[start - 1]) == key(records[-1]):
        start -= 1
    if start == 0:
        return records, None
    return records[start:], (f"{start} earlier record(s), iterations {records[0]['iteration']}–"
                             f"{records[start - 1]['iteration']} at {_layout_text(records[start - 1])}, left out: the "
                             f"run was resumed at {_layout_text(records[-1])}")


class _Flags:
    """The run's settings a fix starts from (None where the config is unknown). The global batch is
    the config's, else (a run that let meshlm derive it: micro × accumulation × DP) the one the last
    record logged, so a fix gives its number, not "×2" advice that no flag takes."""

    def __init__(self, config: Optional[dict], records: tuple = ()):
        c = config or {}
        p, t, m = c.get("parallel", {}), c.get("training", {}), c.get("model", {})
        self.tp, self.pp = p.get("tensor_model_parallel_size"), p.get("pipeline_model_parallel_size")
        self.cp, self.ep = p.get("context_parallel_size"), p.get("expert_model_parallel_size")
        self.cp_comm, self.groups = m.get("cp_comm_type"), m.get("num_query_groups")
        self.overlap, self.bucket = p.get("overlap_grad_reduce"), p.get("ddp_bucket_size")
        self.zero = max(SHARDING.get(p.get("data_parallel_sharding_strategy") or "no_shard", 0),
                        1 if p.get("use_distributed_optimizer") else 0, 3 if p.get("use_torch_fsdp2") else 0)
        self.sharding, self.param_gather = p.get("data_parallel_sharding_strategy"), p.get("overlap_param_gather")
        logged = next((r["global_batch_size"] for r in reversed(records) if r.get("global_batch_size")), None)
        self.micro = t.get("micro_batch_size")
        self.global_batch = t.get("global_batch_size") or (int(logged) if config and logged else None)
        self.recompute = t.get("recompute_granularity") or ("selective" if t.get("recompute_activations") else None)
        self.switch_recompute = bool(t.get("recompute_activations"))
        self.layers = m.get("num_layers")
        o = c.get("optimizer", {})
        self.lr, self.clip = o.get("lr"), o.get("clip_grad")
        self.fp16 = t.get("fp16") if config else None
        self.by_samples = t.get("train_samples") is not None
        self.warmup = o.get("lr_warmup_samples" if self.by_samples else "lr_warmup_iters")
        self.length = t.get("train_samples" if self.by_samples else "train_iters")
        # hosts of the run (metrics.jsonl's layout, since 2026-12-04); None before: every group may cross a node
        self.nodes = next((r["layout"].get("nodes") for r in reversed(records) if isinstance(r.get("layout"), dict)),
                          None)

    def group_fix(self, group: str, rule: str) -> list:
        """The fix "keep each GROUP group inside one node (RULE)", unless the run had one node."""
        if self.nodes == 1:
            return []
        return [Fix({}, f"keep each {group} group inside one node ({rule}): its collectives then use NVLink, "
                        f"not the inter-node network")]

    def times(self, value, factor, flag):
        """{flag: value × factor} when value is known, else {flag: "×factor"} (advice)."""
        return {flag: str(int(value * factor)) if value else f"×{factor:g}"}


def _comm(kind: str, share: float, f: _Flags) -> Optional[Finding]:
    if share < NOTE_MIN:
        return None
    severity = "warn" if share > COMM_WARN else "info"
    msg = f"{KIND_NAMES[kind]}: {100 * share:.0f}% of the step is exposed communication (not hidden behind compute)"
    fixes = []
    if kind == "dp":
        if not f.overlap:
            fixes.append(Fix({"--overlap-grad-reduce": None}, "overlap each bucket's reduction with backward"))
        if f.bucket is not None and f.bucket < 40_000_000:
            fixes.append(Fix({"--ddp-bucket-size": "40000000"},
                             f"fewer, larger reductions (now {f.bucket:,} elements a bucket)"))
        fixes.append(Fix(f.times(f.global_batch, 2, "--global-batch-size"),
                         "more gradient accumulation: the same reduction per step over twice the compute"))
        fixes.append(Fix(f.times(f.micro, 2, "--micro-batch-size"),
                         "a larger micro-batch: more compute per reduction (if memory allows)"))
    elif kind == "zero":
        if not f.param_gather:
            fixes.append(Fix({"--overlap-param-gather": None}, "prefetch the next block's parameters while this "
                             "one computes"))
        if f.sharding == "optim_grads_params":
            fixes.append(Fix({"--data-parallel-sharding-strategy": "optim_grads"}, "keep the weights whole "
                             "(ZeRO-2): no parameter all-gathers in forward and backward, if the weights fit"))
        fixes.append(Fix(f.times(f.micro, 2, "--micro-batch-size"),
                         "a larger micro-batch: more compute behind each gather and reduce-scatter"))
    elif kind == "ep":
        if f.ep and f.ep > 1:
            fixes.append(Fix({"--expert-model-parallel-size": str(f.ep // 2)},
                             "fewer expert-parallel ranks: each token's routes cross to fewer other GPUs"))
        fixes += f.group_fix("EP", "EP × TP ≤ GPUs per node")
    elif kind == "cp":
        if f.cp_comm != "all_gather":
            fixes.append(Fix({"--cp-comm-type": "all_gather"}, "gather K/V once instead of passing it round the "
                             "ring" + (" (cheap with GQA: few K/V heads)" if f.groups else "")))
        if f.cp and f.cp > 1:
            fixes.append(Fix({"--context-parallel-size": str(f.cp // 2)},
                             "fewer CP ranks: larger blocks per ring step hide more of each K/V hop"))
        fixes += f.group_fix("CP", "CP × TP ≤ GPUs per node")
    elif kind == "tp" and f.tp == 1:  # no TP to cut: an older run timed CP's loss-token all-reduce as "tp"
        msg += "; the run has TP 1, so these are other inline collectives (no TP fix applies)"
    elif kind == "tp":
        size = f.tp
        fixes.append(Fix({"--tensor-model-parallel-size": str(size // 2) if size and size > 1 else "smaller",
                          "--pipeline-model-parallel-size": str(2 * f.pp) if f.pp else "larger"},
                         "less TP, more PP: fewer collectives per layer for the same memory per GPU"))
        fixes += f.group_fix("TP", "TP ≤ GPUs per node, --nproc-per-node")
        fixes.append(Fix(f.times(f.micro, 2, "--micro-batch-size"),
                         "a larger micro-batch: fewer, larger messages where latency dominates"))
    return Finding(kind, severity, msg, share, fixes)


def _pipeline(steady: list) -> Optional[dict]:
    """Measured and analytic bubble and per-stage busy time, from the records under PP > 1."""
    bubbles = [r["bubble_fraction"] for r in steady if r.get("bubble_fraction") is not None]
    timelines = [r["pipeline_timeline"] for r in steady if r.get("pipeline_timeline")]
    if not bubbles or not timelines:
        return None
    last = timelines[-1]
    p = len({e["stage"] for e in last})
    m = len({e["mb"] for e in last})
    v = len({e["chunk"] for e in last})
    busy = [statistics.median(sum(e["end"] - e["start"] for e in tl if e["stage"] == s) for tl in timelines)
            for s in range(p)]
    mean = sum(busy) / p
    return {"stages": p, "microbatches": m, "virtual": v, "measured": statistics.median(bubbles),
            "analytic": (p - 1) / (v * m + p - 1), "analytic_of_compute": (p - 1) / (v * m),
            "stage_busy_ms": [1000 * b for b in busy], "imbalance": max(busy) / mean - 1 if mean > 0 else 0.0,
            "slowest_stage": max(range(p), key=busy.__getitem__)}


def _pipeline_findings(pl: dict, pp_share: Optional[float], f: _Flags) -> list:
    p, m, v = pl["stages"], pl["microbatches"], pl["virtual"]
    measured, analytic = pl["measured"], pl["analytic"]
    waits = f"; {100 * pp_share:.0f}% of the last stage's step is spent in p2p waits" if pp_share else ""
    msg = (f"pipeline bubble {100 * measured:.0f}% of the step against {100 * analytic:.0f}% analytic "
           f"((p−1)/(v·m+p−1) with p={p}, m={m}, v={v}; (p−1)/(v·m) = {100 * pl['analytic_of_compute']:.0f}% "
           f"of compute){waits}")
    out = []
    if measured >= NOTE_MIN:
        fixes = [Fix(f.times(f.global_batch, 2, "--global-batch-size"),
                     f"more micro-batches per step: m={2 * m} gives {100 * (p - 1) / (2 * v * m + p - 1):.0f}% analytic")]
        if f.micro and f.micro > 1:
            fixes.append(Fix({"--micro-batch-size": str(f.micro // 2)}, "twice the micro-batches for the same batch"))
        per_rank = f.layers // p if f.layers and f.pp else None
        if per_rank and per_rank >= 2 and v == 1:
            fixes.append(Fix({"--num-layers-per-virtual-pipeline-stage": str(per_rank // 2)},
                             f"interleaved 1F1B, v=2: {100 * (p - 1) / (2 * m + p - 1):.0f}% analytic "
                             f"(needs micro-batches a multiple of PP)"))
        elif not per_rank:
            fixes.append(Fix({"--num-layers-per-virtual-pipeline-stage": "layers per stage / 2"},
                             "interleaved 1F1B divides the bubble by v"))
        if measured - analytic > BUBBLE_EXCESS:
            fixes.append(Fix({"--pipeline-model-parallel-size": str(p // 2) if p >= 2 else "smaller"},
                             f"fewer stages: the bubble exceeds the schedule's by {100 * (measured - analytic):.0f} "
                             f"points (p2p latency or stage imbalance)"))
        out.append(Finding("bubble", "warn" if measured > BUBBLE_WARN else "info", msg, measured, fixes))
    if pl["imbalance"] > IMBALANCE_WARN:
        s = pl["slowest_stage"]
        flag = "--decoder-first-pipeline-num-layers" if s == 0 else "--decoder-last-pipeline-num-layers" \
            if s == p - 1 else None
        n = _fewer_layers(f.layers, p) if f.layers else "fewer"
        if flag and n is not None:
            fixes = [Fix({flag: str(n)}, f"give stage {s} fewer layers, the other stages the rest evenly")]
        else:
            fixes = [Fix({}, f"stage {s} cannot give up a layer with the other stages split evenly: more "
                             f"layers per stage, or move layers with --decoder-first/last-pipeline-num-layers")]
        busy = ", ".join(f"{b:.1f}" for b in pl["stage_busy_ms"])
        out.append(Finding("imbalance", "warn", f"stage {s} is busy {100 * pl['imbalance']:.0f}% longer than the "
                           f"stages' mean (busy ms per stage: {busy}): the others wait for it", None, fixes))
    return out


def _fewer_layers(layers: int, p: int) -> Optional[int]:
    """The most layers below layers/p an end stage can hold with the other p − 1 stages splitting
    the rest evenly (meshlm's and Megatron's rule for the uneven split); None if there is none."""
    return next((n for n in range(layers // p - 1, -1, -1) if (layers - n) % (p - 1) == 0), None)


def _memory(records: list, f: _Flags) -> Finding:
    peaks = [r["mem_max_allocated_gb"] for r in records if r.get("mem_max_allocated_gb") is not None]
    totals = [r["mem_total_gb"] for r in records if r.get("mem_total_gb")]
    if not peaks or not totals:
        return Finding("memory", "ok", "memory headroom: not recorded (a CPU run records no device memory)")
    peak, total = max(peaks), totals[-1]
    used = peak / total
    msg = f"peak memory {peak:.1f} GiB of {total:.1f} GiB ({100 * used:.0f}%, headroom {total - peak:.1f} GiB)"
    if used > MEMORY_TIGHT:
        fixes = []  # full recompute needs its method and layer count (pretrain refused it without)
        if f.recompute != "full":
            fixes.append(Fix({"--recompute-granularity": "selective"} if not f.recompute else
                             {"--recompute-granularity": "full", "--recompute-method": "uniform",
                              "--recompute-num-layers": "1"},
                             "recompute activations in backward" + (" (drop --recompute-activations, which means "
                                                                     "selective)" if f.switch_recompute else "")))
        if not f.zero:
            fixes.append(Fix({"--use-distributed-optimizer": None}, "shard the optimizer states over DP (ZeRO-1)"))
        elif f.zero < 3:
            fixes.append(Fix({"--data-parallel-sharding-strategy": ("optim_grads", "optim_grads_params")[f.zero - 1]},
                             "shard the gradients (ZeRO-2)" if f.zero == 1 else "shard the weights too (ZeRO-3)"))
        if f.micro and f.micro > 1:
            fixes.append(Fix({"--micro-batch-size": str(f.micro // 2)}, "half the activations"))
        return Finding("memory", "warn", msg + ": close to out of memory", used, fixes)
    if used < MEMORY_SPARE:
        fixes = [Fix(f.times(f.micro, 2, "--micro-batch-size"), "use the spare memory for larger GEMMs")]
        if f.recompute:  # no flag value turns it off: it is dropped (a bare --recompute-granularity is refused)
            fixes.append(Fix({}, "drop --recompute-granularity / --recompute-activations: no forward run again "
                                 "in backward"))
        return Finding("memory", "info", msg + ": room to spare", used, fixes)
    return Finding("memory", "ok", msg)


def _throughput(steady: list) -> Optional[Finding]:
    rates = [r["tokens_per_sec"] for r in steady if r.get("tokens_per_sec")]
    if len(rates) < 4:
        return None
    k = max(1, len(rates) // 3)
    first, last = statistics.median(rates[:k]), statistics.median(rates[-k:])
    change = last / first - 1
    msg = f"throughput {first:,.0f} → {last:,.0f} tokens/s (first vs last third of the logged iterations)"
    if change < -THROUGHPUT_DROP:
        return Finding("throughput", "warn", msg + f": dropped {100 * -change:.0f}%", -change,
                       [Fix({}, "look for other processes or throttling on the nodes, data loading (raise "
                                "--num-workers), or checkpoint saves in the window (--async-save)")])
    return Finding("throughput", "ok", msg)


def _loss(records: list, f: _Flags) -> list:
    """Loss spikes (the trainer's "loss_spike", or a jump over the previous records) and NaNs, with
    fixes from the run's settings: half its --lr, twice its warm-up (a tenth of the run from none) in
    the run's unit (--lr-warmup-samples for a --train-samples run, which refuses the iterations'
    flag), clipping only where it is off or looser than 1.0, bf16 only for an fp16 run (each was
    offered whatever the run had: --clip-grad 1.0 to a run clipping at 1.0, "bf16 instead of fp16"
    to an fp32 run)."""
    out, spikes = [], []
    for i, r in enumerate(records):
        loss = r.get("lm_loss")
        prev = [x["lm_loss"] for x in records[max(0, i - 5):i] if x.get("lm_loss") is not None]
        jump = loss is not None and len(prev) >= 3 and loss > SPIKE_RATIO * statistics.median(prev) \
            and loss - statistics.median(prev) > SPIKE_NATS
        if r.get("loss_spike") or jump:
            spikes.append(r["iteration"])
    if spikes:
        warmup = "--lr-warmup-samples" if f.by_samples else "--lr-warmup-iters"
        longer = str(2 * f.warmup) if f.warmup else str(max(1, f.length // 10)) if f.length else "longer"
        fixes = [Fix({"--lr": _lower_lr(f)}, "a smaller learning rate"),
                 Fix({warmup: longer}, "a longer warm-up")]
        if f.clip is None or f.clip == 0 or f.clip > 1.0:
            fixes.append(Fix({"--clip-grad": "1.0"}, "clip the gradient norm" +
                             (" (the run had it off)" if f.clip == 0 else "")))
        out.append(Finding("loss_spike", "warn", f"loss spikes at iteration(s) {', '.join(map(str, spikes))}", None,
                           fixes))
    nans = max((r.get("nan_iters") or 0) for r in records)
    skipped = max((r.get("skipped_iters") or 0) for r in records)
    if nans:
        fixes = [Fix({"--bf16": None}, "bf16 instead of fp16 (no overflow at the same range)")] \
            if f.fp16 is not False else []
        fixes.append(Fix({"--lr": _lower_lr(f)}, "a smaller learning rate; resume from the last checkpoint "
                                                 "before the first NaN"))
        out.append(Finding("nan", "warn", f"{nans} iteration(s) had a NaN/inf loss", None, fixes))
    elif skipped:
        out.append(Finding("nan", "info", f"{skipped} step(s) skipped for inf/NaN gradients (fp16 loss-scale "
                           f"back-off is normal at the start)"))
    return out


def _lower_lr(f: _Flags) -> str:
    """Half the run's --lr as a flag value, or "lower" (advice) when the config is unknown."""
    return f"{f.lr / 2:g}" if f.lr else "lower"


def _stragglers(steady: list) -> Optional[Finding]:
    rows = [r["rank_iter_s"] for r in steady if r.get("rank_iter_s")]
    if not rows:
        return None
    slow = {}
    for row in rows:
        median = statistics.median(row)
        worst = max(range(len(row)), key=row.__getitem__)
        if median > 0 and row[worst] > STRAGGLER_RATIO * median and row[worst] - median > MIN_EXCESS_S:
            slow.setdefault(worst, []).append(row[worst] / median - 1)
    rank, lags = max(slow.items(), key=lambda kv: len(kv[1]), default=(None, []))
    if rank is not None and len(lags) < STRAGGLER_INTERVALS:  # the live watch's patience: one slow step is no straggler
        return Finding("straggler", "ok", f"no straggler: rank {rank} was slow in {len(lags)} of {len(rows)} logged "
                       f"iterations only (a straggler is slow in at least {STRAGGLER_INTERVALS} and in most)")
    if rank is None or len(lags) * 2 < len(rows):
        return Finding("straggler", "ok", f"no straggler: every rank's compute time outside collectives within "
                       f"{100 * (STRAGGLER_RATIO - 1):.0f}% of the median rank's")
    lag = statistics.median(lags)
    return Finding("straggler", "warn", f"rank {rank} is the slowest in {len(lags)} of {len(rows)} logged "
                   f"iterations: its compute time outside collectives is {100 * lag:.0f}% above the median "
                   f"rank's, and every collective waits for it", lag,
                   [Fix({}, f"check rank {rank}'s node (other processes, clocks, a slower link or disk)")])


# ----------------------------------------------------------------------------- output

def format_report(report: dict, title: str = "") -> str:
    """The report as plain text: step breakdown, pipeline, findings with their fixes."""
    first, last = report["iterations"]
    lines = [f"meshlm analyze {title}".rstrip() + f": iterations {first}–{last}, "
             f"step {report['step_ms']:.1f} ms (median)"]
    lines += [f"  ({report['left_out']})"] if report.get("left_out") else []
    lines += ["", "where the step goes (exposed, share of the step):"]
    b = report["breakdown"]
    for kind, share in b.items():
        mark = "  ← dominant" if kind == report["dominant"] else ""
        part = "   (part of the bubble)" if kind == "pp" and "bubble" in b else ""
        lines.append(f"  {KIND_NAMES[kind]:<24} {100 * share:5.1f}%{part}{mark}")
    rest = max(0.0, 1.0 - sum(v for k, v in b.items() if k != "pp" or "bubble" not in b))
    lines.append(f"  {'compute and other':<24} {100 * rest:5.1f}%" +
                 ("  ← dominant" if report["dominant"] == "compute" else ""))
    lines += ["", "findings:"]
    for f in report["findings"]:
        lines.append(f"  [{f['severity']}] {f['message']}")
        lines += [f"      fix: {fix_text(fix)}" for fix in f["fixes"]]
    if report.get("predicted_by"):
        lines += ["", report["predicted_by"]]
    return "\n".join(lines)


def fix_text(fix: dict) -> str:
    """A fix (as in the report dict) in one line: its flags, why, and the predicted gain."""
    flags = " ".join(k if v is None else f"{k} {v}" for k, v in fix["flags"].items())
    return f"{flags + ': ' if flags else ''}{fix['why']}{_gain(fix['predicted_gain'])}"


def _gain(gain: Optional[float]) -> str:
    """" (planner: 25% faster)" / " (planner: 3.2% slower)"; "" without a prediction."""
    if gain is None:
        return ""
    pct = 100 * abs(gain)
    spec = ".0f" if pct >= 10 else ".1f"
    return f" (planner: {pct:{spec}}% {'faster' if gain >= 0 else 'slower'})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's directory (--run-dir), its logs/ folder "
                        "or its metrics.jsonl")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument("--no-predict", action="store_true", help="leave out the planner's predicted gain of "
                        "each fix")
    parser.add_argument("--gpu", default=None, help="predict for this GPU preset or calibrated profile's name "
                        "(default: the run's recorded device)")
    parser.add_argument("--gpu-profile", default=None, help="predict with this GPU profile JSON (meshlm plan "
                        "--calibrate)")


def run(args: argparse.Namespace, predictor: Optional[Predictor] = None) -> int:
    """Print the report of args.run_dir; the fixes' gains come from ``predictor``, by default the
    planner's (planner/predict.py) unless --no-predict (with --gpu or --gpu-profile: a ConfigError,
    the GPU named for predictions that are left out was ignored)."""
    if args.no_predict and (args.gpu or args.gpu_profile):
        named = f"--gpu {args.gpu}" if args.gpu else f"--gpu-profile {args.gpu_profile}"
        raise ConfigError(f"{named} names the GPU to predict for, and --no-predict leaves the predictions out; "
                          f"drop one of them")
    records, config = load_run(args.run_dir)
    note = None
    if predictor is None and not args.no_predict:
        from .gpus import resolve_gpu
        from .predict import planner_predictor
        gpu = resolve_gpu(args.gpu or "", args.gpu_profile) if args.gpu or args.gpu_profile else None
        predictor, note = planner_predictor(config, records, gpu)
    report = analyze(records, config, predictor)
    stopped = stop_finding(os.path.dirname(os.path.abspath(metrics_path(args.run_dir))))
    if stopped:
        report["findings"].insert(0, stopped)
    report["predicted_by"] = note
    from ..metrics_json import dumps
    print(dumps(report, indent=1) if args.json else format_report(report, args.run_dir))
    return 0
