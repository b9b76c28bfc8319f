"""The order the suite runs in under pytest-xdist's work stealing: the longest tests first on every worker.

``--dist worksteal`` hands worker i the i-th contiguous slice of the collected items (equal
counts), and a worker that runs dry steals from the *end* of the busiest one's queue. So a
100-second test collected late starts late and finishes after everything else: on 2 cores the
suite's wall time then swings by a minute or more between runs of the same code. ``order`` puts
the heavy units at the front of the slices, spread over the workers longest-first (LPT,
Graham 1969), and the light tests behind them, where stealing evens out the end.

A unit is one test, or a whole file whose tests share a module-scoped fixture (a training run
several checks read): split over two workers, that fixture would run twice. The weights are the
seconds each test took in a recorded run, tests/durations.json (tests under a second left out),
written by ``make durations`` (``--write-durations FILE``); a test missing from it weighs
nothing, so a stale table costs only a less even order, never a test.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

TABLE = os.path.join(os.path.dirname(__file__), "durations.json")
MIN_SECONDS = 1.0  # tests shorter than this are not worth a line in the table


def _weights() -> dict:
    try:
        with open(TABLE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _shares_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info else ()
    return any(d and d[-1].scope == "module" for d in defs)


def _units(items, weights: dict) -> list:
    """[(seconds, [items])]: files with a module-scoped fixture whole, other tests one by one."""
    files = defaultdict(list)
    for item in items:
        files[item.nodeid.split("::")[0]].append(item)
    units = []
    for tests in files.values():
        if any(_shares_module_fixture(t) for t in tests):
            units.append((sum(weights.get(t.nodeid, 0.0) for t in tests), tests))
        else:
            units += [(weights.get(t.nodeid, 0.0), [t]) for t in tests]
    return units


def order(items: list, workers: int, weights: dict = None) -> list:
    """``items`` reordered for ``workers`` work-stealing workers (see the module doc); the same
    items, each once. Worker i's slice holds the heavy units LPT gave it, then light tests up to
    the count xdist's initial split sends it (``len(pending) // workers_left``)."""
    weights = _weights() if weights is None else weights
    if workers < 2 or not weights:
        return items
    units = _units(items, weights)
    heavy = sorted((u for u in units if u[0] > 0), key=lambda u: -u[0])
    light = [t for w, tests in units if w <= 0 for t in tests]
    sizes, left = [], len(items)
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    bins = [[] for _ in range(workers)]
    load = [0.0] * workers
    for w, tests in heavy:  # longest first, onto the least-loaded worker whose slice has room
        room = [i for i in range(workers) if len(bins[i]) + len(tests) <= sizes[i]]
        if not room:
            light += tests
            continue
        i = min(room, key=lambda k: load[k])
        bins[i] += tests
        load[i] += w
    out = []
    for i in range(workers):
        take = sizes[i] - len(bins[i])
        out += bins[i] + light[:take]
        light = light[take:]
    return out + light


class Recorder:
    """Collects each test's seconds (setup + call + teardown) and writes the table at the end."""

    def __init__(self, path: str):
        self.path, self.seconds = path, defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self):
        table = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= MIN_SECONDS}
        with open(self.path, "w") as f:
            json.dump(table, f, indent=0, sort_keys=True)
            f.write("\n")
