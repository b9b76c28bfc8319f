"""Pipeline schedules as data and the stage partition: no processes, no model."""

import pytest

from meshlm.config import Config
from meshlm.errors import ConfigError
from meshlm.parallel.pipeline import stage_layers, validate_pipeline, virtual_size
from meshlm.parallel.schedules import (Action, P2P, analytic_bubble_fraction, build_schedule, format_schedule,
                                       resolve_schedule, simulate)

LAYOUTS = [("gpipe", pp, 1, m) for pp in (2, 3, 4) for m in (1, 3, 8)] + \
          [("1f1b", pp, 1, m) for pp in (2, 3, 4, 8) for m in (1, 2, 5, 8, 16)] + \
          [("interleaved", pp, v, m) for pp in (2, 3, 4) for v in (2, 3) for m in (pp, 2 * pp, 4 * pp)]


def _compute(steps):
    return [s for s in steps if isinstance(s, Action)]


@pytest.mark.parametrize("name,pp,v,m", LAYOUTS)
def test_every_forward_has_one_backward_after_it(name, pp, v, m):
    for rank in range(pp):
        seen_f, seen_b = set(), set()
        for a in _compute(build_schedule(name, pp, rank, m, v)):
            key = (a.mb, a.chunk)
            if a.kind == "F":
                assert key not in seen_f
                seen_f.add(key)
            else:
                assert key in seen_f and key not in seen_b, f"{a} before its forward"
                seen_b.add(key)
        assert seen_f == seen_b == {(mb, c) for mb in range(m) for c in range(v)}


@pytest.mark.parametrize("name,pp,v,m", LAYOUTS)
def test_schedules_never_deadlock_and_messages_match(name, pp, v, m):
    """Every rank's P2P steps pair up in posting order (NCCL's rule) and carry the same tensor."""
    for forward_only in (False, True):
        schedules = [build_schedule(name, pp, r, m, v, forward_only) for r in range(pp)]
        simulate(schedules, pp, v)


@pytest.mark.parametrize("pp,m", [(4, 8), (2, 3), (4, 2)])
def test_1f1b_warmup_is_pp_minus_rank_minus_one(pp, m):
    for rank in range(pp):
        kinds = "".join(a.kind for a in _compute(build_schedule("1f1b", pp, rank, m)))
        warmup = min(pp - rank - 1, m)
        assert kinds.startswith("F" * warmup + ("FB" if warmup < m else "B"))
        assert kinds.count("F") == kinds.count("B") == m


def test_interleaved_warmup_follows_megatron():
    """Warm-up forwards = 2(p − rank − 1) + (v − 1)·p, capped at m·v (Megatron get_pp_rank_microbatches)."""
    pp, v, m = 4, 2, 8
    for rank in range(pp):
        kinds = "".join(a.kind for a in _compute(build_schedule("interleaved", pp, rank, m, v)))
        warmup = len(kinds) - len(kinds.lstrip("F")) - 1  # the steady state starts with F then B
        assert warmup == min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)


def test_interleaved_visits_chunks_in_groups_of_pp_microbatches():
    fwd = [(a.mb, a.chunk) for a in _compute(build_schedule("interleaved", 2, 0, 4, 2)) if a.kind == "F"]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def test_gpipe_runs_all_forwards_first():
    kinds = "".join(a.kind for a in _compute(build_schedule("gpipe", 3, 1, 4)))
    assert kinds == "FFFFBBBB"


def test_first_and_last_stage_communicate_only_inward():
    first = build_schedule("1f1b", 4, 0, 4)
    last = build_schedule("1f1b", 4, 3, 4)
    first_ops = {op.kind for s in first if isinstance(s, P2P) for op in s.ops}
    last_ops = {op.kind for s in last if isinstance(s, P2P) for op in s.ops}
    assert first_ops == {"SEND_F", "RECV_B"} and last_ops == {"RECV_F", "SEND_B"}


