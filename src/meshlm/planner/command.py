"""``meshlm plan``: pretrain's flags plus a cluster → per-rank memory, ranked layouts, exclusions.

Prints (or, with --json, writes to stdout as one JSON document; bytes and seconds) the model, the
cluster, the LR and global batch of a published scaling law (``hyperparams``), launch warnings (``lint``), the memory and step time of the flags' own layout, the feasible
layouts fastest first with their exact flags, and why every other layout is excluded.
``--calibrate`` measures this machine instead and stores a GPU profile (``gpus.profile_dir()``).
When no layout fits it says what would (``nofit``) and exits with ``NO_FIT``. Given the run's length
(--train-iters, --train-samples or --train-tokens) it plans the campaign of the best layout and of the
flags' own (``campaign``: days, GPU-hours, failures, checkpoint interval, goodput; "campaign" in --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from ..config import default_nproc, global_batch, step_schedule
from .campaign import MTBF_GPU_HOURS, RESTART_S, WRITE_BYTES_PER_S
from .gpus import OVERRIDES, PRESETS, GiB, resolve_gpu, save_profile
from .hyperparams import recommend
from .layout import Layout

_CATEGORIES = ("weights", "grads", "optimizer", "activations", "loss")
NO_FIT = 3  # exit status when no layout fits (the plan and its "no_fit" advice are still printed)
# The search walks every layer of every layout it weighs (~1 ms a layer on one core, 12 s at 10,000): a
# deeper model is refused rather than searched for hours. The deepest published LLMs have 126 layers
# (Llama 3.1 405B, arXiv:2407.21783, Table 3).
MAX_LAYERS = 10_000
MAX_GPUS = 2 ** 20  # likewise --num-gpus: its divisors are searched in O(√n) (70 s at 2^40)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags (pretrain's flags are added by the CLI)."""
    g = parser.add_argument_group("cluster (meshlm plan)")
    g.add_argument("--num-gpus", type=int, default=None, help="GPUs of the job (default: the launch's world size)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (one NVLink domain; default: "
                   "--nproc-per-node, the workers meshlm starts on one node, else 8)")
    g.add_argument("--gpu", default=None, help=f"GPU preset ({', '.join(PRESETS)}) or a calibrated profile's name "
                   f"(default: H100-80GB; not with --gpu-profile)")
    g.add_argument("--gpu-profile", default=None, help="a GPU profile JSON (written by --calibrate)")
    for key, (_, _unit) in OVERRIDES.items():
        g.add_argument(f"--gpu-{key}", type=float, default=None, help=f"override the GPU's {key.replace('-', ' ')}")
    g.add_argument("--top", type=int, default=10, help="layouts to print")
    g.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    g.add_argument("--calibrate", action="store_true", help="measure this machine's GEMMs, memory bandwidth and "
                   "links and store a GPU profile (to --gpu-profile, or the profile folder)")
    g.add_argument("--quick", action="store_true", help="--calibrate with small shapes (seconds, CPU tests)")
    c = parser.add_argument_group("campaign (meshlm plan; the run's length: --train-iters, --train-samples or "
                                  "--train-tokens)")
    c.add_argument("--train-tokens", type=float, default=None, help="the run's length in tokens (e.g. 300e9), "
                   "instead of --train-iters or --train-samples")
    c.add_argument("--gpu-mtbf-hours", type=float, default=MTBF_GPU_HOURS, help="mean time between failures of "
                   f"one GPU, hours (default {MTBF_GPU_HOURS:,.0f}: Llama 3 §3.3.4, 419 unexpected interruptions "
                   "in 54 days on 16,384 GPUs)")
    c.add_argument("--ckpt-write-gbps", type=float, default=WRITE_BYTES_PER_S / 1e9, help="the storage's aggregate "
                   "checkpoint write bandwidth, GB/s (default 273: Narayanan et al. 2021 §5)")
    c.add_argument("--restart-minutes", type=float, default=RESTART_S / 60, help="minutes from a failure to "
                   "training again: requeue, start-up, checkpoint load (default 10, an assumption)")


