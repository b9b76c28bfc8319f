"""The planner's predictions for a recorded run: the gain of an analyzer fix, and the inputs of
the predicted pipeline timeline (timeline.py).

A run is modelled from its config (config.yaml, or a checkpoint's config.json, as a nested dict),
its world size (metrics.jsonl's ``world_size``; older records: the length of ``rank_iter_s``, else
--nproc-per-node × --nnodes) and its GPU (``gpus.gpu_of_device`` of the recorded ``device``: a
calibrated profile of that device, a preset, or the H200 preset for a CPU run, which the output
says). A fix's predicted gain is the share of time per sample that ``cost.step_time`` saves when
the fix's flags are applied to the run's config: 1 − (step'/batch') / (step/batch), so a fix that
doubles the global batch is judged by throughput, not by its longer step. It is None when a flag's
value is advice rather than a value ("×2", "lower"), when the changed layout is one meshlm would
refuse, or when the planner's model does not see the change (the same predicted time).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Optional

from ..config import Config, add_config_args, apply_mapping, config_from_args, global_batch
from ..errors import ConfigError, MeshlmError
from .gpus import GPU, gpu_of_device


@dataclass
class RunModel:
    """What the planner needs of a recorded run. cfg: its Config with --global-batch-size set;
    world: ranks; gpu and gpu_note (where the profile came from); vocab; half (bf16/fp16);
    gpus_per_node."""

    cfg: Config
    world: int
    gpu: GPU
    gpu_note: str
    vocab: int
    half: bool
    gpus_per_node: int


def world_of(config: dict, records: list) -> int:
    """The run's world size (see the module docstring)."""
    for r in reversed(records):
        if r.get("world_size"):
            return int(r["world_size"])
        if r.get("rank_iter_s"):
            return len(r["rank_iter_s"])
    p = config.get("parallel", {})
    if p.get("nproc_per_node"):
        return int(p["nproc_per_node"]) * int(p.get("nnodes") or 1)
    return int(p.get("tensor_model_parallel_size") or 1) * int(p.get("pipeline_model_parallel_size") or 1) \
        * int(p.get("context_parallel_size") or 1)


def run_model(config: dict, records: list, gpu: Optional[GPU] = None) -> RunModel:
    """The planner's view of a run (module docstring). gpu: a profile to use instead of the
    recorded device's. Raises ConfigError when the config does not load, or holds numbers, a shape
    or a layout (at the recorded world size) that a launch refuses."""
    from ..data.tokenizer import vocab_of
    from ..parallel import layout_rules
    from ..shape_rules import shape_problems
    cfg = Config()
    apply_mapping(cfg, config, "the run's config")
    world = world_of(config, records)
    problems = shape_problems(cfg)  # what a launch refuses: a TP of 0 or a sequence of 0 divided by zero here
    if not problems:
        layout_rules.adjust(cfg)
        problems = layout_rules.layout_problems(cfg, world) + layout_rules.moe_problems(cfg, world)
    if problems:
        raise ConfigError(f"its config.yaml: {problems[0]}")
    cfg.training.global_batch_size = global_batch(cfg, world)
    if gpu is None:
        device = next((r["device"] for r in reversed(records) if r.get("device")), None)
        gpu, note = gpu_of_device(device)
    else:
        note = f"profile {gpu.name} ({gpu.source})"
    try:
        vocab = vocab_of(cfg)[0]
    except MeshlmError:  # the tokenizer's files are not on this machine
        vocab = cfg.model.vocab_size or 32000
    per_node = min(world, cfg.parallel.nproc_per_node or 8)
    return RunModel(cfg, world, gpu, note, vocab, bool(cfg.training.bf16 or cfg.training.fp16), per_node)


