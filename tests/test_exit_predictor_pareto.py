"""Paired comparisons on the quality / rounds plane (rltlab.exit_predictor.pareto) and the
select-only settings of the real-generation evaluation, checked by hand."""
import math

import numpy as np
import pytest
import torch

from rltlab.exit_predictor import pareto
from rltlab.exit_predictor.evaluate import add_paired, default_settings

R = 4


def _row(policy, setting, rounds, scores):
    return {"policy": policy, "setting": setting, "mean_rounds": rounds,
            "quality": 100 * float(np.mean(scores)), "key": f"{policy} {setting}"}


def _table(entries):
    rows = [_row(*e) for e in entries]
    scores = {r["key"]: list(map(float, e[3])) for r, e in zip(rows, entries)}
    add_paired(rows, scores, f"fixed depth={R}")
    return rows, scores


def test_upper_envelope_drops_points_under_a_chord_and_after_the_best():
    pts = [{"mean_rounds": x, "quality": y, "k": i} for i, (x, y) in enumerate(
        [(1.0, 20.0), (2.0, 30.0), (2.5, 80.0), (3.0, 85.0), (3.5, 90.0), (4.0, 88.0)])]
    env = pareto.upper_envelope(pts)
    # (2, 30) lies under the chord (1, 20) -> (2.5, 80); (3, 85) under (2.5, 80) -> (3.5, 90)
    # (exactly 85 on it: dropped too); (4, 88) is after the best vertex
    assert [p["k"] for p in env] == [0, 2, 4]
    mix = pareto.envelope_mixture(env, 3.0)
    assert [(m[0]["k"], round(m[1], 6)) for m in mix] == [(2, 0.5), (4, 0.5)]
    assert pareto.envelope_mixture(env, 3.9) == [(env[-1], 1.0)]
    assert pareto.envelope_mixture(env, 0.5) is None


def test_paired_difference_against_the_q_exit_mixture_by_hand():
    n = 40
    rng = np.random.default_rng(0)
    d1 = rng.integers(0, 2, n)
    d4 = np.ones(n)
    q = np.where(np.arange(n) < 30, 1.0, 0.0)             # Q-exit t=0.7 at 2.0 rounds: 75%
    pred = np.where(np.arange(n) < 36, 1.0, 0.0)          # predictor at 3.0 rounds: 90%
    rows, scores = _table([("fixed", "depth=1", 1.0, d1), ("fixed", "depth=4", 4.0, d4),
                           ("q_exit", "t=0.7", 2.0, q), ("n2", "p>=0.5", 3.0, pred)])
    res = pareto.compare_at_equal_rounds(rows, scores, "n2", R)
    (p,) = res["points"]
    # at 3.0 rounds the envelope mixes t=0.7 (2.0) and depth 4 (4.0) half and half
    ref = 0.5 * q + 0.5 * d4
    d = pred - ref
    assert p["diff_pp"] == pytest.approx(100 * d.mean())
    assert p["se_pp"] == pytest.approx(100 * d.std(ddof=1) / math.sqrt(n))
    assert p["z"] == pytest.approx(d.mean() / (d.std(ddof=1) / math.sqrt(n)))
    assert {r["setting"]: r["weight"] for r in p["reference"]} == pytest.approx(
        {"q_exit t=0.7": 0.5, "fixed depth=4": 0.5})
    assert res["beats_q_exit"] == (p["z"] >= 2)


def test_verdict_needs_one_significant_win_and_no_significant_loss():
    n = 100
    q = np.ones(n)
    worse = np.where(np.arange(n) < 80, 1.0, 0.0)          # 20 pp below at the same rounds
    rows, scores = _table([("fixed", "depth=1", 1.0, np.zeros(n)),
                           ("fixed", "depth=4", 4.0, np.ones(n)),
                           ("q_exit", "t=0.5", 2.0, q), ("n2", "p>=0.9", 2.0, worse)])
    res = pareto.compare_at_equal_rounds(rows, scores, "n2", R)
    assert res["points"][0]["z"] <= -2 and not res["beats_q_exit"]
    assert res["significantly_worse_at"] == ["p>=0.9"]
    # the same predictor quality as the Q-exit point at the same rounds: diff 0, no win
    rows, scores = _table([("fixed", "depth=1", 1.0, np.zeros(n)),
                           ("fixed", "depth=4", 4.0, np.ones(n)),
                           ("q_exit", "t=0.5", 2.0, q), ("n2", "p>=0.9", 2.0, q)])
    res = pareto.compare_at_equal_rounds(rows, scores, "n2", R)
    assert res["points"][0]["diff_pp"] == 0 and not res["beats_q_exit"]


