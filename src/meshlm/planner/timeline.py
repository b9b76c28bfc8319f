"""The planner's predicted pipeline timeline of a layout, in the form meshlm logs the measured one.

Every pipeline rank's instruction list is ``parallel.schedules.build_schedule`` — the same action
order ``pipeline.forward_backward`` executes — run against the others by ``schedules.simulate``
with each F and B taking the planner's forward / backward time of one micro-batch on that model
stage (``cost.stage_times``) and each p2p step ``cost.p2p_seconds`` after both sides posted. The
events are {"stage": pipeline rank, "chunk", "mb", "kind": "F" | "B", "start", "end": seconds},
report/timeline.py's input, so the report draws the prediction beside the measurement.
"""

from __future__ import annotations

from ..config import Config, num_microbatches
from ..parallel.schedules import build_schedule, resolve_schedule, simulate
from .cost import p2p_seconds, stage_times
from .gpus import GPU
from .layout import Layout


def predicted_timeline(cfg: Config, world: int, gpu: GPU, vocab: int, *, gpus_per_node: int,
                       half: bool = True) -> list:
    """Predicted F/B events of one step of cfg on ``world`` ranks of ``gpu`` ([] when PP = 1).
    cfg must carry --global-batch-size. ConfigError for a layout meshlm would refuse."""
    lay = Layout.of(cfg, world)
    if lay.pp == 1:
        return []
    c = lay.apply(cfg)
    m = num_microbatches(c, world)
    name = resolve_schedule(c.parallel.pipeline_schedule, lay.pp, lay.vp)
    times = stage_times(cfg, lay, gpu, vocab, gpus_per_node=gpus_per_node, half=half)
    schedules = [build_schedule(name, lay.pp, r, m, lay.vp) for r in range(lay.pp)]
    events: list = []
    simulate(schedules, lay.pp, lay.vp, duration=lambda r, a: times[a.chunk * lay.pp + r][a.kind == "B"],
             p2p_time=p2p_seconds(c, lay, gpu, gpus_per_node, half), timeline=events)
    return sorted(events, key=lambda e: (e["stage"], e["start"]))