def test_schedule_prints_as_one_line():
    text = format_schedule(build_schedule("1f1b", 2, 0, 2))
    assert text == "F0 [SEND_F0] F1 [SEND_F1 RECV_B0] B0 [RECV_B1] B1"


def test_simulated_bubble_matches_the_formula():
    """Unit-cost stages: idle share of the makespan = (p − 1)/(v·m + p − 1) on the first rank."""
    for name, pp, v, m in [("1f1b", 4, 1, 8), ("gpipe", 4, 1, 8), ("interleaved", 4, 2, 8)]:
        res = simulate([build_schedule(name, pp, r, m, v) for r in range(pp)], pp, v, 1 / v, 1 / v)
        busy = 2 * m  # m forwards and m backwards of total cost 1 each per rank
        assert abs((1 - busy / res.makespan) - analytic_bubble_fraction(pp, m, v)) < 1e-9


def test_1f1b_holds_fewer_microbatches_than_gpipe_in_simulation():
    pp, m = 4, 8
    one = simulate([build_schedule("1f1b", pp, r, m) for r in range(pp)], pp, 1).peak_in_flight
    all_ = simulate([build_schedule("gpipe", pp, r, m) for r in range(pp)], pp, 1).peak_in_flight
    assert one == [pp - r for r in range(pp)] and all_ == [m] * pp


def test_auto_schedule():
    assert resolve_schedule("auto", 1, 1) == "none"
    assert resolve_schedule("auto", 4, 1) == "1f1b"
    assert resolve_schedule("auto", 4, 2) == "interleaved"


# ----------------------------------------------------------------------------- partition

def _cfg(layers, pp, v=None, first=None, last=None, per_vstage=None, schedule="auto", micro=1, global_batch=None):
    cfg = Config()
    cfg.model.num_layers = layers
    p = cfg.parallel
    p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size = pp, v
    p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = first, last
    p.num_layers_per_virtual_pipeline_stage, p.pipeline_schedule = per_vstage, schedule
    cfg.training.micro_batch_size, cfg.training.global_batch_size = micro, global_batch
    return cfg


def test_even_split():
    assert stage_layers(_cfg(8, 4)) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_uneven_first_and_last_rest_split_over_middle():
    assert [len(r) for r in stage_layers(_cfg(10, 4, first=1, last=3))] == [1, 3, 3, 3]
    assert [len(r) for r in stage_layers(_cfg(9, 3, first=1))] == [1, 4, 4]


def test_interleaved_chunk_c_of_rank_r_is_model_stage_c_pp_plus_r():
    ranges = stage_layers(_cfg(8, 2, v=2))
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # rank 0 holds stages 0 and 2
    assert virtual_size(_cfg(8, 2, per_vstage=1)) == 4


def test_validate_reports_each_pipeline_mistake():
    assert validate_pipeline(_cfg(8, 4, global_batch=8), 4) == []
    assert any("--num-layers 7" in p for p in validate_pipeline(_cfg(7, 4), 4))
    assert any("middle stage" in p for p in validate_pipeline(_cfg(8, 4, first=1, last=2), 4))
    assert any("divisible by --virtual" in p for p in validate_pipeline(_cfg(12, 2, v=4), 2))
    assert any("multiple of --pipeline-model-parallel-size 4" in p
               for p in validate_pipeline(_cfg(8, 4, v=2, global_batch=6), 4))
    assert any("exclusive" in p for p in validate_pipeline(_cfg(8, 2, v=2, per_vstage=2), 2))
    assert any("needs --pipeline-model-parallel-size > 1" in p for p in validate_pipeline(_cfg(8, 1, v=2), 1))
    assert any("use interleaved" in p for p in validate_pipeline(_cfg(8, 2, v=2, schedule="1f1b"), 2))
    assert any("schedule none" in p for p in validate_pipeline(_cfg(8, 2, schedule="none"), 2))


def test_invalid_partition_raises_config_error():
    with pytest.raises(ConfigError, match="--num-layers 7"):
        stage_layers(_cfg(7, 2))
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        build_schedule("interleaved", 4, 0, 6, 2)
