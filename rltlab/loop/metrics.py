"""What the loop reports: Pareto curves, depth histograms, the gate-curve verdict, metrics.json."""
from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any, Sequence

from rltlab.loop.config import LoopState


def curve_points(ev: dict[str, Any]) -> list[tuple[float, list[float]]]:
    """(mean executed rounds, per-problem scores) of the Q-exit rows of an evaluation."""
    return [(r["mean_rounds"], ev["scores"][r["key"]]) for r in ev["rows"]
            if r.get("threshold") is not None and r["mean_rounds"] is not None
            and not math.isnan(r["mean_rounds"])]


def quality_by_kind(scores: Sequence[float], problems: Sequence[dict[str, Any]]
                    ) -> dict[str, float]:
    """Exact match (%) per problem kind ("hops", "arith") of one row's per-problem scores: the
    held-out set alternates the kinds, but word problems hold ~90% of its decode tokens (and
    so of its mean rounds), k-hop problems 2 tokens each."""
    out: dict[str, list[float]] = {}
    for score, problem in zip(scores, problems):
        out.setdefault(problem.get("kind", "?"), []).append(float(score))
    return {kind: 100.0 * sum(v) / len(v) for kind, v in out.items()}


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
        deployed = res.get("deployed") or {}
        if deployed.get("n_plus_2"):    # the deployed predictor, measured at version k
            rows.append(deployed["n_plus_2"])
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


UNCHANGED = "gate unchanged (candidate rejected)"
VERDICTS = ("no worse", "worse", "inconclusive", UNCHANGED)


def gate_verdict(cmp: dict[str, Any], accepted: Sequence[bool], margin_pp: float,
                 z: float = 2.0) -> dict[str, Any]:
    """Non-inferiority verdict of a gate update on the held-out problems, from the paired
    Pareto-curve comparison `cmp` (compare_evaluations: diff and paired SE at every grid point,
    percentage points of exact match) and whether each update's candidate was pushed.

    - UNCHANGED: no candidate was accepted, so the gate is the one it was compared against
      (nothing is claimed about an update that did not happen);
    - "no worse": at every grid point the lower bound diff - z SE is >= -margin_pp;
    - "worse": at some grid point even the upper bound diff + z SE is < -margin_pp;
    - "inconclusive": neither (too few problems to tell at this margin), or no overlap.
    """
    rule = (f"non-inferiority margin {margin_pp:g} pp at z = {z:g}: no worse iff at every grid "
            f"point diff - {z:g} SE >= -{margin_pp:g} pp; worse iff at one diff + {z:g} SE < "
            f"-{margin_pp:g} pp; {UNCHANGED!r} when no candidate was pushed")
    out: dict[str, Any] = {"rule": rule, "margin_pp": margin_pp, "z": z,
                           "accepted": list(map(bool, accepted))}
    if not any(accepted):
        return {**out, "verdict": UNCHANGED}
    points = cmp.get("points") or []
    if not points:
        return {**out, "verdict": "inconclusive", "why": cmp.get("why", "no grid points")}
    bounds = [(p["diff_pp"] - z * p["se_pp"], p["diff_pp"] + z * p["se_pp"], p)
              for p in points]
    lower, _, worst = min(bounds, key=lambda b: b[0])
    tol = 1e-9
    if lower >= -margin_pp - tol:
        verdict = "no worse"
    elif any(upper < -margin_pp - tol for _, upper, _ in bounds):
        verdict = "worse"
    else:
        verdict = "inconclusive"
    return {**out, "verdict": verdict, "worst_lower_bound_pp": lower,
            "worst_point": {k: worst[k] for k in ("mean_rounds", "before", "after", "diff_pp",
                                                  "se_pp")}}


