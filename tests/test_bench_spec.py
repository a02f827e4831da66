"""The speculative benchmark script runs end to end on CPU and reports what the write-up quotes
(a smoke test of the script, not a timing test)."""
import pytest
import torch

from rltlab.bench.spec import main

torch.set_num_threads(1)


@pytest.mark.slow
def test_spec_benchmark_reports_costs_tau_and_identity():
    res = main(["--preset", "tiny", "--device", "cpu", "--max-k", "2", "--repeats", "1",
                "--warmup", "0", "--train-steps", "2", "--train-rows", "16", "--prompts", "2",
                "--max-tokens", "6", "--concurrency", "1", "--temperatures", "0", "--k", "2",
                "--decode-path", "static", "--spec-loop", "both"])
    engine = res["a"]["impl"]["engine"]
    for d in ("1", "2"):
        costs = engine[d] if d in engine else engine[int(d)]
        assert costs["t_draft"] > 0 and costs["t_target"] > 0
        assert set(map(str, costs["t_verify"])) == {"1", "2"}
        assert costs["t_token"] > 0 and set(map(str, costs["t_iter"])) == {"1", "2"}
        for alpha, cell in costs["implied"][2].items():   # the formulas, written out
            tau = 1 + float(alpha) + float(alpha) ** 2
            assert cell["tau"] == pytest.approx(tau)
            assert cell["speedup_one_program"] == pytest.approx(tau * _target(costs)
                                                                / costs["t_iter"][2])
            assert cell["speedup"] == pytest.approx(
                tau * _target(costs) / (3 * costs["t_draft"] + costs["t_verify"][2]))
    rows = res["b"]["runs"][0]["rows"]
    configs = {(r["impl"], r["config"]) for r in rows}
    assert ("engine", "trained d=1") in configs and ("reference", "shallow d=2") in configs
    assert ("engine", "trained d=1 host loop") in configs
    implied = {r["config"]: r for r in res["c"]}   # (a)'s costs at (b)'s measured tau
    assert {"shallow d=1", "trained d=2 host loop"} <= set(implied)
    for r in implied.values():   # (a)'s costs at the tau (b) measured for that config
        costs = engine[r["d"]]
        measured = next(x for x in rows if x["impl"] == "engine" and x["config"] == r["config"])
        assert r["tau"] == measured["tau"]
        # a trained head drafts with its own cost: the iteration timed with a head at the shape
        assert r["t_iter_includes_head"] == (not r["config"].startswith("shallow"))
        t_iter = costs["t_iter_head" if r["t_iter_includes_head"] else "t_iter"][2]
        assert r["speedup_one_program"] == pytest.approx(r["tau"] * _target(costs) / t_iter)
    for row in rows:   # greedy speculation never changes the output
        assert row["identical"] == "2/2", row
        target = next(x for x in rows if x["impl"] == row["impl"]
                      and x["config"] == "target only")
        assert row["speedup"] == pytest.approx(row["tok_s"] / target["tok_s"])
        if row["config"] == "target only":
            assert row["tau"] == 1.0
        elif row["impl"] == "reference":   # K = 2 drafts every step: tau = 1 + K * acceptance
            assert row["tau"] == pytest.approx(1 + 2 * row["acceptance"])
        else:   # the engine drafts fewer near max_tokens: tau - 1 <= K * acceptance
            assert row["tau"] <= 1 + 2 * row["acceptance"] + 1e-9
    for row in rows:   # per-workload tau (1 arithmetic + 1 text prompt): overall is between
        if row["impl"] == "engine" and row["config"] != "target only":
            by = row["tau_by_kind"]
            assert set(by) == {"arithmetic", "text"}
            assert min(by.values()) - 1e-9 <= row["tau"] <= max(by.values()) + 1e-9
    for r in implied.values():   # per workload: the same costs at that workload's tau
        assert set(r["by_kind"]) == {"arithmetic", "text"}
        for v in r["by_kind"].values():
            for loop in ("speedup_host_loop", "speedup_one_program"):
                assert abs(v[loop] / v["tau"] - r[loop] / r["tau"]) < 1e-9


def _target(costs) -> float:
    """Target-only step time: the faster of round by round and whole token."""
    return min(costs["t_target"], costs["t_token"])
