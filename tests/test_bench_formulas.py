"""The benchmarks' derived figures on known inputs, against the formulas written out here: the
W4/W3 depth gain and its % of the ideal (bench.engine_checks), the speculative speedups implied
by measured costs at a tau (bench.spec_costs). The smoke tests that run the scripts can only
check that their figures follow from their own measurements (test_bench_*.py,
test_engine_static.py); a wrong formula needs known numbers."""
import pytest

from rltlab.bench.engine_checks import depth_gain
from rltlab.bench.spec_costs import implied, implied_at_measured_tau, speedups_at_tau


def _decode(tok_s, executed, selected):
    return {"decode": {"decode_tok_s": tok_s, "mean_executed_rounds": executed,
                       "mean_selected_rounds": selected}}


def test_depth_gain_and_pct_of_ideal():
    w3 = {"modes": {"eager": _decode(200.0, 4.0, 4.0), "gather": _decode(50.0, 4.0, 4.0),
                    "plain": _decode(80.0, 4.0, 4.0)}}
    w4 = {"modes": {"eager": _decode(230.0, 3.2, 2.5), "gather": _decode(40.0, 3.2, 2.5)}}
    out = depth_gain(w3, w4, num_rounds=4)
    assert set(out) == {"eager", "gather"}          # plain has no W4 run
    # gain = W4 tok/s / W3 tok/s; ideal = R / mean EXECUTED rounds (not selected: 4/2.5 = 1.6)
    assert out["eager"]["gain"] == pytest.approx(1.15)
    assert out["eager"]["ideal"] == pytest.approx(1.25)
    assert out["eager"]["pct_of_ideal"] == pytest.approx(92.0)
    assert out["gather"]["gain"] == pytest.approx(0.8) and out["gather"]["pct_of_ideal"] == \
        pytest.approx(64.0)
    assert out["eager"]["mean_selected_rounds"] == 2.5


COSTS = {"t_draft": 1e-3, "t_target": 4e-3, "t_token": 3e-3,
         "t_verify": {1: 4e-3, 2: 5e-3}, "t_iter": {1: 5e-3, 2: 6e-3}}


def test_speedups_at_tau():
    # target-only step: the faster of round by round (4 ms) and whole token (3 ms)
    s = speedups_at_tau(COSTS, 2, 1.75)
    assert s["speedup_host_loop"] == pytest.approx(1.75 * 3 / (3 * 1 + 5))      # 0.65625
    assert s["speedup_one_program"] == pytest.approx(1.75 * 3 / 6)              # 0.875
    gather = {**COSTS, "t_token": None, "t_iter": None}   # gather path: no whole-token step
    s = speedups_at_tau(gather, 1, 2.0)
    assert s["speedup_host_loop"] == pytest.approx(2.0 * 4 / (2 * 1 + 4))
    assert s["speedup_one_program"] is None


@pytest.mark.parametrize("alpha,tau", [(0.5, 1 + 0.5 + 0.25), (0.8, 1 + 0.8 + 0.64),
                                       (0.0, 1.0)])
def test_implied_tau_is_the_geometric_sum(alpha, tau):
    got_tau, host, one = implied(COSTS, 2, alpha)
    assert got_tau == pytest.approx(tau)
    assert host == pytest.approx(tau * 3 / 8) and one == pytest.approx(tau * 3 / 6)


def test_implied_at_measured_tau_uses_each_rows_d_and_tau():
    a = {"model": "m", "impl": {"engine": {1: COSTS, 2: {**COSTS, "t_draft": 2e-3}}}}
    row = {"impl": "engine", "config": "shallow d=1", "draft_rounds": 1, "tau": 2.0,
           "tau_by_kind": {"arithmetic": 2.5, "text": 1.5}}
    b = {"k": 2, "runs": [
        {"concurrency": 1, "temperature": 0.0, "rows": [
            row, {**row, "config": "head d=2", "draft_rounds": 2, "tau": 2.4, "tau_by_kind": {}},
            {"impl": "engine", "config": "target only", "draft_rounds": None, "tau": 1.0},
            {**row, "impl": "reference"}]},
        {"concurrency": 8, "temperature": 0.0, "rows": [row]}]}   # c = 8: not the cost model's
    out = implied_at_measured_tau(a, b)
    assert [r["config"] for r in out] == ["shallow d=1", "head d=2"]
    d1, d2 = out
    assert d1["speedup_one_program"] == pytest.approx(2.0 * 3 / 6)
    assert d1["speedup_host_loop"] == pytest.approx(2.0 * 3 / (3 * 1 + 5))
    assert d1["by_kind"]["arithmetic"]["speedup_one_program"] == pytest.approx(2.5 * 3 / 6)
    assert d1["by_kind"]["text"]["speedup_host_loop"] == pytest.approx(1.5 * 3 / 8)
    assert d2["speedup_host_loop"] == pytest.approx(2.4 * 3 / (3 * 2 + 5))     # d = 2's draft


def test_round_profile_times_the_c1_graph_the_run_captured():
    """StaticDecoder._graphs keys are (key, grouped): a whole-token graph ((1, depth), g) is
    timed per round over its depth, else the one-round graph (1, g); the gates graph of
    StaticDecoder.run ((1, "gates"), g) and other buckets are not c = 1 rounds."""
    from rltlab.bench.engine_checks import _c1_graph
    token, one, gates, other = (object() for _ in range(4))
    assert _c1_graph({((1, 4), False): token, (1, False): one}) == (4, token, "whole-token graph")
    assert _c1_graph({((1, "gates"), False): gates, (1, True): one}) == (1, one, "one-round graph")
    assert _c1_graph({((2, 3), False): other, (2, False): other}) == (1, None, "eager")


def test_round_profile_replays_the_graph_and_reports_it():
    """round_profile itself (the W1 bench calls it at c = 1 on the static path): it replays the
    graph _c1_graph picks, once to warm up and `repeats` times timed, and says which it timed."""
    from rltlab.bench.engine_checks import round_profile

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    class Decoder:
        _graphs = {((1, 4), False): Graph(), (1, False): object()}

        def _round(self, batch):
            raise AssertionError("timed an eager round though a graph was captured")

    out = round_profile(Decoder(), repeats=7)
    assert Graph.replays == 8 and out["timed"] == "whole-token graph"
    assert out["gpu_ms_per_round"] >= 0



def test_prefill_flops_split_into_matmul_and_attention():
    """Two 3-token prompts, 4 rounds of 100 linear weights, a 10-weight LM head, 8 FLOPs per
    query-key pair: matmul 4 x 2 x 100 x 6 + 2 x 10 x 2 = 4,840; attention 4 x 8 x 6 causal
    pairs x 2 prompts = 384; together the run's prefill_flops."""
    from rltlab.bench.ceilings import (ModelCosts, prefill_flops, prefill_flops_by_class,
                                       tflop_s_by_class)
    costs = ModelCosts(rounds=4, linear_params=100, layer_bytes=0, head_params=10, head_bytes=0,
                       attn_flops_per_pair=8, kv_bytes_per_position=0)
    work = {"prefill_tokens": 6, "requests": 2, "prefill_flops": 2 * prefill_flops(costs, 3)}
    assert prefill_flops_by_class(costs, work) == {"matmul": 4840, "attention": 384}
    # a class without kernel time (or without FLOPs) gets no rate
    assert tflop_s_by_class({"matmul": 2e12, "attention": 1e12},
                            {"matmul": 1000.0, "attention": 0.0, "other": 5.0}) == {"matmul": 2.0}
