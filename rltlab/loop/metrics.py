"""What the loop reports: Pareto curves, depth histograms, the gate-curve verdict, metrics.json."""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Sequence

from rltlab.loop.config import LoopState


def curve_points(ev: dict[str, Any]) -> list[tuple[float, list[float]]]:
    """(mean executed rounds, per-problem scores) of the Q-exit rows of an evaluation."""
    return [(r["mean_rounds"], ev["scores"][r["key"]]) for r in ev["rows"]
            if r.get("threshold") is not None and r["mean_rounds"] is not None
            and not math.isnan(r["mean_rounds"])]


def compare_evaluations(before: dict[str, Any], after: dict[str, Any], z: float = 2.0
                        ) -> dict[str, Any]:
    """Paired Pareto-curve comparison (rltlab.eval.curves) of two Q-exit sweeps."""
    from rltlab.eval.curves import compare_curves

    res = compare_curves(curve_points(before), curve_points(after), z=z)
    return {"before_version": before["version"], "after_version": after["version"], **res}


def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("executed_hist", "scores")}


def curves(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quality-vs-depth rows of version 0 ("before" of iteration 0), every "after", and the
    lookahead predictor of every iteration that trained one (at the iteration's version)."""
    rows = []
    if results:
        rows += results[0]["before"]["rows"]
    for res in results:
        rows += (res.get("exit_predictor") or {}).get("rows", [])
        rows += res["after"]["rows"]
    return [_strip(r) for r in rows]


def depth_histograms(results: Sequence[dict[str, Any]], threshold: float
                     ) -> dict[str, dict[int, int]]:
    """Executed-depth histograms (first output token excluded) of the Q-exit at the swept
    threshold nearest to `threshold`, per weight version (version 0 and every "after")."""
    evals = ([results[0]["before"]] if results else []) + [r["after"] for r in results]
    swept = sorted({row["threshold"] for ev in evals for row in ev["rows"]
                    if row.get("threshold") is not None})
    if not swept:
        return {}
    t = min(swept, key=lambda x: abs(x - threshold))
    out = {}
    for ev in evals:
        for row in ev["rows"]:
            if row.get("threshold") == t:
                out[f"v{row['weight_version']} t={t:g}"] = {
                    int(k): v for k, v in row["executed_hist"].items()}
    return out


def gate_curve_report(results: Sequence[dict[str, Any]], z: float = 2.0) -> dict[str, Any]:
    """The issue-#5 check: the final gate's Q-exit Pareto curve on the held-out problems vs
    version 0's, and every iteration's after vs before (rltlab.eval.curves rule)."""
    if not results:
        return {"no_worse": None, "why": "no iterations"}
    final = compare_evaluations(results[0]["before"], results[-1]["after"], z)
    per = [compare_evaluations(r["before"], r["after"], z) for r in results]
    return {"rule": final["rule"], "z": z, "eval_problems": final["n"],
            "heldout_overlap_with_rollouts": sum(r.get("heldout_overlap_with_rollouts", 0)
                                                 for r in results),
            "final_vs_v0": final, "per_iteration": per,
            "no_worse": final["no_worse"],
            "no_worse_every_iteration": all(p["no_worse"] is True for p in per),
            "gates_accepted": [r["gate_training"].get("accepted", True) for r in results]}


def _predictor_summary(r: dict[str, Any]) -> dict[str, Any] | None:
    ep = r.get("exit_predictor")
    if not ep:
        return None
    cal = next((x for x in ep["rows"] if x.get("calibrated")), ep["rows"][0])
    return {"weight_version": ep["weight_version"], "model_hash": ep["model_hash"],
            "checkpoint": ep["checkpoint"], "threshold": ep["threshold"],
            "temperature": ep["temperature"], "test": ep["test"],
            "quality": cal["quality"], "mean_rounds": cal["mean_rounds"],
            "diff_vs_full_pp": cal.get("diff_vs_full_pp"),
            "diff_vs_full_se_pp": cal.get("diff_vs_full_se_pp"),
            "q_exit_quality_at_same_rounds": cal.get("q_exit_quality_at_same_rounds"),
            "diff_vs_q_exit_pp": cal.get("diff_vs_q_exit_pp"),
            "diff_vs_q_exit_se_pp": cal.get("diff_vs_q_exit_se_pp"), "seconds": ep["seconds"]}


def _draft_summary(r: dict[str, Any]) -> dict[str, Any] | None:
    dh = r.get("draft_head")
    if not dh:
        return None
    keys = ("weight_version", "model_hash", "component", "kind", "draft_rounds", "k", "prompts",
            "train_tokens", "best_step", "tau", "acceptance", "tau_shallow", "acceptance_shallow",
            "tau_gain", "identical_at_t0", "speedup_vs_target", "speedup_vs_shallow", "seconds")
    return {**{k: dh.get(k) for k in keys},
            "heldout_agree": dh["heldout_agreement"]["trained"]["agree"],
            "heldout_agree_shallow": dh["heldout_agreement"]["shallow"]["agree"]}


def loop_metrics(state: LoopState) -> dict[str, Any]:
    res = state.results
    per_iter = []
    for r in res:
        g = r["gate_training"]
        per_iter.append({
            "iteration": r["iteration"], "rollout_weight_versions": r["rollout_weight_versions"],
            "trace_weight_versions": r["trace_weight_versions"],
            "new_weight_version": r["new_weight_version"], "trace_tokens": r["trace_tokens"],
            "gate_loss_before": g["loss_before"], "gate_loss_after": g["loss_after"],
            "gate_val_loss_before": g.get("val_before"), "gate_val_loss_after": g.get("val_after"),
            "gate_best_step": g.get("best_step"), "gate_accepted": g.get("accepted", True),
            "gate_validation_passed": g.get("validation_passed"),
            "gate_reasons": g.get("reasons", []),
            "exit_predictor": _predictor_summary(r), "draft_head": _draft_summary(r),
            "started": r["started"], "seconds": r["seconds"]})
    headline = {"iterations": len(res), "final_weight_version": state.llm.get_weight_version()}
    gate_curve = gate_curve_report(res, state.cfg.curve_z)
    if res:
        def best(rows):  # quality at the lowest threshold's mean depth
            first = min((x for x in rows if x.get("threshold") is not None),
                        key=lambda x: x["threshold"])
            return first["quality"], first["mean_rounds"]
        q0, d0 = best(res[0]["before"]["rows"])
        q1, d1 = best(res[-1]["after"]["rows"])
        headline.update({"quality_v0_lowest_t": q0, "mean_rounds_v0_lowest_t": d0,
                         "quality_final_lowest_t": q1, "mean_rounds_final_lowest_t": d1,
                         "gate_curve_no_worse": gate_curve["no_worse"]})
        worst = gate_curve["final_vs_v0"].get("worst_point")
        if worst:
            headline.update(gate_curve_worst_diff_pp=worst["diff_pp"],
                            gate_curve_worst_se_pp=worst["se_pp"],
                            gate_curve_worst_at_rounds=worst["mean_rounds"])
        last_p = _predictor_summary(res[-1])
        if last_p:
            headline.update(lookahead_quality=last_p["quality"],
                            lookahead_mean_rounds=last_p["mean_rounds"])
        last_d = _draft_summary(res[-1])
        if last_d:
            headline.update(draft_tau=last_d["tau"], draft_tau_shallow=last_d["tau_shallow"])
    return {"headline": headline, "iterations": per_iter, "curves": curves(res),
            "gate_curve": gate_curve, "resumed_from": state.resumed_from,
            "eval_problems": len(state.problems), "config": asdict(state.cfg)}
