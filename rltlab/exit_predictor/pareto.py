"""Paired comparisons on the quality / mean-executed-rounds plane, from evaluate.run's
results.json (per-problem scores of every setting on the same problems).

    python -m rltlab.exit_predictor.pareto --results OUT/results.json --predictor n_plus_2 \
        --out OUT.json [--figures DIR] [--pattern FILE]

* Q-exit at equal mean rounds. The Q-exit family is its threshold sweep plus its two limits
  (t = 0: every token exits at round 1 = fixed depth 1; t >= 1: fixed depth R). Any two of its
  settings can be mixed (each problem served by a at probability w, else by b), so the best
  Q-exit quality at x mean rounds is the upper concave envelope of the family's points, made
  non-decreasing (a point with fewer rounds is also allowed). A predictor point at x is paired
  per problem with that mixture: d_i = s_i - (w a_i + (1 - w) b_i), diff = mean d,
  se = sd(d) / sqrt(n), z = diff / se. The mixture's mean rounds are w x_a + (1 - w) x_b = x
  (problem-weighted; the per-token mean differs by how long the answers of a and b are).
* "beats Q-exit": some point has z >= z_crit and no point has z <= -z_crit.
* Savings share (rltlab.exit_predictor.savings): the predictor's fewest-rounds point within
  max_loss_pp of fixed depth R against the quality-matched oracle, as one oracle-like setting
  and as the per-problem oracle (always defined).
* Select-only vs LAST_EXITED (report.select_only_cost): at each Q-exit threshold run both
  ways, the paired difference LAST_EXITED minus select-only.
* Replay pattern: the per-decode-token executed rounds of one setting, in problem order
  (first output token of each problem excluded: it comes from the full-depth prefill), and an
  evenly spaced subsample of a given length for rltlab.bench.depth_gain --pattern.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rltlab.eval.metrics import paired_difference
from rltlab.exit_predictor.report import select_only_cost
from rltlab.exit_predictor.savings import row_key, savings_share


def q_exit_family(rows: Sequence[dict], R: int) -> list[dict]:
    """The Q-exit sweep plus its limits, fixed depth 1 (t = 0) and fixed depth R (t >= 1)."""
    limits = {"depth=1", f"depth={R}"}
    return [r for r in rows if r["policy"] == "q_exit"
            or (r["policy"] == "fixed" and r["setting"] in limits)]


def upper_envelope(points: Sequence[dict]) -> list[dict]:
    """Vertices of the upper concave hull of (mean_rounds, quality), by mean rounds, cut after
    the best-quality vertex (beyond it, fewer rounds do at least as well)."""
    pts = sorted(points, key=lambda r: (r["mean_rounds"], -r["quality"]))
    hull: list[dict] = []
    for p in pts:
        if hull and math.isclose(hull[-1]["mean_rounds"], p["mean_rounds"]):
            continue           # same x, lower or equal quality (sorted): never on the hull
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = ((h["mean_rounds"], h["quality"]) for h in hull[-2:])
            if (x2 - x1) * (p["quality"] - y1) - (y2 - y1) * (p["mean_rounds"] - x1) >= 0:
                hull.pop()     # hull[-1] lies on or below the chord hull[-2] -> p
            else:
                break
        hull.append(p)
    best = max(range(len(hull)), key=lambda i: (hull[i]["quality"], -i)) if hull else -1
    return hull[:best + 1]


def envelope_mixture(envelope: Sequence[dict], x: float) -> list[tuple[dict, float]] | None:
    """[(setting, weight), ...] of the envelope's best mixture at <= x mean rounds; None
    when x lies below the envelope's fewest rounds."""
    if not envelope or x < envelope[0]["mean_rounds"] - 1e-9:
        return None
    if x >= envelope[-1]["mean_rounds"] - 1e-9:
        return [(envelope[-1], 1.0)]
    for a, b in zip(envelope, envelope[1:]):
        if a["mean_rounds"] - 1e-9 <= x <= b["mean_rounds"] + 1e-9:
            w = (b["mean_rounds"] - x) / (b["mean_rounds"] - a["mean_rounds"])
            return [(a, w), (b, 1.0 - w)]
    raise AssertionError("unreachable: x lies inside the envelope's range")