def with_flags(cfg: Config, flags: dict) -> Optional[Config]:
    """A copy of cfg with meshlm pretrain flags applied ({flag: value}, None for a switch); None
    when a flag is unknown or its value is advice that no flag takes."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_config_args(parser)
    argv = [x for k, v in flags.items() for x in ([k] if v is None else [k, str(v)])]
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    if extra:
        return None
    return config_from_args(args, base=cfg.to_dict())


def refusal_check(config: Optional[dict], records: list):
    """A function flags → why meshlm would refuse the run's config with those flags applied ({flag:
    value}, None for a switch), or None when it would run: the layout, batch, pipeline and MoE rules
    (parallel/layout_rules.py, what a launch checks) at the run's world size. Flags whose values are
    advice ("×2", "smaller") are not judged (None), nor is any fix of a run whose config is unknown,
    does not load, or is itself refused by these rules (a partial config: nothing to compare with)."""
    from ..parallel import layout_rules
    from ..shape_rules import shape_problems

    def problems(cfg: Config, world: int) -> list:
        try:
            shape = shape_problems(cfg)  # a size of 0 first: the layout rules divide by it
            if shape:
                return shape
            layout_rules.adjust(cfg)
            return layout_rules.layout_problems(cfg, world) + layout_rules.moe_problems(cfg, world)
        except MeshlmError as e:
            return [str(e)]
    try:
        base, world = Config(), world_of(config or {}, records)
        apply_mapping(base, config, "the run's config") if config else None
        judged = bool(config) and not problems(copy.deepcopy(base), world)
    except (MeshlmError, ValueError, TypeError):
        judged = False

    def refused(flags: dict) -> Optional[str]:
        cfg = with_flags(base, flags) if judged else None
        found = problems(cfg, world) if cfg is not None else []
        return found[0] if found else None
    return refused


def seconds_per_sample(model: RunModel, cfg: Config) -> Optional[float]:
    """The planner's step time over the global batch for cfg on the run's world and GPU; None for
    a layout meshlm would refuse."""
    from .layout import Layout
    from .search import evaluate, layout_problems
    cfg = copy.deepcopy(cfg)
    cfg.training.global_batch_size = global_batch(cfg, model.world)
    lay = Layout.of(cfg, model.world)
    if layout_problems(cfg, lay, model.gpus_per_node):
        return None
    try:
        cand = evaluate(cfg, lay, model.gpu, model.vocab, model.gpus_per_node, model.half)
    except MeshlmError:
        return None
    return cand.time.total / cfg.training.global_batch_size


def planner_predictor(config: Optional[dict], records: list, gpu: Optional[GPU] = None) -> tuple:
    """(predictor for ``analyze``, one line saying what predicts) — (None, why not) when the run's
    config is unknown or cannot be modelled."""
    if not config:
        return None, "no predicted gains: the run's config (config.yaml) was not found"
    try:
        model = run_model(config, records, gpu)
        base = seconds_per_sample(model, model.cfg)
    except MeshlmError as e:
        return None, f"no predicted gains: the planner cannot model this run ({e})"
    if base is None:
        return None, "no predicted gains: the planner cannot model this run's layout"
    as_given = Config()  # its global batch unset where the run's was: a fix's flags derive it as a launch does
    apply_mapping(as_given, config, "the run's config")

    def predict(_config: Optional[dict], flags: dict) -> Optional[float]:
        cfg = with_flags(as_given, flags)
        after = seconds_per_sample(model, cfg) if cfg is not None else None
        if after is None or abs(after - base) <= 1e-12 * base:
            return None
        return 1.0 - after / base

    note = (f"predicted gains are the planner's step-time model (meshlm plan) for {model.world} × "
            f"{model.gpu.name}, from {model.gpu_note}; time per sample saved")
    return predict, note


def run_timeline(config: Optional[dict], records: list, gpu: Optional[GPU] = None) -> tuple:
    """(the planner's predicted pipeline timeline of the run's layout, or None; one line saying
    what predicts it, or why there is none)."""
    from .timeline import predicted_timeline
    if not config:
        return None, "no predicted timeline: the run's config (config.yaml) was not found"
    try:
        model = run_model(config, records, gpu)
        events = predicted_timeline(model.cfg, model.world, model.gpu, model.vocab,
                                    gpus_per_node=model.gpus_per_node, half=model.half)
    except MeshlmError as e:
        return None, f"no predicted timeline: the planner cannot model this run ({e})"
    return events or None, f"predicted timeline: the planner's model for {model.world} × {model.gpu.name}, " \
                           f"from {model.gpu_note}"

