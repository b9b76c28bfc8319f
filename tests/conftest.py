import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

import suite_order  # noqa: E402  (tests/suite_order.py: the order under xdist, the durations table)


def pytest_addoption(parser):
    parser.addoption("--write-durations", metavar="FILE",
                     help="write each test's seconds (over 1 s) to FILE: tests/durations.json orders the suite")


def pytest_configure(config):
    path = config.getoption("--write-durations")
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(suite_order.Recorder(path), "meshlm-durations")


def pytest_collection_modifyitems(config, items):
    worker = getattr(config, "workerinput", None)  # an xdist worker (make test: --dist worksteal)
    if worker is not None:
        items[:] = suite_order.order(items, worker["workercount"])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
