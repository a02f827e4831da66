"""The N+2 experiment's verdict and tables from evaluate.run's rows and per-problem scores
(results.json "arithmetic" and "scores"): the issue's acceptance targets per lookahead policy,
and markdown tables for the write-up."""
from __future__ import annotations

import math
from typing import Any

BEATS_Z = 2.0   # "beats Q-exit": the paired difference is at least this many SEs above 0


def acceptance(rows: list[dict], scores: dict[str, list[float]], label: str, R: int,
               max_loss_pp: float = 0.5, z: float = BEATS_Z) -> dict[str, Any]:
    """The issue's targets for policy `label`: at <= max_loss_pp EM loss vs depth R (paired
    mean difference), >= 20% fewer rounds than depth R, >= 80% of the oracle's savings, and
    better than stock Q-exit at equal mean rounds. scores: row key -> per-problem scores (the
    same problems in the same order for every row).

    "Better than Q-exit": against the best Q-exit point (on its Pareto front, depth R
    included) with at most the same mean rounds, the paired difference of per-problem scores
    is > 0 and >= z paired standard errors. No such Q-exit point, or a NaN, is "not met"."""
    from rltlab.eval.plots import pareto_front

    ok = [r for r in rows if r["policy"] == label and r["diff_pp"] >= -max_loss_pp]
    oracle = next((r for r in rows if r["policy"] == "oracle"), None)
    res: dict[str, Any] = {"policy": label, "max_loss_pp": max_loss_pp}
    if not ok:
        res.update(met=False, why=f"no setting within {max_loss_pp} pp of depth {R}")
        return res
    best = min(ok, key=lambda r: r["mean_rounds"])
    saved = (R - best["mean_rounds"]) / R
    oracle_saved = (R - oracle["mean_rounds"]) / R if oracle else math.nan
    q = [r for r in rows if (r["policy"] == "q_exit" or (r["policy"] == "fixed"
                                                         and r["setting"] == f"depth={R}"))
         and math.isfinite(r["mean_rounds"]) and math.isfinite(r["quality"])]
    front = [q[i] for i in pareto_front([r["mean_rounds"] for r in q],
                                        [r["quality"] for r in q])] if q else []
    # the best Q-exit point reachable with at most the same mean rounds (step interpolation)
    reach = [r for r in front if r["mean_rounds"] <= best["mean_rounds"] + 1e-9]
    q_row = max(reach, key=lambda r: r["quality"]) if reach else None
    vs_q = _versus(scores, best, q_row, z)
    res.update({
        "setting": best["setting"], "mean_rounds": best["mean_rounds"],
        "quality": best["quality"], "diff_pp": best["diff_pp"], "diff_se_pp": best["diff_se_pp"],
        "rounds_saved_frac": saved, "oracle_mean_rounds": oracle["mean_rounds"] if oracle
        else None, "oracle_saved_frac": oracle_saved,
        "share_of_oracle_savings": saved / oracle_saved if oracle_saved > 0 else math.nan,
        "q_exit_quality_at_same_rounds": q_row["quality"] if q_row else math.nan,
        "q_exit_setting_at_same_rounds": q_row["setting"] if q_row else None,
        "diff_vs_q_exit_pp": vs_q["diff_pp"], "diff_vs_q_exit_se_pp": vs_q["se_pp"],
        "z_vs_q_exit": vs_q["z"], "beats_q_exit_rule": f"paired diff > 0 and >= {z:g} SE",
        "targets": {"saves_20pct": saved >= 0.2,
                    "reaches_80pct_of_oracle": bool(oracle_saved > 0
                                                    and saved / oracle_saved >= 0.8),
                    "beats_q_exit": vs_q["beats"]}})
    res["met"] = all(res["targets"].values())
    # the quality-matched oracle: the oracle-like point (plain or floored oracle) with the
    # fewest rounds among those within max_loss_pp of depth R (informational: the issue's
    # target (b) is the plain oracle's savings, above)
    kept = [r for r in rows if r["policy"] in ("oracle", "oracle_floor")
            and r["diff_pp"] >= -max_loss_pp]
    if kept:
        qo = min(kept, key=lambda r: r["mean_rounds"])
        qo_saved = (R - qo["mean_rounds"]) / R
        res["quality_oracle"] = {
            "setting": f"{qo['policy']} {qo['setting']}", "mean_rounds": qo["mean_rounds"],
            "quality": qo["quality"], "saved_frac": qo_saved,
            "share_of_savings": saved / qo_saved if qo_saved > 0 else math.nan,
            "reaches_80pct": bool(qo_saved > 0 and saved / qo_saved >= 0.8)}
    return res


