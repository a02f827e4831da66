"""The depth-gain benchmark script runs and reports both policies from one run
(not a timing test)."""
import pytest

from rltlab.bench.depth_gain import main


def test_depth_gain_reports_both_policies_and_the_ideal(capsys):
    res = main(["--preset", "tiny", "--device", "cpu", "--concurrency", "2", "--max-tokens", "4",
                "--prompt-len", "8", "--repeats", "1", "--pattern", "2,3", "--kv-gib", "0.05"])
    err = capsys.readouterr().err   # a bar per policy over its warm-up and timed runs
    assert "fixed_R" in err and "replay" in err and err.count("2/2") >= 2, err
    assert res["fixed_R"]["tokens"] == res["replay"]["tokens"] == 4 * 4
    # 4 requests replay "2,3" from offsets 0, 0, 1, 1: 2,3,2 twice and 3,2,3 twice
    assert res["replay_policy"] == "trace"
    assert abs(res["mean_executed_rounds"] - (2 * (2 + 3 + 2) + 2 * (3 + 2 + 3)) / 12) < 1e-9
    assert abs(res["ideal_gain"] - 4 / res["mean_executed_rounds"]) < 1e-9
    # the gains follow from the two runs' own figures (tok/s = tokens / wall time, rounded)
    assert res["tok_s_gain"] == pytest.approx(res["replay"]["tok_s"] / res["fixed_R"]["tok_s"])
    assert res["tpot_gain"] == pytest.approx(res["fixed_R"]["tpot_ms"] / res["replay"]["tpot_ms"])
    for run in (res["fixed_R"], res["replay"]):
        assert run["tok_s"] == pytest.approx(run["tokens"] / run["wall_s"], rel=1e-2)


def test_depth_gain_warms_up_on_the_timed_workload_itself(monkeypatch):
    """Each policy runs --warmup untimed passes of the same workload (same prompts,
    concurrency) before its timed repeats, so graph captures land outside the timing."""
    import rltlab.bench.depth_gain as dg

    calls = []
    real = dg.bench_engine

    def counting(llm, prompts, params, concurrency):
        calls.append((len(prompts), concurrency))
        return real(llm, prompts, params, concurrency)

    monkeypatch.setattr(dg, "bench_engine", counting)
    res = main(["--preset", "tiny", "--device", "cpu", "--concurrency", "2", "--max-tokens", "3",
                "--prompt-len", "8", "--repeats", "1", "--warmup", "2", "--kv-gib", "0.05"])
    assert calls == [(4, 2)] * 6          # 2 policies x (2 warm-up + 1 timed)
    assert res["warmup"] == 2 and res["repeats"] == 1


@pytest.mark.parametrize("flag", [["--warmup", "-1"], ["--repeats", "0"]])
def test_depth_gain_refuses_bad_counts_before_building_the_model(monkeypatch, flag):
    import rltlab.bench.depth_gain as dg

    monkeypatch.setattr(dg, "build_model", lambda args: pytest.fail("model built"))
    with pytest.raises(SystemExit, match="--warmup must be >= 0"):
        main(["--preset", "tiny", "--device", "cpu", *flag])