def compare_at_equal_rounds(rows: Sequence[dict], scores: dict[str, Sequence[float]],
                            label: str, R: int, z_crit: float = 2.0) -> dict[str, Any]:
    """Paired difference of every `label` point against the best Q-exit mixture at the same
    mean rounds (module docstring), and the verdict."""
    envelope = upper_envelope(q_exit_family(rows, R))
    points = []
    for row in sorted((r for r in rows if r["policy"] == label), key=lambda r: r["mean_rounds"]):
        mix = envelope_mixture(envelope, row["mean_rounds"])
        entry = {"setting": row["setting"], "mean_rounds": row["mean_rounds"],
                 "quality": row["quality"]}
        if mix is None:
            entry.update(diff_pp=math.nan, se_pp=math.nan, z=math.nan, reference=None)
        else:
            ref = sum(w * np.asarray(scores[row_key(r)], dtype=float) for r, w in mix)
            d = paired_difference(scores[row_key(row)], ref)
            entry.update(diff_pp=100 * d.diff, se_pp=100 * d.se, z=d.z,
                         q_exit_quality=100 * float(np.mean(ref)),
                         reference=[{"setting": row_key(r), "weight": w,
                                     "mean_rounds": r["mean_rounds"]} for r, w in mix])
        points.append(entry)
    zs = [p["z"] for p in points if not math.isnan(p["z"])]
    return {"policy": label, "z_crit": z_crit, "points": points,
            "envelope": [row_key(r) for r in envelope],
            "best_z": max(zs) if zs else math.nan,
            "worst_z": min(zs) if zs else math.nan,
            "beats_q_exit": bool(zs) and max(zs) >= z_crit and min(zs) > -z_crit,
            "significantly_worse_at": [p["setting"] for p in points
                                       if not math.isnan(p["z"]) and p["z"] <= -z_crit]}


def replay_pattern(executed: Sequence[Sequence[int]], length: int) -> dict[str, Any]:
    """Decode-token executed rounds in problem order (first output token of each problem
    dropped) and an evenly spaced subsample of `length` of them (for depth_gain --pattern)."""
    from rltlab.eval.metrics import decode_depths

    flat = decode_depths(executed)
    if not flat:
        raise ValueError("no decode tokens to build a pattern from")
    idx = np.floor((np.arange(length) + 0.5) * len(flat) / length).astype(int)
    sub = [flat[i] for i in idx]
    return {"tokens": len(flat), "mean_rounds": float(np.mean(flat)),
            "pattern": sub, "pattern_mean_rounds": float(np.mean(sub)),
            "pattern_hist": {str(r): sub.count(r) for r in sorted(set(flat))},
            "hist": {str(r): flat.count(r) for r in sorted(set(flat))}}


