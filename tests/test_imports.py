"""The package's house rules, read from the source with ``ast`` (nothing is imported, fast).

Every import of a meshlm module counts, at the top of a file or inside a function ("lazy"),
absolute or relative: a lazy import that closes a circle is still a circle. Two rules:

- no circles: no meshlm module reaches itself through imports;
- layers (docs/design.md, "Dependency direction"): each module belongs to one layer of ``LAYERS``
  and imports only modules of its own layer or of layers listed before it.

Imports by a name computed at run time (cli.py's ``import_module``) are not seen; cli.py is the top
layer, so whatever it reaches lies below it.
"""

from __future__ import annotations

import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src", "meshlm")

# Bottom to top. A name stands for the module of that name and, for a package, every module in it.
LAYERS = (
    ("base", ("meshlm", "meshlm.errors", "meshlm.values", "meshlm.yaml_file", "meshlm.folders",
              "meshlm.dtypes", "meshlm.batches", "meshlm.megatron_flags", "meshlm.presets", "meshlm.config",
              "meshlm.fast", "meshlm.flops", "meshlm.profile_ranges", "meshlm.straggler_rule",
              "meshlm.run_logs", "meshlm.metrics_json", "meshlm.mup", "meshlm.fp8_rules", "meshlm.shape_rules", "meshlm.host_memory",
              "meshlm.host_read")),
    ("parallel", ("meshlm.parallel",)),
    ("model", ("meshlm.model",)),
    ("optim", ("meshlm.optim",)),
    ("data", ("meshlm.data",)),
    ("checkpoint", ("meshlm.checkpoint",)),
    ("planner", ("meshlm.planner", "meshlm.planner.campaign", "meshlm.planner.nofit", "meshlm.planner.safety")),
    ("training", ("meshlm.training",)),
    ("run", ("meshlm.validate", "meshlm.dry_run", "meshlm.launch")),
    ("commands", ("meshlm.cli", "meshlm.__main__", "meshlm.inspect_checkpoint", "meshlm.report", "meshlm.sweep")),
)


def module_files(root: str, package: str = "meshlm") -> dict:
    """{dotted module name: path} of every .py file under ``root`` (a package's __init__ as the package)."""
    out = {}
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for name in files:
            if name.endswith(".py"):
                stem = name[:-3]
                out[".".join(parts if stem == "__init__" else parts + [stem])] = os.path.join(folder, name)
    return out


def _targets(node, module: str, is_package: bool, modules, package: str) -> list:
    """The meshlm modules one Import/ImportFrom node loads: ``from X import y`` is X.y when that is
    a module, else X; relative names resolve against ``module``."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    out = []
    for name in names:
        if name != package and not name.startswith(package + "."):
            continue
        while name not in modules and "." in name:  # `import meshlm.x.attr` style: the module part
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def import_graph(root: str, package: str = "meshlm") -> dict:
    """{module: set of meshlm modules it imports}, from every import statement anywhere in its file."""
    modules = module_files(root, package)
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        graph[module] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for t in _targets(node, module, is_package, modules, package) if t != module}
    return graph


def circles(graph: dict) -> list:
    """Every import circle: the sorted modules of each strongly connected component of more than one
    module (Tarjan's algorithm, iterative), sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_of(module: str, layers=LAYERS):
    """(index, name) of the layer whose longest matching entry names ``module``; None when none does."""
    best = None
    for i, (name, entries) in enumerate(layers):
        for entry in entries:
            matches = module == entry or (entry != "meshlm" and module.startswith(entry + "."))
            if matches and (best is None or len(entry) > best[0]):
                best = (len(entry), i, name)
    return None if best is None else best[1:]


def layer_breaks(graph: dict, layers=LAYERS) -> list:
    """Sorted lines "importer (layer) imports imported (layer): rule" for every import that reaches
    up a layer, and "module: in no layer" for a module ``layers`` does not place."""
    problems = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            problems.append(f"{module}: in no layer; add it to LAYERS in tests/test_imports.py and docs/design.md")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs[0] > mine[0]:
                problems.append(f"{module} ({mine[1]}) imports {target} ({theirs[1]}): a module imports only "
                                f"its own layer and those below it ({' < '.join(n for n, _ in layers)})")
    return problems


# ----------------------------------------------------------------------------- the real tree

@pytest.fixture(scope="module")
def graph():
    return import_graph(SRC)


def test_meshlm_has_no_import_circles(graph):
    assert circles(graph) == [], "import circles (lazy imports count): " + "; ".join(
        " ↔ ".join(c) for c in circles(graph))


def test_every_import_points_down_the_layers(graph):
    problems = layer_breaks(graph)
    assert problems == [], "\n".join(problems)


def test_the_walk_sees_lazy_and_relative_imports(graph):
    assert "meshlm.parallel.pipeline" in graph["meshlm.parallel.layout_rules"]  # inside a function, relative
    assert "meshlm.training.trainer" in graph["meshlm.launch"]  # lazy, relative, one level up
    assert "meshlm.checkpoint.dist" in graph["meshlm.inspect_checkpoint"]  # `from .checkpoint import dist`


# ----------------------------------------------------------------------------- the checks can fail

def test_a_planted_circle_is_named_with_its_modules():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"g"}, "g": {"f"}}
    assert circles(g) == [["a", "b", "c"], ["f", "g"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_an_upward_import_is_named_with_both_modules_and_the_rule():
    layers = (("low", ("meshlm.low",)), ("high", ("meshlm.high",)))
    g = {"meshlm.low.x": {"meshlm.high.y"}, "meshlm.high.y": {"meshlm.low.x"}, "meshlm.stray": set()}
    assert layer_breaks(g, layers) == [
        "meshlm.low.x (low) imports meshlm.high.y (high): a module imports only its own layer and those "
        "below it (low < high)",
        "meshlm.stray: in no layer; add it to LAYERS in tests/test_imports.py and docs/design.md"]


def test_a_circle_hidden_in_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "meshlm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from ..a import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("from meshlm.sub.b import f\nfrom . import b\nfrom .. import a\n")
    g = import_graph(str(pkg))
    assert g["meshlm.a"] == {"meshlm.sub.b"} and g["meshlm.sub.b"] == {"meshlm.a"}
    assert g["meshlm.sub.c"] == {"meshlm.sub.b", "meshlm.a"}
    assert circles(g) == [["meshlm.a", "meshlm.sub.b"]]
