"""tests/suite_order.py: the heavy tests lead every worker's slice, a shared module fixture stays on one worker."""

from types import SimpleNamespace

from suite_order import order


def _item(nodeid, module_scoped=False):
    defs = {"run": [SimpleNamespace(scope="module" if module_scoped else "function")]}
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def _slices(items, workers):
    out, left = [], list(items)
    for i in range(workers):  # xdist worksteal's initial split: len(pending) // workers_left each
        n = len(left) // (workers - i)
        out.append(left[:n])
        left = left[n:]
    return out


def test_heavy_units_lead_each_slice_longest_first():
    items = [_item(f"tests/test_a.py::t{i}") for i in range(10)] + \
            [_item(f"tests/test_report.py::r{i}", module_scoped=True) for i in range(3)] + \
            [_item(f"tests/test_z.py::t{i}") for i in range(7)]
    weights = {"tests/test_z.py::t6": 100.0, "tests/test_a.py::t9": 60.0, "tests/test_report.py::r0": 80.0,
               "tests/test_z.py::t0": 30.0}
    out = order(items, 2, weights)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items)
    first, second = _slices(out, 2)
    heads = {first[0].nodeid, second[0].nodeid}
    assert heads == {"tests/test_z.py::t6", "tests/test_report.py::r0"}  # the two longest start at once
    report = [i for i, s in enumerate((first, second)) for t in s if "test_report" in t.nodeid]
    assert len(set(report)) == 1  # the module fixture's tests share one worker
    load = [sum(weights.get(t.nodeid, 0) for t in s) for s in (first, second)]
    assert abs(load[0] - load[1]) <= 30.0  # LPT: 100+30 against 80+60


def test_no_table_or_one_worker_keeps_the_collected_order():
    items = [_item(f"tests/test_a.py::t{i}") for i in range(5)]
    assert order(items, 2, {}) == items
    assert order(items, 1, {"tests/test_a.py::t4": 9.0}) == items
