"""The rules of a global batch that changes during the run: --step-batch-size-schedule's text and
sizes, and the interleaved pipeline's rule for every batch a schedule or --rampup-batch-size ramp
takes. Each returns its problems as lines naming the flag and the fix (layout_rules, so meshlm.validate
and meshlm plan); the schedule's text is checked before them (shape_rules.schedule_syntax_problems).
"""

from __future__ import annotations

from ..config import Config, batch_schedule, step_schedule
from ..shape_rules import SCHEDULE_FLAG as FLAG


def step_schedule_problems(cfg: Config, world: int, dp: int) -> list:
    """The schedule with the other batch flags and the layout: not with --rampup-batch-size or
    --gradient-accumulation-steps; --global-batch-size only equal to the last entry's batch
    (Megatron-LM refuses the two together; its GPT-3 example gives both, agreeing); every entry's
    batch a multiple of micro × DP (Megatron checks the batch of the step it resumes at; meshlm
    checks them all before the run); the interleaved schedule's rule for each."""
    t = cfg.training
    steps = step_schedule(cfg)
    if steps is None:
        return []
    problems = [f"{FLAG} and {other} are exclusive: each sets the global batch of the steps; give one"
                for other, given in (("--rampup-batch-size", t.rampup_batch_size),
                                     ("--gradient-accumulation-steps", t.gradient_accumulation_steps)) if given]
    last = steps[-1][1]
    if t.global_batch_size is not None and t.global_batch_size != last:
        problems.append(f"--global-batch-size {t.global_batch_size} disagrees with the last {FLAG} entry's batch "
                        f"{last} (the schedule's global batch); drop --global-batch-size")
    step = t.micro_batch_size * dp
    odd = [(threshold, batch) for threshold, batch in steps if batch % step]
    if odd:
        threshold, batch = odd[0]
        problems.append(f"{FLAG}: the batch {batch} from sample {threshold:,} is not divisible by --micro-batch-size "
                        f"{t.micro_batch_size} × DP {dp} = {step}; nearest valid: {nearest_multiples(batch, step)}"
                        + (f" ({len(odd)} entries are not)" if len(odd) > 1 else ""))
    return problems or interleaved_problems(cfg, world, FLAG, "the schedule's", "every entry's batch")


def nearest_multiples(value: int, step: int) -> str:
    """The multiples of ``step`` nearest ``value`` (the one above alone when none is below), for a fix."""
    lo = (value // step) * step
    return f"{lo} or {lo + step}" if lo > 0 else f"{lo + step}"


def interleaved_problems(cfg: Config, world: int, flag: str, whose: str, fix: str) -> list:
    """Every global batch a ramp or schedule takes must be a multiple of PP micro-batches under the
    interleaved 1F1B schedule (Megatron's rule with microbatch_group_size_per_vp_stage = PP,
    parallel/pipeline.py schedule_problem); the other schedules take any number. whose: the batches'
    owner in the line ("the ramp's"), fix: what the user makes a multiple ("START and INCREMENT")."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if pp == 1:
        return []
    from .pipeline import resolve_schedule, virtual_size
    if resolve_schedule(cfg.parallel.pipeline_schedule, pp, virtual_size(cfg)) != "interleaved":
        return []
    schedule = batch_schedule(cfg, world)
    odd = [size for size in schedule.sizes() if (size // schedule.micro_dp) % pp]
    if not odd:
        return []
    step = schedule.micro_dp
    return [f"{flag}: {whose} global batch {odd[0]} is {odd[0] // step} micro-batches, but interleaved 1F1B needs a "
            f"multiple of --pipeline-model-parallel-size {pp}; make {fix} multiples of micro × DP × PP = "
            f"{step * pp}"]