def per_kind(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting and problem kind (and k-hop depth): EM (%), mean executed rounds per
    decode token, and the mean executed rounds of output index 1 (the first decode token: on
    k-hop problems the answer digit)."""
    probs = results["problem_set"]
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(probs):
        groups.setdefault(p.get("kind", "all"), []).append(i)
        if "hops" in p:
            groups.setdefault(f"hops={p['hops']}", []).append(i)
    out = []
    for row in results["arithmetic"]:
        key = row_key(row)
        s = np.asarray(results["scores"][key], dtype=float)
        ex = results["executed_rounds"][key]
        entry: dict[str, Any] = {"key": key, "n": {g: len(ix) for g, ix in groups.items()}}
        for g, ix in groups.items():
            decode = [d for i in ix for d in ex[i][1:]]
            first = [ex[i][1] for i in ix if len(ex[i]) > 1]
            entry[g] = {"em": 100 * float(s[ix].mean()),
                        "mean_rounds": float(np.mean(decode)) if decode else math.nan,
                        "index1_rounds": float(np.mean(first)) if first else math.nan}
        out.append(entry)
    return out


# ----------------------------------------------------------------------------- CLI

def analyse(results: dict[str, Any], predictors: Sequence[str], max_loss_pp: float = 0.5
            ) -> dict[str, dict]:
    R = int(results["reference"].split("=")[-1])
    return {label: {"vs_q_exit": compare_at_equal_rounds(results["arithmetic"],
                                                         results["scores"], label, R),
                    "savings": savings_share(results["arithmetic"], label, R, max_loss_pp,
                                             scores=results["scores"],
                                             executed=results["executed_rounds"])}
            for label in predictors}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from rltlab.common.atomic import read_json, write_json_atomic, write_text_atomic

    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.pareto",
                                 description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--results", nargs="+",
                        help="evaluate.run results.json file(s) on the same problems (merged)")
    source.add_argument("--reanalyse", default=None, metavar="JSON",
                        help="recompute the analysis of an earlier --out file from the raw "
                             "results it embeds (after a change to the analysis); written "
                             "back in place unless --out is given; --figures redraws the "
                             "Pareto figure")
    ap.add_argument("--predictor", action="append", default=[],
                    help="policy label to analyse (repeatable; required with --results; "
                         "default with --reanalyse: the file's own)")
    ap.add_argument("--out", default=None, help="analysis + raw results JSON")
    ap.add_argument("--figures", default=None, help="directory of the Pareto figure")
    ap.add_argument("--stem", default="n_plus_2_pareto")
    ap.add_argument("--max-loss-pp", type=float, default=0.5)
    ap.add_argument("--hist", action="append", default=[],
                    help="'POLICY SETTING' in the depth histogram (repeatable; default depth R, "
                         "the oracle and each predictor's savings point)")
    ap.add_argument("--pattern", action="append", default=[],
                    help="write a replay pattern to this file (repeatable)")
    ap.add_argument("--pattern-setting", action="append", default=[],
                    help="'POLICY SETTING' replayed into the i-th --pattern file (default: "
                         "the i-th predictor's savings point)")
    ap.add_argument("--pattern-length", type=int, default=255)
    ap.add_argument("--training", action="append", default=[],
                    help="NAME=DIR: embed a train output dir's metrics.json and checkpoint "
                         "manifests (DIR/n*/manifest.json) under 'training'")
    ap.add_argument("--command", action="append", default=[],
                    help="the commands that made the inputs (recorded in --out)")
    args = ap.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.predictor, args.max_loss_pp, args.out,
                         args.figures, args.stem)
    if not args.predictor or not args.out:
        ap.error("--results needs --predictor and --out")
    results = merge_results([read_json(p) for p in args.results])
    analysis = analyse(results, args.predictor, args.max_loss_pp)
    out: dict[str, Any] = {"analysis": analysis, "per_kind": per_kind(results),
                           "select_only_vs_last_exited": select_only_cost(
                               results["arithmetic"], results["scores"]),
                           "commands": args.command, "inputs": args.results,
                           "training": {name: training_record(d) for name, d in
                                        (t.split("=", 1) for t in args.training)}}
    if args.figures:
        from rltlab.eval.plots import plot_depth_histogram
        from rltlab.exit_predictor.pareto_plot import plot_pareto

        paths = plot_pareto(results, analysis, args.figures, args.stem)
        R = int(results["reference"].split("=")[-1])
        keys = args.hist or [results["reference"], "oracle oracle"] + [
            f"{label} {res['savings']['point']['setting']}" for label, res in analysis.items()
            if res["savings"].get("point")]
        hist = {k: next(r["executed_hist"] for r in results["arithmetic"] if row_key(r) == k)
                for k in keys}
        paths += plot_depth_histogram(hist, args.figures, num_rounds=R,
                                      title="Rounds per decode token (oracle: selected)",
                                      stem=f"{args.stem}_depth_hist")
        out["figures"] = [str(p) for p in paths]
    out["patterns"] = []
    for i, path in enumerate(args.pattern):
        key = (args.pattern_setting[i] if i < len(args.pattern_setting)
               else _savings_key(analysis[args.predictor[i]]))
        if key not in results["executed_rounds"]:
            raise SystemExit(f"--pattern-setting {key!r} is not a setting of the results; "
                             f"have {sorted(results['executed_rounds'])}")
        pat = replay_pattern(results["executed_rounds"][key], args.pattern_length)
        write_text_atomic(path, ",".join(map(str, pat["pattern"])) + "\n")
        out["patterns"].append({"setting": key, "file": path, **pat})
    out["results"] = results
    write_json_atomic(args.out, out, indent=None)
    _print_summary(out)
    return out


def reanalyse(path, predictors: Sequence[str], max_loss_pp: float, out_path=None,
              figures=None, stem: str = "n_plus_2_pareto") -> dict[str, Any]:
    """Recompute `analysis` of an earlier pareto.py output from the raw results it embeds;
    everything else (commands, training, patterns) is kept. Written to out_path (default:
    back to path, atomically)."""
    from rltlab.common.atomic import read_json, write_json_atomic

    out = read_json(path)
    if out is None or "results" not in out or "analysis" not in out:
        raise SystemExit(f"--reanalyse {path}: not a pareto.py output (no 'results' and "
                         "'analysis')")
    predictors = list(predictors) or list(out["analysis"])
    unknown = [p for p in predictors if not any(r["policy"] == p for r in
                                                out["results"]["arithmetic"])]
    if unknown:
        raise SystemExit(f"--predictor {unknown}: no such policy in {path}")
    out["analysis"] = analyse(out["results"], predictors, max_loss_pp)
    if figures:
        from rltlab.exit_predictor.pareto_plot import plot_pareto

        plot_pareto(out["results"], out["analysis"], figures, stem)
    write_json_atomic(out_path or path, out, indent=None)
    _print_summary(out)
    return out


def _print_summary(out: dict[str, Any]) -> None:
    for label, res in out["analysis"].items():
        v, s = res["vs_q_exit"], res["savings"]
        print(f"{label}: beats Q-exit {v['beats_q_exit']} (best z {v['best_z']:.2f}, worst z "
              f"{v['worst_z']:.2f}); savings share {s['share']:.3f} (met {s['met']}), of the "
              f"per-problem oracle's {s['per_problem_share']:.3f} (met {s['per_problem_met']})")
        for p in v["points"]:
            print(f"  {p['setting']:>10} rounds {p['mean_rounds']:.3f} EM {p['quality']:.1f} "
                  f"vs Q-exit {p['diff_pp']:+.1f} +- {p['se_pp']:.1f} pp, z {p['z']:.2f}")
    for c in out["select_only_vs_last_exited"]:
        print(f"Q-exit {c['setting']}: LAST_EXITED {c['last_exited_quality']:.1f}% at "
              f"{c['last_exited_rounds']:.3f} rounds vs select-only "
              f"{c['select_only_quality']:.1f}% "
              f"(selects {c['select_only_selected_rounds']:.3f}, executes "
              f"{c['select_only_executed_rounds']:.0f}): {c['diff_pp']:+.1f} +- "
              f"{c['se_pp']:.1f} pp")


def training_record(train_dir) -> dict[str, Any]:
    """metrics.json of a `python -m rltlab.exit_predictor.train` output and the manifests of
    its checkpoints (OUT/n{N}/manifest.json, which carry the weights' sha256)."""
    from rltlab.common.atomic import read_json

    root = Path(train_dir)
    metrics = read_json(root / "metrics.json")
    if metrics is None:
        raise SystemExit(f"--training {train_dir}: no metrics.json there")
    return {"dir": str(root), "metrics": metrics,
            "manifests": {p.parent.name: read_json(p)
                          for p in sorted(root.glob("n*/manifest.json"))}}


def _savings_key(res: dict) -> str:
    point = res["savings"].get("point")
    if point is None:
        raise SystemExit(f"{res['savings']['policy']} has no point within the loss bound: pass "
                         "--pattern-setting")
    return f"{res['savings']['policy']} {point['setting']}"


def merge_results(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from several evaluate.run outputs on the same problem set (same model
    hash and problems), paired diffs recomputed. A setting present in several files (the
    reference depth R and the oracle, which every run has) must have the same per-problem
    scores in each (greedy generation is deterministic): kept once, else refused."""
    from rltlab.exit_predictor.evaluate import add_paired

    base = dict(parts[0])
    base["arithmetic"] = list(base["arithmetic"])
    base["scores"], base["executed_rounds"] = dict(base["scores"]), dict(base["executed_rounds"])
    for other in parts[1:]:
        for field in ("model_hash", "problem_set", "max_tokens"):
            if other[field] != base[field]:
                raise ValueError(f"results to merge differ in {field!r}")
        for row in other["arithmetic"]:
            key = row_key(row)
            if key in base["scores"]:
                if list(other["scores"][key]) != list(base["scores"][key]):
                    raise ValueError(f"setting {key!r} scored differently in two results "
                                     "files (not the same generation)")
                continue
            base["arithmetic"].append(row)
            base["scores"][key] = other["scores"][key]
            base["executed_rounds"][key] = other["executed_rounds"][key]
        base["text"] = base.get("text", []) + other.get("text", [])
        base.setdefault("predictors", {}).update(other.get("predictors", {}))
    add_paired(base["arithmetic"], base["scores"], base["reference"])
    return base


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