def gate_curve_report(results: Sequence[dict[str, Any]], z: float, margin_pp: float
                      ) -> dict[str, Any]:
    """The final gate's Q-exit Pareto curve on the held-out problems vs version 0's, and every
    iteration's after vs before: the paired comparison (rltlab.eval.curves; its own "no_worse"
    is the margin-free z rule) and the non-inferiority verdict (gate_verdict)."""
    if not results:
        return {"verdict": None, "why": "no iterations"}
    accepted = [bool(r["gate_training"].get("accepted", True)) for r in results]
    final = compare_evaluations(results[0]["before"], results[-1]["after"], z)
    per = [compare_evaluations(r["before"], r["after"], z) for r in results]
    final_verdict = gate_verdict(final, accepted, margin_pp, z)
    per_verdicts = [gate_verdict(c, [a], margin_pp, z)["verdict"] for c, a in zip(per, accepted)]
    return {"rule": final_verdict["rule"], "z": z, "margin_pp": margin_pp,
            "eval_problems": final["n"],
            "heldout_overlap_with_rollouts": sum(r.get("heldout_overlap_with_rollouts", 0)
                                                 for r in results),
            "final_vs_v0": final, "per_iteration": per,
            "verdict": final_verdict["verdict"], "final_verdict": final_verdict,
            "per_iteration_verdicts": per_verdicts, "gates_accepted": accepted}


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
            "diff_vs_q_exit_se_pp": cal.get("diff_vs_q_exit_se_pp"),
            "diff_vs_q_exit_z": cal.get("diff_vs_q_exit_z"),
            "diff_vs_stock_q_exit_pp": cal.get("diff_vs_stock_q_exit_pp"),
            "diff_vs_stock_q_exit_se_pp": cal.get("diff_vs_stock_q_exit_se_pp"),
            "generation_fire_rate": cal.get("fire_rate"),
            "train_label_rate": ep.get("train_label_rate"), "seconds": ep["seconds"]}


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


def _deployed_summary(r: dict[str, Any]) -> dict[str, Any] | None:
    """Iteration k's deployed components (rltlab.loop.deploy): the N+2 of iteration k - 1 and
    the stock Q-exit it replaced, measured back to back on the held-out problems; its on-policy
    rollout; the draft head of k - 1 as the engine's proposer vs target-only decoding."""
    dep = r.get("deployed")
    if not dep:
        return None
    out: dict[str, Any] = {"from_iteration": dep["from_iteration"],
                           "across_gate_change": dep.get("across_gate_change"),
                           "rollout": {k: v for k, v in (dep.get("rollout") or {}).items()}}
    n2, q = dep.get("n_plus_2"), dep.get("stock_q_exit")
    if n2 and q:
        out.update(n_plus_2={k: n2.get(k) for k in (
            "setting", "quality", "quality_se", "quality_by_kind", "mean_rounds",
            "tokens_per_s", "fire_rate",
            "diff_vs_q_exit_pp", "diff_vs_q_exit_se_pp", "diff_vs_q_exit_z",
            "diff_vs_stock_q_exit_pp", "diff_vs_stock_q_exit_se_pp", "diff_vs_stock_q_exit_z",
            "diff_vs_full_pp", "diff_vs_full_se_pp", "weight_version")},
                   stock_q_exit={k: q.get(k) for k in (
                       "setting", "threshold", "quality", "quality_se", "quality_by_kind",
                       "mean_rounds", "tokens_per_s", "weight_version")},
                   speedup_vs_stock_q_exit=dep.get("speedup_vs_stock_q_exit"))
    if dep.get("draft"):
        out["draft"] = {k: dep["draft"].get(k) for k in (
            "k", "prompts", "concurrency", "tokens_per_s", "target_tokens_per_s",
            "speedup_vs_target", "identical", "tau", "acceptance", "spec_steps",
            "speculated_share")}
    return out


def full_depth_row(rows: Sequence[dict[str, Any]], num_rounds: int) -> dict[str, Any] | None:
    """Version 0's full-depth row with a measured tok/s: fixed depth R, else the Q-exit at
    threshold 1.0 (the gate is never asked: every token runs R rounds)."""
    timed = [r for r in rows if r.get("tokens_per_s") and r.get("weight_version") == 0]
    return next((r for r in timed if r.get("depth") == num_rounds), None) or next(
        (r for r in timed if r.get("threshold") is not None and r["threshold"] >= 1.0), None)


