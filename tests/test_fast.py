"""fast.eager: compiled code calls an eager function outside its graph, and a worker that compiles
nothing never imports dynamo (about 0.6 s of its start-up)."""

import subprocess
import sys

import pytest

CHECK = """
import sys
import torch
import meshlm.training.trainer
from meshlm import fast
assert "torch._dynamo" not in sys.modules, "importing the trainer imported dynamo"

seen = []

@fast.eager
def add_one(x):
    seen.append(torch.compiler.is_compiling())  # True while dynamo traces it into a graph
    return x + 1

fast._before_compile()  # what compile_fn and compile_module do first
double = torch.compile(lambda x: add_one(x) * 2, backend="eager")
assert double(torch.ones(3)).tolist() == [4.0, 4.0, 4.0]
assert seen == [False], seen
"""


@pytest.mark.slow
def test_an_eager_function_runs_outside_the_compiled_graph_and_dynamo_is_imported_only_to_compile():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
