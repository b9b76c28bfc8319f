"""The pipeline timeline as a Chrome trace (the JSON trace-event format that Perfetto,
chrome://tracing and TensorBoard's trace viewer read).

One process per pipeline stage (``pid``; named ``<run> stage <r>`` by a process_name metadata
event), one thread per kind (``tid`` 1 forward, 2 backward), one complete event (``"ph": "X"``,
``ts``/``dur`` in microseconds) per F or B of a micro-batch chunk.
"""

from __future__ import annotations

import json

KINDS = {"F": (1, "forward"), "B": (2, "backward")}


def trace_events(events: list, run: str = "run", pid_base: int = 0) -> list:
    """Trace events of one timeline (timeline.py's event dicts); ``pid_base`` keeps the stages of
    several runs apart (stage r of this run is pid ``pid_base + r``)."""
    t0 = min(e["start"] for e in events)
    stages = sorted({e["stage"] for e in events})
    out = []
    for r in stages:
        pid = pid_base + r
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"{run} stage {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, label in KINDS.values():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
    for e in sorted(events, key=lambda e: (e["stage"], e["start"])):
        tid, label = KINDS[e["kind"]]
        out.append({"ph": "X", "name": f'{e["kind"]}{e["mb"]}' + (f'.{e["chunk"]}' if e.get("chunk") else ""),
                    "cat": label, "pid": pid_base + e["stage"], "tid": tid,
                    "ts": 1e6 * (e["start"] - t0), "dur": 1e6 * (e["end"] - e["start"]),
                    "args": {"micro_batch": e["mb"], "chunk": e.get("chunk", 0)}})
    return out


def write_trace(timelines: list, path: str) -> None:
    """Write [(run name, events)] to ``path`` as {"traceEvents": […], "displayTimeUnit": "ms"};
    the i-th run's stages get pids from 1000·i on."""
    events = []
    for i, (name, tl) in enumerate(timelines):
        events += trace_events(tl, name, 1000 * i)
    from ..folders import write_text_file
    write_text_file(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), "--trace")