def speedups(rows: Sequence[dict[str, Any]], num_rounds: int) -> list[dict[str, Any]]:
    """Speed of every quality-vs-depth row relative to full depth: its decode tok/s (output
    tokens / generation wall time of the whole held-out set, measured in this run; a carried
    row keeps the tok/s of the version that generated it) over full_depth_row's. Wall time:
    other processes' load slows every setting measured while it lasts (metrics record the
    load average at the start and the end). Rows without a tok/s are left out; [] when there
    is no reference."""
    ref = full_depth_row(rows, num_rounds)
    if ref is None:
        return []
    timed = [r for r in rows if r.get("tokens_per_s")]
    return [{"policy": r["policy"], "setting": r["setting"], "mean_rounds": r["mean_rounds"],
             "quality": r["quality"], "tokens_per_s": r["tokens_per_s"],
             "speedup": r["tokens_per_s"] / ref["tokens_per_s"], "reference": ref["key"],
             "carried_from_version": r.get("carried_from_version")} for r in timed]


def _headline(state: LoopState, gate_curve: dict[str, Any], rows: Sequence[dict[str, Any]]
              ) -> dict[str, Any]:
    res = state.results
    head: dict[str, Any] = {"iterations": len(res),
                            "final_weight_version": state.llm.get_weight_version()}
    if not res:
        return head
    fv = gate_curve["final_verdict"]
    head.update(gate_verdict=fv["verdict"], gate_margin_pp=fv["margin_pp"],
                gates_accepted=sum(gate_curve["gates_accepted"]),
                gate_worst_lower_bound_pp=fv.get("worst_lower_bound_pp"))
    worst = fv.get("worst_point")      # the point with the lowest lower bound
    if worst:
        head.update(gate_curve_worst_diff_pp=worst["diff_pp"],
                    gate_curve_worst_se_pp=worst["se_pp"],
                    gate_curve_worst_at_rounds=worst["mean_rounds"])
    last_p = _predictor_summary(res[-1])
    if last_p:
        head.update(predictor_label_rate=last_p["test"]["label_rate"],
                    predictor_fire_rate=last_p["test"]["fire_rate"],
                    predictor_generation_fire_rate=last_p["generation_fire_rate"],
                    n_plus_2_quality=last_p["quality"],
                    n_plus_2_mean_rounds=last_p["mean_rounds"],
                    n_plus_2_vs_q_exit_pp=last_p["diff_vs_q_exit_pp"],
                    n_plus_2_vs_q_exit_se_pp=last_p["diff_vs_q_exit_se_pp"],
                    n_plus_2_vs_q_exit_z=last_p["diff_vs_q_exit_z"],
                    n_plus_2_vs_stock_q_exit_pp=last_p["diff_vs_stock_q_exit_pp"],
                    n_plus_2_vs_stock_q_exit_se_pp=last_p["diff_vs_stock_q_exit_se_pp"])
    last_d = _draft_summary(res[-1])
    if last_d:
        head.update(draft_tau=last_d["tau"], draft_k=last_d["k"],
                    draft_tau_shallow=last_d["tau_shallow"],
                    draft_speedup_vs_target=last_d["speedup_vs_target"])
    full = full_depth_row(rows, state.model.config.num_rounds)
    if full:
        head.update(full_depth_quality=full["quality"],
                    full_depth_tokens_per_s=full["tokens_per_s"])
    dep = next((d for d in map(_deployed_summary, reversed(res)) if d), None)
    if dep and dep.get("n_plus_2"):   # "deployed N+2: quality, mean rounds, tok/s vs Q-exit tok/s"
        n2, q = dep["n_plus_2"], dep["stock_q_exit"]
        head.update(deployed_n_plus_2_quality=n2["quality"],
                    deployed_n_plus_2_mean_rounds=n2["mean_rounds"],
                    deployed_n_plus_2_tokens_per_s=n2["tokens_per_s"],
                    stock_q_exit_quality=q["quality"], stock_q_exit_mean_rounds=q["mean_rounds"],
                    stock_q_exit_tokens_per_s=q["tokens_per_s"],
                    deployed_n_plus_2_speedup_vs_stock_q_exit=dep["speedup_vs_stock_q_exit"],
                    deployed_n_plus_2_vs_stock_q_exit_pp=n2["diff_vs_stock_q_exit_pp"],
                    deployed_n_plus_2_vs_stock_q_exit_se_pp=n2["diff_vs_stock_q_exit_se_pp"])
    if dep and dep.get("draft"):
        head.update(deployed_draft_tokens_per_s=dep["draft"]["tokens_per_s"],
                    deployed_draft_target_tokens_per_s=dep["draft"]["target_tokens_per_s"],
                    deployed_draft_speedup_vs_target=dep["draft"]["speedup_vs_target"],
                    deployed_draft_tau=dep["draft"]["tau"],
                    deployed_draft_identical=dep["draft"]["identical"])
    if state.speed_device:
        head["speed_device"] = state.speed_device
    return head


