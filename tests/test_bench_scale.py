"""rltlab.bench.scale: the repeat summaries and paired ratios on known inputs, the thread plan,
and a CPU smoke run of the whole bench (one repeat, tiny sizes, real 1- and 2-rank launches;
tests/test_distributed.py checks more 2-rank collections)."""
import json

import pytest

from rltlab.bench import scale


def test_paired_ratios_pair_by_repeat_not_by_median():
    many, one = [300.0, 150.0, 220.0], [100.0, 100.0, 200.0]
    out = scale.paired_ratios(many, one)
    assert out["per_repeat"] == [3.0, 1.5, 1.1]
    assert (out["median"], out["min"], out["max"]) == (1.5, 1.1, 3.0)
    # the ratio of the medians (220 / 100 = 2.2) is not what is reported
    assert out["median"] != pytest.approx(2.2)


def test_summarize_even_count_median_and_bad_inputs():
    assert scale.summarize([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}
    with pytest.raises(ValueError, match="at least one"):
        scale.summarize([])
    with pytest.raises(ValueError, match="equally long"):
        scale.paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="denominators"):
        scale.paired_ratios([1.0], [0.0])


def test_thread_plan_equal_total_on_cuda_per_rank_on_cpu():
    assert scale.thread_plan(16, None, 2, "cuda", 32) == ("equal_total", 16, 8)
    assert scale.thread_plan(None, None, 2, "cuda", 32) == ("equal_total", 32, 16)
    assert scale.thread_plan(None, None, 2, "cpu", 8) == ("per_rank", 4, 4)
    assert scale.thread_plan(None, 3, 2, "cuda", 32) == ("per_rank", 3, 3)
    with pytest.raises(ValueError, match="not both"):
        scale.thread_plan(16, 4, 2, "cuda", 32)
    with pytest.raises(ValueError, match="--total-threads 1"):
        scale.thread_plan(1, None, 2, "cuda", 32)


@pytest.mark.slow
def test_cpu_smoke_identity_and_timings(capsys):
    result = scale.main(["--device", "cpu", "--num-processes", "2", "--repeats", "1",
                         "--num-prompts", "8", "--max-tokens", "4", "--skip-train"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["identical_every_repeat"] and result["train"] is None
    assert [len(result["identity_per_repeat"]), len(result["runs"]["1"]),
            len(result["runs"]["2"])] == [1, 1, 1]
    assert result["identity_per_repeat"][0]["2"] == {    # 2 ranks vs the 1-process run
        "tokens_identical": True, "prompts_with_other_tokens": 0,
        "manifest_shards_identical": True, "content_sha256_identical": True}
    for p in ("1", "2"):
        for row in result["runs"][p]:
            assert row["output_tokens"] == 8 * 4 and row["processes"] == int(p)
            assert row["threads_per_rank"] == result["threads_per_rank"][p]
            # launch phases add up to the launch; launch + collection + exit to the whole job
            assert sum(row["launch_phases"].values()) == pytest.approx(row["launch_s"], abs=0.01)
            assert row["launch_phases"]["load_s"] > 0 and row["launch_s"] > row["launch_phases"][
                "load_s"]
            assert row["launch_s"] + row["seconds"] + row["exit_s"] == pytest.approx(
                row["job_s"], abs=0.05)
    ratios = [b["tokens_per_s"] / a["tokens_per_s"]
              for a, b in zip(result["runs"]["1"], result["runs"]["2"])]
    assert result["throughput_ratio"]["per_repeat"] == pytest.approx(ratios, abs=1e-3)
