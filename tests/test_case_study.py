"""docs/case-study-175b.md holds the planner's figures: regenerated from `meshlm plan --json`
(bench/case_study.py), it must equal the committed file. When the planner changes, rerun
`PYTHONPATH=src python bench/case_study.py` and commit the document with the change."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
sys.path.insert(0, BENCH)


@pytest.mark.slow
def test_the_case_study_is_the_planners_output():
    import case_study
    p = case_study.plans()
    with open(case_study.DOC) as fh:
        committed = fh.read()
    assert committed == case_study.render(p), "docs/case-study-175b.md differs from the planner: regenerate it"
    a100 = p["A100-80GB"]["campaign"]
    assert f"{a100['train_days']:.1f} days without failures" in committed  # a figure, read back from the plan
    assert f"`{a100['saves']['sync']['flags']}`" in committed
