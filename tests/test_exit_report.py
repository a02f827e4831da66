"""The N+2 verdict (rltlab.exit_predictor.report.acceptance) on hand-made rows and per-problem
scores: "beats Q-exit" needs a paired difference of at least 2 SE, and a missing or NaN
comparison is "not met"."""
import math

import pytest

from rltlab.exit_predictor.evaluate import add_paired
from rltlab.exit_predictor.report import acceptance

R, N = 4, 50


def _scores(correct: set[int]) -> list[float]:
    return [float(i in correct) for i in range(N)]


def _table(policies: dict[str, tuple[float, set[int]]]):
    """policy key "policy setting" -> (mean rounds, problems solved) -> rows, scores, with the
    paired difference vs depth R filled in by the experiment's own add_paired."""
    rows, scores = [], {}
    for key, (rounds, correct) in policies.items():
        policy, setting = key.split(" ", 1)
        scores[key] = _scores(correct)
        rows.append({"policy": policy, "setting": setting, "key": key, "mean_rounds": rounds,
                     "quality": 100 * len(correct) / N})
    return add_paired(rows, scores, f"fixed depth={R}"), scores


def _paired_pp(a: set[int], b: set[int]) -> tuple[float, float]:
    """Mean and SE (pp) of d_i = a_i - b_i for 0/1 scores, written out."""
    d = [float(i in a) - float(i in b) for i in range(N)]
    mean = sum(d) / N
    var = sum((x - mean) ** 2 for x in d) / (N - 1)
    return 100 * mean, 100 * math.sqrt(var / N)


FULL = set(range(30))            # depth 4 solves 30 of 50
Q_MID = set(range(28))           # Q-exit at 2.6 rounds: 28
BASE = {"fixed depth=4": (4.0, FULL), "q_exit t=0.5": (2.6, Q_MID),
        "q_exit t=0.9": (3.5, set(range(29))), "oracle oracle": (2.0, FULL)}


def test_a_two_problem_margin_does_not_beat_q_exit():
    """30 vs 28 solved with fewer rounds: +4 pp with a paired SE of 2.8 pp (z = 1.4). The old
    rule (quality > Q-exit quality, no SE) called this "beats"."""
    rows, scores = _table({**BASE, "n_plus_2 p>=0.5": (3.0, FULL - {29} | {45})})
    res = acceptance(rows, scores, "n_plus_2", R, max_loss_pp=0.5)
    assert res["setting"] == "p>=0.5" and res["q_exit_setting_at_same_rounds"] == "t=0.5"
    diff, se = _paired_pp(FULL - {29} | {45}, Q_MID)
    assert res["diff_vs_q_exit_pp"] == pytest.approx(diff) and diff == pytest.approx(4.0)
    assert res["diff_vs_q_exit_se_pp"] == pytest.approx(se)
    assert res["z_vs_q_exit"] == pytest.approx(diff / se) and diff / se < 2
    assert res["quality"] > res["q_exit_quality_at_same_rounds"]     # "better" by the means
    assert res["targets"]["beats_q_exit"] is False and res["met"] is False


def test_a_clear_paired_margin_beats_q_exit():
    """Solves 40 (every one Q-exit solves, and 12 more) at 2.6 rounds: z > 2."""
    better = set(range(40))
    rows, scores = _table({**BASE, "n_plus_2 p>=0.5": (2.6, better)})
    res = acceptance(rows, scores, "n_plus_2", R)
    diff, se = _paired_pp(better, Q_MID)
    assert res["diff_vs_q_exit_pp"] == pytest.approx(diff) == pytest.approx(24.0)
    assert res["diff_vs_q_exit_se_pp"] == pytest.approx(se) and diff >= 2 * se
    assert res["targets"] == {"saves_20pct": True, "reaches_80pct_of_oracle": False,
                              "beats_q_exit": True}
    assert res["rounds_saved_frac"] == pytest.approx((4 - 2.6) / 4)
    assert res["share_of_oracle_savings"] == pytest.approx((4 - 2.6) / (4 - 2.0))


def test_no_q_exit_point_at_these_rounds_is_not_met():
    """Below every Q-exit point's mean rounds there is nothing to compare with: the old rule
    counted the NaN as met."""
    rows, scores = _table({**BASE, "n_plus_2 p>=0.5": (2.2, FULL)})
    res = acceptance(rows, scores, "n_plus_2", R)
    assert math.isnan(res["q_exit_quality_at_same_rounds"])
    assert math.isnan(res["diff_vs_q_exit_pp"]) and res["targets"]["beats_q_exit"] is False
    assert res["met"] is False


def test_a_nan_quality_is_not_met():
    rows, scores = _table({**BASE, "n_plus_2 p>=0.5": (3.0, FULL)})
    for row in rows:
        if row["policy"] == "q_exit":
            row["quality"] = math.nan          # e.g. a failed evaluation
    res = acceptance(rows, scores, "n_plus_2", R)
    # the NaN Q-exit rows drop out; depth 4 (4.0 rounds) is not reachable at 3.0 rounds
    assert res["q_exit_setting_at_same_rounds"] is None
    assert res["targets"]["beats_q_exit"] is False


def test_select_only_cost_pairs_each_threshold_with_its_last_exited_twin():
    from rltlab.exit_predictor.report import select_only_cost

    le, so = set(range(20)), set(range(5, 29))        # LAST_EXITED 20 of 50, select-only 24
    rows, scores = _table({"fixed depth=4": (4.0, FULL), "q_exit t=0.5": (1.8, le),
                           "q_exit t=0.9": (3.1, FULL), "select_only t=0.5": (4.0, so),
                           "select_only t=0.7": (4.0, FULL)})
    next(r for r in rows if r["key"] == "select_only t=0.5")["mean_selected"] = 1.7
    (cost,) = select_only_cost(rows, scores)          # t=0.7 has no LAST_EXITED twin
    diff, se = _paired_pp(le, so)
    assert cost["setting"] == "t=0.5" and diff == pytest.approx(-8.0)
    assert cost["diff_pp"] == pytest.approx(diff) and cost["se_pp"] == pytest.approx(se)
    assert cost["z"] == pytest.approx(diff / se)
    assert (cost["last_exited_only"], cost["select_only_only"]) == (5, 9)
    assert (cost["last_exited_rounds"], cost["select_only_selected_rounds"],
            cost["select_only_executed_rounds"]) == (1.8, 1.7, 4.0)