def test_savings_share_against_the_quality_matched_oracle():
    n = 200
    full = np.ones(n)
    lossy = np.where(np.arange(n) < 180, 1.0, 0.0)        # -10 pp
    rows, scores = _table([("fixed", "depth=4", 4.0, full), ("oracle", "oracle", 1.1, lossy),
                           ("oracle_floor", "min=2", 2.2, full),
                           ("n2", "p>=0.9", 2.6, full), ("n2", "p>=0.5", 2.1, lossy)])
    res = pareto.savings_share(rows, "n2", R, max_loss_pp=0.5)
    # the plain oracle loses 10 pp: the floored one (2.2 rounds) is the quality-matched oracle
    assert res["quality_matched_oracle"]["setting"] == "min=2"
    assert res["point"]["setting"] == "p>=0.9"
    assert res["share"] == pytest.approx((4 - 2.6) / (4 - 2.2))
    assert res["met"] is False           # 0.78 < 0.8
    none = pareto.savings_share(rows[:2] + rows[3:4], "n2", R)   # no oracle within 0.5 pp
    assert math.isnan(none["share"]) and none["met"] is False


def test_per_problem_oracle_picks_the_cheapest_setting_that_keeps_each_problems_score():
    # three problems; decode rounds leave out each problem's first (prefill) token
    rows, scores = _table([("fixed", "depth=4", 4.0, [1, 1, 0]),
                           ("oracle", "oracle", 1.2, [1, 0, 0]),
                           ("oracle_floor", "min=3", 3.2, [1, 1, 1]),
                           ("n2", "p>=0.9", 3.5, [1, 1, 0])])
    executed = {"fixed depth=4": [[4, 4, 4], [4, 4], [4, 4, 4, 4]],
                "oracle oracle": [[4, 1, 1], [4, 2], [4, 1, 2, 1]],
                "oracle_floor min=3": [[4, 3, 3], [4, 3], [4, 3, 3, 4]]}
    res = pareto.savings_share(rows, "n2", R, scores=scores, executed=executed)
    oracle = res["per_problem_oracle"]
    # problem 0: the oracle (1.0); problem 1: the oracle fails where depth 4 succeeds, so the
    # floored oracle (3.0); problem 2: depth 4 fails too, so the oracle (4/3) is allowed
    assert oracle["problems_per_setting"] == {"oracle oracle": 2, "oracle_floor min=3": 1}
    assert oracle["mean_rounds"] == pytest.approx((2 + 3 + 4) / 6)
    assert oracle["decode_tokens"] == 6 and oracle["diff_pp"] == 0
    assert res["per_problem_share"] == pytest.approx((4 - 3.5) / (4 - 1.5))
    assert res["per_problem_met"] is False
    # the one-setting quality-matched oracle is the floored one, as before
    assert res["quality_matched_oracle"]["setting"] == "min=3"
    assert res["share"] == pytest.approx((4 - 3.5) / (4 - 3.2))
    del executed["oracle_floor min=3"]
    with pytest.raises(ValueError, match="oracle_floor min=3"):
        pareto.savings_share(rows, "n2", R, scores=scores, executed=executed)


def test_replay_pattern_drops_the_prefill_token_and_keeps_the_mix():
    executed = [[4, 3, 3, 2], [4, 4], [4, 2, 3, 3, 3, 4]]
    pat = pareto.replay_pattern(executed, 4)
    flat = [3, 3, 2, 4, 2, 3, 3, 3, 4]
    assert pat["tokens"] == len(flat) and pat["mean_rounds"] == pytest.approx(np.mean(flat))
    assert pat["pattern"] == [flat[1], flat[3], flat[5], flat[7]]
    with pytest.raises(ValueError):
        pareto.replay_pattern([[4], [4]], 3)


class _CharTokenizer:
    """Characters -> ids 1..60 (the tiny model's vocabulary), enough for evaluate_arithmetic."""

    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % 60 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + i % 10) for i in ids)


