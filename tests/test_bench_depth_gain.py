"""The depth-gain benchmark script runs and reports both policies from one run (not a timing test)."""
import pytest

from rltlab.bench.depth_gain import main


def test_depth_gain_reports_both_policies_and_the_ideal():
    res = main(["--preset", "tiny", "--device", "cpu", "--concurrency", "2", "--max-tokens", "4",
                "--prompt-len", "8", "--repeats", "1", "--pattern", "2,3", "--kv-gib", "0.05"])
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