def _row(name: str, lay: Layout, mem, time) -> str:
    return (f"{name:>4} {lay.describe():<26} {lay.micro_batch:>5} {lay.recompute_name:<18} "
            f"{lay.stage if lay.stage else 'no':>4} {mem.device_bytes / GiB:>8.1f} {time.total:>9.3f} "
            f"{time.tokens_per_s:>11,.0f} {time.mfu:>5.3f}  {' '.join(lay.flags())}")


def plan_vocab(cfg) -> tuple:
    """(vocabulary size, how it was found) for the plan: ``data.tokenizer.vocab_of``, except that a tokenizer
    file that is not on this machine (a cluster launch script's path) is not read: the vocabulary is
    then --vocab-size or vocab_of's default for the tokenizer type, and one note on stderr says which;
    so does a plan given no tokenizer and no --vocab-size at all (an assumed vocabulary).
    The plan needs only shapes, so no data or tokenizer file has to exist."""
    from ..data.tokenizer import vocab_of
    d = cfg.data
    absent = [f"--{name.replace('_', '-')} {getattr(d, name)}"
              for name in ("tokenizer_model", "vocab_file", "merge_file")
              if getattr(d, name) and not os.path.exists(getattr(d, name))]
    if not absent:
        vocab, source = vocab_of(cfg)
        if source.startswith("assumed"):
            print(f"meshlm plan: note: no tokenizer and no --vocab-size given; planning with vocabulary {vocab} "
                  f"({source}); give --vocab-size N or the tokenizer flags for the real one", file=sys.stderr,
                  flush=True)
        return vocab, source
    vocab, source = vocab_of(dataclasses.replace(cfg, data=dataclasses.replace(
        d, tokenizer_model=None, vocab_file=None, merge_file=None)))
    print(f"meshlm plan: note: {', '.join(absent)} not found here; planning with vocabulary {vocab} "
          f"({source}){'' if source == '--vocab-size' else '; give --vocab-size N for the real one'}",
          file=sys.stderr, flush=True)
    return vocab, f"{source} ({', '.join(absent)} not found)"


def _tflops(flops: float) -> str:
    """TFLOP/s for a line: whole above 10, else 3 significant digits (a CPU's 0.0015 printed as 0)."""
    tf = flops / 1e12
    return f"{tf:.0f}" if tf >= 10 else f"{tf:.3g}"


def _resolve_gpus_per_node(args, nproc) -> None:
    """Set args.gpus_per_node: as given, else --nproc-per-node (meshlm starts that many workers on
    one node: 16 of them were planned as two nodes of 8), else 8. ConfigError for --nproc-per-node
    above a given --gpus-per-node, or a --num-gpus that is not whole nodes."""
    from ..errors import ConfigError
    if args.gpus_per_node is None:
        args.gpus_per_node = nproc or 8
    elif nproc and nproc > args.gpus_per_node:
        raise ConfigError(f"--nproc-per-node {nproc} starts {nproc} workers on one node of --gpus-per-node "
                          f"{args.gpus_per_node}; give the real --gpus-per-node, or --num-gpus for a job of several "
                          f"nodes (without --nproc-per-node)")
    n = args.gpus_per_node
    if args.num_gpus and args.num_gpus > n and args.num_gpus % n:
        raise ConfigError(f"--num-gpus {args.num_gpus} is not whole nodes of --gpus-per-node {n}; give a multiple "
                          f"of {n} (or the real --gpus-per-node)")


