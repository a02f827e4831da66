"""The Pareto figure of rltlab.exit_predictor.pareto: quality against mean executed rounds
(every setting, the Q-exit envelope, the per-problem oracle), zoomed, and each predictor's
paired difference against Q-exit at equal mean rounds."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rltlab.exit_predictor.savings import row_key

STYLE = {"fixed": ("black", "s"), "q_exit": ("tab:blue", "o"), "oracle": ("tab:gray", "D"),
         "oracle_floor": ("tab:gray", "d"), "select_only": ("tab:red", "x")}
PREDICTOR_COLORS = ("tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive")


def plot_pareto(results: dict[str, Any], analysis: dict[str, dict], out_dir, stem: str
                ) -> list[Path]:
    """Left: EM vs mean executed rounds, error bars = paired SE vs fixed depth R; middle: the
    same, zoomed on the top; right: each predictor point's paired difference against the best
    Q-exit mixture at the same mean rounds, error bars = 2 SE."""
    import matplotlib.pyplot as plt

    from rltlab.common.figures import save_figure

    rows, R = results["arithmetic"], int(results["reference"].split("=")[-1])
    fig, (ax, zx, bx) = plt.subplots(1, 3, figsize=(18, 5.4))
    colors = dict(zip(analysis, PREDICTOR_COLORS))
    for axis in (ax, zx):
        _quality_panel(axis, rows, R, analysis, colors)
    top = max(r["quality"] for r in rows)
    zx.set_ylim(top - 12, top + 2.5)
    zx.set_xlim(1.9, R + 0.1)
    zx.set_title("zoom", fontsize=9)
    zx.get_legend().remove()
    ax.set_title(f"Real generation (LAST_EXITED), {results['problems']} problems; "
                 f"bars: paired SE vs depth {R}", fontsize=9)
    for label, res in analysis.items():
        pts = [p for p in res["vs_q_exit"]["points"] if not math.isnan(p["diff_pp"])]
        bx.errorbar([p["mean_rounds"] for p in pts], [p["diff_pp"] for p in pts],
                    yerr=[2 * p["se_pp"] for p in pts], color=colors[label], marker="o",
                    capsize=3, label=label)
    bx.axhline(0, color="black", lw=0.8)
    bx.set_xlabel("mean executed rounds per decode token")
    bx.set_ylabel("EM minus best Q-exit mixture at equal rounds (pp)")
    bx.set_title("Predictor vs Q-exit at equal mean rounds (paired, bars: 2 SE)", fontsize=9)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    return save_figure(fig, out_dir, stem)


def _quality_panel(ax, rows, R, analysis, colors) -> None:
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["mean_rounds"])
        color, marker = STYLE.get(policy, (colors.get(policy, "tab:cyan"), "o"))
        x = [r["mean_rounds"] for r in pts]
        label = {"oracle": "oracle (x = selected rounds; executes R)",
                 "oracle_floor": "floored oracle (x = selected rounds)",
                 "select_only": f"select-only Q-exit (executes {R})"}.get(policy, policy)
        ax.errorbar(x, [r["quality"] for r in pts], yerr=[r["diff_se_pp"] for r in pts],
                    color=color, marker=marker, ms=5, capsize=2, lw=1.2,
                    ls="-" if policy in ("fixed", "q_exit") or policy in analysis else "none",
                    label=label)
        if policy == "select_only":
            ax.scatter([r["mean_selected"] for r in pts], [r["quality"] for r in pts],
                       facecolors="none", edgecolors=color, marker="o", s=30,
                       label="select-only at its SELECTED rounds (not executed)")
    oracle = next(iter(analysis.values()))["savings"].get("per_problem_oracle") if analysis \
        else None
    if oracle:
        ax.scatter([oracle["mean_rounds"]], [oracle["quality"]], marker="*", s=140,
                   color="tab:gray", zorder=5, label="per-problem oracle (quality-matched)")
    env = [next(r for r in rows if row_key(r) == k)
           for k in next(iter(analysis.values()))["vs_q_exit"]["envelope"]] if analysis else []
    if env:
        ax.plot([r["mean_rounds"] for r in env], [r["quality"] for r in env], ls="--",
                color="tab:blue", alpha=0.5, label="Q-exit envelope (mixtures)")
    ax.set_xlabel("mean executed rounds per decode token")
    ax.set_ylabel("exact match (%), mixed held-out set")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
