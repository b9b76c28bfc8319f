"""bench/plan_accuracy.py's cases: every name once in the CASES literal (a repeated key would silently
replace a case already predicted or measured), and each committed prediction made for the flags the case
has now (a case is never edited after its prediction is committed)."""

import ast
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_case_names_are_unique_and_their_predictions_are_of_their_flags():
    tree = ast.parse(open(os.path.join(BENCH, "plan_accuracy.py")).read())
    literal = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(t, "id", None) == "CASES" for t in node.targets))
    names = [k.value for k in literal.keys]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    sys.path.insert(0, BENCH)
    import plan_accuracy
    committed = json.load(open(plan_accuracy.PREDICTIONS))
    changed = [n for n, p in committed.items() if n in plan_accuracy.CASES
               and p["flags"] != " ".join(plan_accuracy.CASES[n])]
    assert changed == []