def _hyperparameters(cfg, world: int, train_tokens) -> dict:
    """hyperparams.recommend as JSON for the run's compute budget, or {"note"} when the flags give
    no run length: the recommendation was for meshlm's default of 100 iterations (an 8B model was
    told --lr 0.0017 for 26M tokens), with nothing saying so."""
    t = cfg.training
    if t.train_iters is None and t.train_samples is None and train_tokens is None:
        return {"note": "give --train-iters, --train-samples or --train-tokens for the LR and batch of the run's "
                        "compute budget"}
    return recommend(cfg, world, train_tokens).to_json()


def _run_length_check(t) -> None:
    """ConfigError for a run length ``meshlm pretrain`` refuses (validate's rules), before the search:
    --train-samples below one global batch (no step: the campaign divided by zero), a
    --rampup-batch-size ramp with --train-iters (the ramp is sample-based) or of no schedule (0
    SAMPLES, START at the global batch: a ZeroDivisionError walking it)."""
    from ..errors import ConfigError
    from ..parallel.layout_rules import ramp_shape_problems
    shape = [] if t.rampup_batch_size is None else ramp_shape_problems(t.rampup_batch_size, t.global_batch_size)
    if shape:
        raise ConfigError(shape)
    if t.rampup_batch_size is not None and t.train_iters is not None:
        raise ConfigError("--rampup-batch-size needs --train-samples or --train-tokens (the ramp is sample-based, "
                          "as in Megatron); give the run's length in samples instead of --train-iters")
    if (t.rampup_batch_size is None and t.step_batch_size_schedule is None and t.train_samples is not None
            and t.train_samples < t.global_batch_size):
        raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch ({t.global_batch_size}): "
                          f"the run would take no step; raise --train-samples")


def _campaign(args, cfg, cand, vocab: int, world: int) -> dict:
    """campaign.campaign of one candidate layout as JSON, or {"note"} when the flags give no run length."""
    from ..batches import BatchSchedule
    from .campaign import campaign, run_length
    from .layout import Layout
    from .params import stage_params
    t, m = cfg.training, cfg.model
    schedule = BatchSchedule(t.global_batch_size, 1, tuple(t.rampup_batch_size) if t.rampup_batch_size else None,
                             step_schedule(cfg))
    length = run_length(t.train_iters, t.train_samples, args.train_tokens, schedule, m.seq_length)
    if length is None:
        return {"note": "give --train-iters, --train-samples or --train-tokens for the campaign"}
    steps, samples = length
    params = stage_params(Layout(micro_batch=cand.layout.micro_batch).apply(cfg), vocab)[0]  # the whole model
    return campaign(steps=steps, step_s=cand.time.total, global_batch=t.global_batch_size, seq_length=m.seq_length,
                    num_gpus=world, samples=samples, params=params, gpu_mtbf_hours=args.gpu_mtbf_hours,
                    write_bytes_per_s=args.ckpt_write_gbps * 1e9, restart_s=args.restart_minutes * 60,
                    async_save=cfg.checkpoint.async_save, save_interval=cfg.checkpoint.save_interval).to_json()


def _campaign_lines(c: dict) -> list:
    """The campaign as printed lines."""
    if "note" in c:
        return [f"campaign: {c['note']}"]
    out = [f"campaign (best layout): {c['steps']:,} steps, {c['tokens']:.3g} tokens: {c['train_days']:.1f} days "
           f"without failures, {c['gpu_hours']:,.0f} GPU-hours; job MTBF {c['job_mtbf_s'] / 3600:.1f} h "
           f"({c['gpu_mtbf_hours']:,.0f} h a GPU / {c['num_gpus']}); checkpoint {c['checkpoint_bytes'] / 1e9:,.0f} GB"]
    for mode, s in c["saves"].items():
        mark = " (your flags)" if mode == c["chosen"] and "yours" not in c["saves"] else ""
        name = f"your {s['flags']}" if mode == "yours" else f"{mode}{mark}"
        interval = f"every {s['interval_s'] / 60:.1f} min" if mode == "yours" else \
            f"Young/Daly interval {s['interval_s'] / 60:.1f} min = {s['flags']}"
        out.append(f"  {name}: save blocks {s['blocking_s']:.1f} s, durable after {s['durable_s']:.1f} s; "
                   f"{interval}; {s['wall_days']:.1f} days, {s['expected_failures']:.0f} failures expected, "
                   f"goodput {s['goodput']:.3f}")
    return out