def _versus(scores: dict[str, list[float]], row: dict, other: dict | None, z: float
            ) -> dict[str, Any]:
    """Paired difference (pp) of row's per-problem scores minus other's, its SE, z and the
    verdict (diff > 0 and diff >= z SE; se 0: every problem moved the same way). No other row,
    or a non-finite figure: not met."""
    from rltlab.eval.metrics import paired_difference

    if other is None:
        return {"diff_pp": math.nan, "se_pp": math.nan, "z": math.nan, "beats": False}
    d = paired_difference(scores[row["key"]], scores[other["key"]])
    if not (math.isfinite(d.diff) and math.isfinite(d.se)):
        return {"diff_pp": 100 * d.diff, "se_pp": 100 * d.se, "z": math.nan, "beats": False}
    z_value = d.diff / d.se if d.se > 0 else (math.inf if d.diff > 0 else math.nan)
    return {"diff_pp": 100 * d.diff, "se_pp": 100 * d.se, "z": z_value,
            "beats": bool(d.diff > 0 and d.diff >= z * d.se)}


def select_only_cost(rows: list[dict], scores: dict[str, list[float]]) -> list[dict[str, Any]]:
    """What LAST_EXITED costs against select-only exit (docs/ouro.md, KV semantics) at the same
    Q-exit threshold: for each "select_only t=X" row that has a "q_exit t=X" row, the paired
    difference (pp) of LAST_EXITED minus select-only, its SE and z, with both settings'
    mean rounds. Select-only executes R rounds per token and only selects an earlier output
    round (its mean_selected); LAST_EXITED executes what it selects. Thresholds without a
    LAST_EXITED twin are left out."""
    from rltlab.eval.metrics import paired_difference

    last = {r["setting"]: r for r in rows if r["policy"] == "q_exit"}
    out = []
    for so in (r for r in rows if r["policy"] == "select_only"):
        le = last.get(so["setting"])
        if le is None:
            continue
        d = paired_difference(scores[le["key"]], scores[so["key"]])
        out.append({"setting": so["setting"], "last_exited_quality": le["quality"],
                    "select_only_quality": so["quality"], "diff_pp": 100 * d.diff,
                    "se_pp": 100 * d.se, "z": d.z if math.isfinite(d.z) else None,
                    "last_exited_only": d.a_only, "select_only_only": d.b_only,
                    "last_exited_rounds": le["mean_rounds"],
                    "select_only_selected_rounds": so.get("mean_selected", math.nan),
                    "select_only_executed_rounds": so["mean_rounds"]})
    return out


def markdown_tables(results: dict[str, Any]) -> str:
    """Markdown tables of a results.json (arithmetic, text, throughput, acceptance)."""
    lines = ["| policy | setting | EM (%) | SE | paired diff vs depth 4 (pp) | SE | mean "
             "executed rounds | wins/losses |", "|---|---|---|---|---|---|---|---|"]
    for r in results["arithmetic"]:
        lines.append(f"| {r['policy']} | {r['setting']} | {r['quality']:.1f} | "
                     f"{r['quality_se']:.1f} | {r['diff_pp']:+.1f} | {r['diff_se_pp']:.1f} | "
                     f"{r['mean_rounds']:.3f} | {r['wins']}/{r['losses']} |")
    lines += ["", "| policy | setting | text loss (nats/token) | ppl | mean rounds |",
              "|---|---|---|---|---|"]
    for r in results["text"]:
        lines.append(f"| {r['policy']} | {r['setting']} | {r['loss']:.4f} | {r['ppl']:.2f} | "
                     f"{r['mean_rounds']:.3f} |")
    if results.get("throughput"):
        lines += ["", "| policy | C | requests | tok/s | speedup vs depth 4 | TTFT ms | TPOT ms |"
                  " mean rounds |", "|---|---|---|---|---|---|---|---|"]
        for r in results["throughput"]:
            lines.append(f"| {r['policy']} | {r['concurrency']} | {r['requests']} | "
                         f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['ttft_ms']:.0f} | "
                         f"{r['tpot_ms']:.0f} | {r['mean_rounds']:.2f} |")
    return "\n".join(lines)