def test_select_only_settings_run_on_the_select_only_engine():
    from rltlab.engine import LLM
    from rltlab.exit_predictor.evaluate import evaluate_arithmetic_settings
    from tiny_models import tiny_engine_model

    torch.set_num_threads(1)
    model = tiny_engine_model(0)
    settings = [s for s in default_settings(R, {}, depths=[R], q_thresholds=[0.5],
                                            select_only_thresholds=[0.5])
                if s["policy"] in ("fixed", "q_exit", "select_only")]
    problems = [{"question": f"Q: a={i}; a=?\nA:", "answer": i, "kind": "hops", "hops": 0}
                for i in range(4)]
    tok = _CharTokenizer()
    llm = LLM(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="select_llm"):
        evaluate_arithmetic_settings(model, tok, llm, problems, settings, max_tokens=6)
    select = LLM(model, max_num_seqs=4, exit_semantics="select_only")
    executed = {}
    rows, scores = evaluate_arithmetic_settings(model, tok, llm, problems, settings,
                                                max_tokens=6, select_llm=select,
                                                executed=executed)
    by = {r["key"]: r for r in rows}
    so = by["select_only t=0.5"]
    assert so["mean_rounds"] == R and so["mean_selected"] < R     # runs all, selects earlier
    assert all(d == R for seq in executed["select_only t=0.5"] for d in seq)
    assert by["q_exit t=0.5"]["mean_rounds"] < R                  # LAST_EXITED really exits
    assert len(executed["q_exit t=0.5"]) == len(problems) == len(scores["q_exit t=0.5"])


def test_merge_keeps_a_repeated_setting_once_and_refuses_a_different_one():
    base = {"model_hash": "h", "problem_set": [{"kind": "hops"}] * 3, "max_tokens": 8,
            "reference": f"fixed depth={R}", "text": [], "predictors": {}}
    d4 = _row("fixed", "depth=4", 4.0, [1, 1, 0])
    a = {**base, "arithmetic": [d4, _row("q_exit", "t=0.5", 2.0, [1, 0, 0])],
         "scores": {d4["key"]: [1, 1, 0], "q_exit t=0.5": [1, 0, 0]},
         "executed_rounds": {d4["key"]: [[4]] * 3, "q_exit t=0.5": [[4, 2]] * 3}}
    b = {**base, "arithmetic": [dict(d4), _row("n2", "p>=0.5", 3.0, [1, 1, 1])],
         "scores": {d4["key"]: [1, 1, 0], "n2 p>=0.5": [1, 1, 1]},
         "executed_rounds": {d4["key"]: [[4]] * 3, "n2 p>=0.5": [[4, 3]] * 3}}
    merged = pareto.merge_results([a, b])
    assert [r["key"] for r in merged["arithmetic"]] == [d4["key"], "q_exit t=0.5", "n2 p>=0.5"]
    assert merged["arithmetic"][2]["diff_pp"] == pytest.approx(100 / 3)
    b["scores"][d4["key"]] = [1, 0, 0]
    with pytest.raises(ValueError, match="scored differently"):
        pareto.merge_results([a, b])


def test_per_kind_splits_em_and_rounds_by_problem_kind():
    res = {"problem_set": [{"kind": "hops", "hops": 2}, {"kind": "arith"},
                           {"kind": "hops", "hops": 3}],
           "arithmetic": [{"policy": "p", "setting": "s", "key": "p s"}],
           "scores": {"p s": [1.0, 0.0, 0.0]},
           "executed_rounds": {"p s": [[4, 4, 2], [4, 2, 2, 3], [4, 3]]}}
    (row,) = pareto.per_kind(res)
    assert row["hops"] == {"em": 50.0, "mean_rounds": pytest.approx(3.0),
                           "index1_rounds": pytest.approx(3.5)}
    assert row["arith"]["mean_rounds"] == pytest.approx(7 / 3) and row["arith"]["em"] == 0
    assert row["hops=2"]["index1_rounds"] == 4 and row["n"]["hops=3"] == 1