def run(args: argparse.Namespace, config_and_source) -> int:
    """Run `meshlm plan` with parsed args; config_and_source is cli._config_and_source."""
    from .memory import estimate
    from ..config import moe_layer_pattern
    from .search import LONG_SEQUENCE, evaluate, layout_problems, search
    from .lint import lint
    finite = math.inf  # every value below is a finite number: an inf MTBF or bandwidth made a traceback
    cluster = [f"{flag} {value}: give {what}" for flag, value, ok, what in (
        ("--num-gpus", args.num_gpus, args.num_gpus is None or 1 <= args.num_gpus <= MAX_GPUS,
         f"the job's GPU count (1 to {MAX_GPUS:,})"),
        ("--gpus-per-node", args.gpus_per_node, args.gpus_per_node is None or args.gpus_per_node >= 1, "1 or more"),
        ("--top", args.top, args.top >= 0, "0 or more layouts to print"),
        ("--train-tokens", args.train_tokens, args.train_tokens is None or 1 <= args.train_tokens < finite,
         "a finite number of tokens, 1 or more"),
        ("--gpu-mtbf-hours", args.gpu_mtbf_hours, 0 < args.gpu_mtbf_hours < finite, "finite hours above 0"),
        ("--ckpt-write-gbps", args.ckpt_write_gbps, 0 < args.ckpt_write_gbps < finite, "finite GB/s above 0"),
        ("--restart-minutes", args.restart_minutes, 0 <= args.restart_minutes < finite, "a finite number of "
         "minutes, 0 or more")) if not ok]
    if args.train_tokens is not None and ({"training.train_iters", "training.train_samples"} & set(vars(args))):
        cluster.append("--train-tokens with --train-iters or --train-samples: give one run length")
    if cluster:
        from ..errors import ConfigError
        raise ConfigError(cluster)
    cfg, _ = config_and_source(args)
    if cfg.model.num_layers > MAX_LAYERS:
        from ..errors import ConfigError
        raise ConfigError(f"--num-layers {cfg.model.num_layers:,}: the planner plans at most {MAX_LAYERS:,} layers "
                          f"(it weighs every layer of every layout); give {MAX_LAYERS:,} or fewer")
    _resolve_gpus_per_node(args, cfg.parallel.nproc_per_node)
    from ..parallel.layout_rules import adjust
    adjust(cfg)  # as a launch would: no SP at TP = 1
    if args.quick and not args.calibrate:
        print("meshlm plan: note: --quick ignored without --calibrate: it shortens the measurement, and this plan "
              "measures nothing; add --calibrate to measure this machine", file=sys.stderr, flush=True)
    if args.calibrate:
        from .calibrate import calibrate, cpu_work_problem
        too_long = cpu_work_problem(cfg, args.quick)
        if too_long:
            from ..errors import ConfigError
            raise ConfigError(too_long)
        from ..folders import foreign_file_problem, output_file_problem, output_folder_problem
        from .gpus import profile_dir
        problem = (output_file_problem("--gpu-profile", args.gpu_profile, "gpu.json") or foreign_file_problem(
            "--gpu-profile", args.gpu_profile, "GPU profile", ("name", "peak_flops"))) if args.gpu_profile else \
            output_folder_problem("--calibrate's profile folder", profile_dir())
        if problem:  # before measuring, not after
            from ..errors import ConfigError
            raise ConfigError(problem + ("" if args.gpu_profile else
                                         " (set XDG_CACHE_HOME, or give --gpu-profile FILE)"))
        gpu = calibrate(cfg, quick=args.quick)
        path = save_profile(gpu, args.gpu_profile)
        print(json.dumps(gpu.to_json()) if args.json else f"meshlm plan: GPU profile of {gpu.name} written to {path}; "
              f"use it with --gpu-profile {path}")
        return 0
    gpu = resolve_gpu(args.gpu or ("" if args.gpu_profile else "H100-80GB"), args.gpu_profile,
                      {k: getattr(args, "gpu_" + k.replace("-", "_")) for k in OVERRIDES})
    world = args.num_gpus if args.num_gpus is not None else default_nproc(cfg)
    per_node = min(args.gpus_per_node, world)
    vocab, source = plan_vocab(cfg)
    cfg.training.global_batch_size = global_batch(cfg, world) or cfg.training.micro_batch_size
    _run_length_check(cfg.training)
    half = cfg.training.bf16 or cfg.training.fp16
    mine = Layout.of(cfg, world)
    warnings = lint(cfg, world, per_node, gpu, vocab)
    problems = layout_problems(cfg, mine, per_node)
    if mine.world != world:  # Layout.of floors DP: the flags' TP×CP×PP does not divide --num-gpus
        from ..parallel import layout_rules
        problems = layout_rules.layout_problems(cfg, world, "--num-gpus") + layout_rules.moe_problems(cfg, world)
    current = None if problems else evaluate(cfg, mine, gpu, vocab, per_node, half)
    fits, excluded = search(cfg, world, gpu, vocab, gpus_per_node=per_node, half=half)
    doc = {"model": {"num_layers": cfg.model.num_layers, "hidden_size": cfg.model.hidden_size,
                     "num_attention_heads": cfg.model.num_attention_heads, "seq_length": cfg.model.seq_length,
                     "vocab_size": vocab, "vocab_source": str(source),
                     "global_batch_size": cfg.training.global_batch_size},
           "cluster": {"num_gpus": world, "gpus_per_node": per_node, "gpu": gpu.to_json()},
           "warnings": warnings, "current": current.to_json() if current else {"problems": problems},
           "layouts": [f.to_json() for f in fits], "excluded": excluded,
           "hyperparameters": _hyperparameters(cfg, world, args.train_tokens)}
    from .safety import SAFE_FRACTION, is_safe
    safe = [i for i, f in enumerate(fits) if is_safe(f.memory.device_bytes, gpu.memory_bytes)]
    doc["safety"] = {"fraction": SAFE_FRACTION, "safe_bytes": SAFE_FRACTION * gpu.memory_bytes,
                     "current_safe": bool(current) and is_safe(current.memory.device_bytes, gpu.memory_bytes),
                     "fastest_safe": safe[0] if safe else None}  # an index into "layouts"
    if fits:
        doc["campaign"] = _campaign(args, cfg, fits[0], vocab, world)
    if current is not None:
        doc["current"]["campaign"] = _campaign(args, cfg, current, vocab, world)
    if not fits:
        from .nofit import no_fit_advice
        doc["no_fit"] = no_fit_advice(cfg, world, gpu, vocab, excluded, gpus_per_node=args.gpus_per_node, half=half)
    if args.json:
        from ..metrics_json import dumps
        print(dumps(doc))  # valid JSON: an infinite campaign (no progress between failures) as "Infinity"
        return 0 if fits else NO_FIT
    m = cfg.model
    print(f"model: {m.num_layers} layers, h {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
          f"vocabulary {vocab}; global batch {cfg.training.global_batch_size}")
    hp = doc["hyperparameters"]
    print(f"hyperparameters: {hp['note']}" if "note" in hp else recommend(cfg, world, args.train_tokens).line())
    print(f"cluster: {world} × {gpu.name} ({gpu.memory_bytes / GiB:.1f} GiB, {_tflops(gpu.peak_flops)} TFLOP/s bf16), "
          f"{per_node} per node; profile: {gpu.source}")
    for w in warnings:
        print(f"warning: {w}")
    if current is None:
        print("your layout cannot run: " + "; ".join(problems))
    else:
        mem, t = current.memory, current.time
        print(f"your layout {mine.describe()}, micro-batch {mine.micro_batch}, {mine.recompute_name} recompute "
              f"(stage {mem.stage}, {mem.params:,} parameters):")
        for k in _CATEGORIES:
            print(f"  {k:<12} {getattr(mem, k) / GiB:8.2f} GiB")
        print(f"  {'peak':<12} {mem.peak_bytes / GiB:8.2f} GiB (torch max allocated; grads "
              f"{'held' if mem.grads_at_peak else 'not yet allocated'} at the activation peak); device "
              f"{mem.device_bytes / GiB:.2f} GiB of {gpu.memory_bytes / GiB:.1f}")
        print(f"  activations: {mem.activations_per_layer / GiB:.3f} GiB a layer × {mem.in_flight:g} in flight")
        moe_cp = (f"EP {t.ep_comm:.3f}, " if mine.ep > 1 else "") + (f"CP {t.cp_comm:.3f}, " if mine.cp > 1 else "")
        print(f"  step {t.total:.3f} s: compute {t.compute:.3f} (recompute {t.recompute:.3f}), TP {t.tp_comm:.3f}, "
              f"{moe_cp}bubble {t.bubble:.3f}, PP p2p {t.pp_p2p:.3f}, DP exposed {t.dp_exposed:.3f} of {t.dp_comm:.3f}, "
              f"optimizer {t.optimizer:.3f}; {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.3f}; largest cost: {t.bottleneck}")
    print(f"feasible layouts: {len(fits)}, fastest first (memory per GPU incl. CUDA context; step s):")
    print(f"{'rank':>4} {'layout':<26} {'micro':>5} {'recompute':<18} {'ZeRO':>4} {'GiB':>8} {'step s':>9} "
          f"{'tokens/s':>11} {'MFU':>5}  flags")
    for i, f in enumerate(fits[:args.top]):
        print(_row(str(i + 1), f.layout, f.memory, f.time))
    sf = doc["safety"]
    if current is not None and not sf["current_safe"]:
        print(f"warning: your layout needs {current.memory.device_bytes / GiB:.1f} GiB, above the safety margin "
              f"({100 * sf['fraction']:.0f}% of {gpu.memory_bytes / GiB:.1f} GiB = {sf['safe_bytes'] / GiB:.1f} GiB): "
              f"it may run out of memory")
    if fits and sf["fastest_safe"] != 0:
        i = sf["fastest_safe"]
        print(f"note: rank 1 is above the safety margin ({100 * sf['fraction']:.0f}% of {gpu.name}'s memory); "
              + (f"the fastest safe layout is rank {i + 1}: {' '.join(fits[i].layout.flags())}" if i is not None
                 else "no layout is within it"))
    if fits:
        print(f"best layout's largest cost: {fits[0].time.bottleneck}")
        for line in _campaign_lines(doc["campaign"]):
            print(line)
    print(f"excluded ({len(excluded)}):")
    for e in excluded:
        print(f"  {e['layout']}: {e['reason']}")
    if cfg.model.seq_length >= LONG_SEQUENCE and any(moe_layer_pattern(cfg.model)) and cfg.training.fp8_format:
        print("  CP > 1: not searched for an FP8 MoE model (meshlm refuses --fp8-format with --num-experts and "
              "--context-parallel-size > 1)")
    elif cfg.model.seq_length < LONG_SEQUENCE:
        print(f"  CP > 1: not searched below a {LONG_SEQUENCE}-token sequence (give --context-parallel-size C "
              f"to plan your own CP layout above)")
    if not fits:
        print(f"meshlm plan: no layout fits {world} × {gpu.name}; what would fit:", file=sys.stderr)
        for line in doc["no_fit"]:
            print(f"  {line}", file=sys.stderr)
        return NO_FIT
    return 0