def loop_metrics(state: LoopState) -> dict[str, Any]:
    res = state.results
    per_iter = []
    for r in res:
        g = r["gate_training"]
        per_iter.append({
            "iteration": r["iteration"], "rollout_weight_versions": r["rollout_weight_versions"],
            "trace_weight_versions": r["trace_weight_versions"],
            "new_weight_version": r["new_weight_version"], "trace_tokens": r["trace_tokens"],
            "rollout_kinds": r.get("rollout_kinds"),
            "gate_loss_before": g["loss_before"], "gate_loss_after": g["loss_after"],
            "gate_val_loss_before": g.get("val_before"), "gate_val_loss_after": g.get("val_after"),
            "gate_best_step": g.get("best_step"), "gate_accepted": g.get("accepted", True),
            "gate_validation_passed": g.get("validation_passed"),
            "gate_injected": g.get("injected"), "gate_reasons": g.get("reasons", []),
            "gate_label": g.get("label"), "gate_stage2_reference": g.get("stage2_reference"),
            "rollout": r.get("rollout"), "deployed": _deployed_summary(r),
            "exit_predictor": _predictor_summary(r), "draft_head": _draft_summary(r),
            "started": r["started"], "seconds": r["seconds"]})
    gate_curve = gate_curve_report(res, state.cfg.curve_z, state.cfg.noninferiority_margin_pp)
    rows = curves(res)
    return {"headline": _headline(state, gate_curve, rows), "iterations": per_iter,
            "curves": rows, "speedups": speedups(rows, state.model.config.num_rounds),
            "gate_curve": gate_curve, "load_average": {
                "start": state.load_average_start, "end": list(os.getloadavg()),
                "cpus": os.cpu_count()},
            "gate_validation_curves": gate_validation_curves(res),
            "kind_curves": kind_curves(rows),
            "speed": {"device": state.speed_device, "batch": len(state.problems),
                      "max_num_seqs": state.llm.llm_engine.config.max_num_seqs,
                      "dtype": str(next(state.model.parameters()).dtype).replace("torch.", ""),
                      "warm_up": state.warm_up},
            "resumed_from": state.resumed_from, "eval_problems": len(state.problems),
            "config": asdict(state.cfg)}


def kind_curves(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (gate version · kind, threshold, exact match %) of every version's Q-exit sweep per
    problem kind: what a gate update did to the k-hop problems (2 decode tokens each) and to the
    word problems (~90% of the held-out decode tokens) separately."""
    out = []
    for r in rows:
        if r.get("threshold") is None or "q_exit" not in r["policy"] or \
                "beside" in r["policy"]:
            continue
        for kind, q in (r.get("quality_by_kind") or {}).items():
            out.append({"series": f"v{r['weight_version']} {KIND_NAMES.get(kind, kind)}",
                        "threshold": r["threshold"], "quality": q})
    return out


KIND_NAMES = {"hops": "k-hop", "arith": "word", "gsm8k": "GSM8K"}


def gate_validation_curves(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (iteration, gate, mean exit round, agreement %) of each iteration's teacher-forced
    Q-exit curve on the gate's validation traces: the current gate, the candidate (the
    configured labels) and, where those are not the paper's, the paper's Stage II candidate
    trained on the same split: the plot of why the paper's labels are not taken."""
    names = {"current": "current gate", "candidate": "candidate", "stage2": "paper Stage II"}
    rows = []
    for r in results:
        g = r["gate_training"]
        label = g.get("label", "stage2")
        for key, points in (g.get("val_curves") or {}).items():
            name = names[key] if key != "candidate" else f"candidate ({label} labels)"
            rows += [{"iteration": r["iteration"], "gate": f"iter {r['iteration']}: {name}",
                      "mean_rounds": x, "agreement": y} for x, y in points]
    return rows
