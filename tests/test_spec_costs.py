"""The speculative cost model's formula (rltlab.bench.spec_costs) on known inputs: the
one-program speedup uses the head's own iteration time for trained heads."""
import pytest

from rltlab.bench.spec_costs import speedups_at_tau

COSTS = {"t_draft": 2.0, "t_target": 10.0, "t_token": 8.0, "t_verify": {4: 6.0},
         "t_iter": {4: 12.0}, "t_iter_head": {4: 16.0}}


def test_speedups_at_tau_by_hand():
    s = speedups_at_tau(COSTS, 4, 3.0)
    # target = min(10, 8) = 8; host = 5 * 2 + 6 = 16; one program = 3 * 8 / 12
    assert s["speedup_host_loop"] == pytest.approx(3.0 * 8 / 16)
    assert s["speedup_one_program"] == pytest.approx(2.0)
    assert s["t_iter_includes_head"] is False


def test_trained_head_pays_its_own_cost():
    s = speedups_at_tau(COSTS, 4, 3.0, head=True)
    assert s["speedup_one_program"] == pytest.approx(3.0 * 8 / 16)
    assert s["t_iter_includes_head"] is True
    no_head_timing = {k: v for k, v in COSTS.items() if k != "t_iter_head"}
    s = speedups_at_tau(no_head_timing, 4, 3.0, head=True)   # not measured: says so
    assert s["speedup_one_program"] == pytest.approx(2.0) and not s["t_iter_includes_head"]