@pytest.mark.parametrize("kw", [{"text_rows": 0}, {"problems": 0}])
def test_empty_parts_are_refused_before_any_generation(tmp_path, monkeypatch, kw):
    """text_rows 0 used to fail only after every arithmetic setting had run (a misleading
    "held-out text too short"); now nothing is loaded or written first."""
    import rltlab.model.checkpoint as ckpt
    from rltlab.exit_predictor.evaluate import run

    monkeypatch.setattr(ckpt, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ValueError, match="problems and text_rows must be >= 1"):
        run(None, {}, tmp_path / "out", **{"problems": 2, "text_rows": 1, **kw})
    assert not (tmp_path / "out").exists()


def test_problem_offset_is_refused_when_negative_before_anything_is_written(tmp_path):
    from rltlab.exit_predictor.evaluate import run

    with pytest.raises(ValueError, match="problem_offset"):
        run(None, {}, tmp_path / "out", problems=2, problem_offset=-1)
    assert not (tmp_path / "out").exists()


def test_an_offset_slice_of_the_mixed_set_is_fresh_and_still_mixed():
    """evaluate.run takes eval_problems(offset + n)[offset:]: that is a confirmatory slice only
    because a longer set starts with the shorter one (prefix-stable) and repeats no question."""
    from rltlab.eval.problems import eval_problems
    from rltlab.common.paths import embedded_model_dir

    mdir = embedded_model_dir()       # eval/ holds 100 word problems: 400 needs generated ones
    first, longer = eval_problems(mdir, 200), eval_problems(mdir, 400)
    assert [p["question"] for p in longer[:200]] == [p["question"] for p in first]
    fresh = longer[200:]
    assert not {p["question"] for p in fresh} & {p["question"] for p in first}
    assert {p["kind"] for p in fresh} == {"hops", "arith"}


def test_cli_writes_the_analysis_and_reanalyse_recomputes_it_in_place(tmp_path, capsys):
    import json

    from rltlab.common.atomic import read_json

    rows, scores = _table([("fixed", "depth=4", 4.0, [1, 1, 0]),
                           ("fixed", "depth=1", 1.0, [0, 0, 0]),
                           ("q_exit", "t=0.5", 2.5, [1, 0, 0]),
                           ("oracle", "oracle", 1.5, [1, 0, 0]),
                           ("n2", "p>=0.9", 3.5, [1, 1, 0])])
    executed = {"fixed depth=4": [[4, 4, 4], [4, 4], [4, 4]],
                "fixed depth=1": [[4, 1, 1], [4, 1], [4, 1]],
                "q_exit t=0.5": [[4, 2, 3], [4, 3], [4, 2]],
                "oracle oracle": [[4, 1, 2], [4, 2], [4, 1]],
                "n2 p>=0.9": [[4, 3, 4], [4, 3], [4, 4]]}
    results = {"reference": f"fixed depth={R}", "problems": 3, "model_hash": "h",
               "problem_set": [{"kind": "hops", "hops": 1}] * 3, "max_tokens": 4, "text": [],
               "predictors": {}, "arithmetic": rows, "scores": scores,
               "executed_rounds": executed}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = tmp_path / "analysis.json"
    pareto.main(["--results", str(tmp_path / "results.json"), "--predictor", "n2",
                 "--out", str(out), "--command", "the command"])
    first = read_json(out)
    savings = first["analysis"]["n2"]["savings"]
    # problem 1: the oracle fails where depth 4 succeeds -> depth 4; else the oracle
    assert savings["per_problem_oracle"]["mean_rounds"] == pytest.approx((3 + 4 + 1) / 4)
    assert "per-problem oracle's" in capsys.readouterr().out
    # an analysis from before the per-problem oracle, recomputed from the embedded results
    del savings["per_problem_oracle"], savings["per_problem_share"]
    out.write_text(json.dumps(first))
    again = pareto.main(["--reanalyse", str(out), "--figures", str(tmp_path), "--stem", "p"])
    for analysis in (again["analysis"], read_json(out)["analysis"]):   # returned and written
        assert analysis["n2"]["savings"]["per_problem_share"] == pytest.approx(
            (4 - 3.5) / (4 - 2.0))
    assert again["commands"] == ["the command"] and (tmp_path / "p.png").is_file()
    before = out.read_text()
    with pytest.raises(SystemExit, match="no such policy"):
        pareto.main(["--reanalyse", str(out), "--predictor", "n3"])
    with pytest.raises(SystemExit, match="not a pareto.py output"):
        pareto.main(["--reanalyse", str(tmp_path / "results.json")])
    assert out.read_text() == before
