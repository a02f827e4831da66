"""rltlab.bench.paired on the tiny model (CPU, eager, 2% workloads): the two workloads of a
pair alternate loops on one engine, and each round's gain is its own two loops' ratio."""

import json
import statistics
from types import SimpleNamespace

import pytest

from rltlab.bench import ceilings
from rltlab.bench.models import build_model
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.paired import main as paired_main

ARGS = ["--preset", "tiny", "--device", "cpu", "--scale", "0.02", "--kv-gib", "0.05",
        "--modes", "eager"]


def test_rounds_alternate_and_each_gain_is_its_own_loops_ratio(tmp_path):
    out = tmp_path / "paired.json"
    res = paired_main(ARGS + ["--pair", "W4/W3", "--loops", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    pair = res["pairs"]["W4/W3"]["eager"]
    assert pair["complete"] is True
    # round 0: W3 then W4; round 1: W4 then W3; round 2: W3 then W4
    assert [list(r) for r in pair["rounds"]] == [["W3", "W4"], ["W4", "W3"], ["W3", "W4"]]
    ratios = [r["W4"]["tok_s"] / r["W3"]["tok_s"] for r in pair["rounds"]]
    assert pair["e2e_gain"] == pytest.approx(ratios, abs=5e-4)
    assert len(set(pair["e2e_gain"])) > 1   # three loops, not one figure copied
    ideal = pair["ideal_e2e_gain"]
    assert ideal == pytest.approx(ceilings.ideal_e2e_gain(
        pair["prefill_s"], pair["decode_s"], pair["cheap_rounds"], pair["base_rounds"]),
        abs=2e-3)
    assert pair["cheap_rounds"] < pair["base_rounds"] == 4.0
    # from the printed gains and ideal, each rounded to 3 decimals (5e-4 each, the ideal's
    # weighted by pct / 100: 2e-3 covers pct up to 300%), magnified by 100 / (ideal - 1), plus
    # the pct's own rounding
    rounding = 100 * 2e-3 / (ideal - 1) + 0.05
    assert pair["pct_of_ideal_e2e"] == pytest.approx(
        [100 * (g - 1) / (ideal - 1) for g in pair["e2e_gain"]], abs=rounding)
    assert pair["median_pct_of_ideal_e2e"] == statistics.median(pair["pct_of_ideal_e2e"])
    assert pair["range_pct_of_ideal_e2e"] == [min(pair["pct_of_ideal_e2e"]),
                                             max(pair["pct_of_ideal_e2e"])]
    for loop in (r[w] for r in pair["rounds"] for w in ("W3", "W4")):
        assert 0 < loop["pct_of_ceiling"] < 100
    pcts = pair["pct_of_ideal_e2e"]
    assert pair["mean_pct_of_ideal_e2e"] == pytest.approx(statistics.mean(pcts), abs=0.05)
    assert pair["se_pct_of_ideal_e2e"] == pytest.approx(statistics.stdev(pcts) / 3 ** 0.5,
                                                        abs=0.05)
    # W3 at 2%: 5 prompts of 20 tokens, prefilled once each in the prefill-only loop
    costs = ModelCosts.of(build_model(SimpleNamespace(model=None, preset="tiny", device="cpu",
                                                      dtype="float32")))
    assert pair["prefill_flops"] == 5 * ceilings.prefill_flops(costs, 20)
    assert pair["prefill_pct_of_matmul"] == pytest.approx(
        100 * pair["prefill_flops"] / pair["prefill_s"] / 1e12 / res["matmul_tflop_s"],
        abs=0.06)   # the pct rounded to 0.1, prefill_s to 1e-4 s


def test_a_run_stopped_early_keeps_its_finished_rounds(tmp_path, monkeypatch):
    """The --out file is rewritten after every round: a run killed before its decode phases
    (a device's time limit) still holds the loops it ran, marked incomplete."""
    import rltlab.bench.paired as paired

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after the rounds")
    monkeypatch.setattr(paired, "decode_phase", stop)
    out = tmp_path / "paired.json"
    with pytest.raises(RuntimeError, match="stopped"):
        paired_main(ARGS + ["--pair", "W4/W3", "--loops", "2", "--out", str(out)])
    kept = json.loads(out.read_text())["pairs"]["W4/W3"]["eager"]
    assert kept["complete"] is False
    assert [sorted(r) for r in kept["rounds"]] == [["W3", "W4"]] * 2
    assert all(r[w]["tok_s"] > 0 for r in kept["rounds"] for w in r)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        paired_main(ARGS + ["--loops", "0"])
    with pytest.raises(SystemExit):
        paired_main(ARGS + ["--modes", "nonsense"])
    with pytest.raises(SystemExit):
        paired_main(ARGS + ["--pair", "W3/W4"])


def test_prompt_spread_draws_mixed_lengths_and_runs_the_pair(monkeypatch):
    """--prompt-spread: prompts of lengths around prompt_len (the engine sized for the longest),
    the same prompts for both workloads of the pair; 0 leaves the one-length prompts as they
    were."""
    from rltlab.model.presets import longest_prompt, random_prompts
    same = random_prompts(50, 40, 61, seed=7)
    assert {len(p) for p in same} == {40}
    mixed = random_prompts(200, 40, 61, seed=7, spread=0.5)
    lengths = [len(p) for p in mixed]
    assert min(lengths) >= 20 and max(lengths) <= longest_prompt(40, 0.5) == 60
    assert len(set(lengths)) > 20 and 36 < statistics.mean(lengths) < 44
    assert mixed == random_prompts(200, 40, 61, seed=7, spread=0.5)   # seeded
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="spread"):
            random_prompts(4, 40, 61, seed=7, spread=bad)
        with pytest.raises(SystemExit):
            paired_main(ARGS + ["--prompt-spread", str(bad)])
    import rltlab.bench.paired as paired
    closed_loop, seen = paired.engine_checks.closed_loop, set()

    def spy(llm, prompts, *args, **kwargs):
        seen.update(len(p) for p in prompts)
        return closed_loop(llm, prompts, *args, **kwargs)
    monkeypatch.setattr(paired.engine_checks, "closed_loop", spy)
    res = paired_main(ARGS + ["--pair", "W7/W6", "--loops", "1", "--prompt-spread", "0.5"])
    assert len(seen) > 1, seen   # the loops ran prompts of several lengths
    assert res["prompt_spread"] == 0.5
    assert res["pairs"]["W7/W6"]["eager"]["complete"] is True
