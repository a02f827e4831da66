"""Workbench plots (matplotlib Agg + seaborn). Every function saves a PNG and an SVG into
`out_dir` and returns their paths [png, svg]; titles and axes carry units.

Inputs are plain lists/dicts or pandas DataFrames (column names given below).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rltlab.common.figures import plt, save_figure

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

__all__ = ["plot_quality_vs_depth", "plot_speedup_vs_concurrency", "plot_depth_histogram",
           "plot_calibration", "plot_series", "save_figure", "pareto_front", "show"]


def _frame(data: Any, required: Sequence[str]) -> pd.DataFrame:
    df = data.copy() if isinstance(data, pd.DataFrame) else pd.DataFrame(data)
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"plot input lacks column(s) {missing}; has {list(df.columns)}")
    if df.empty:
        raise ValueError("plot input is empty")
    return df


def pareto_front(x: Sequence[float], y: Sequence[float]) -> np.ndarray:
    """Indices of the points no other point beats (lower-or-equal x AND higher-or-equal y,
    one strictly), sorted by x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    order = np.lexsort((-y, x))
    keep, best = [], -np.inf
    for i in order:
        if y[i] > best:
            keep.append(i)
            best = y[i]
    return np.asarray(keep, dtype=int)


def plot_quality_vs_depth(df: Any, out_dir: str | os.PathLike, *, x: str = "mean_rounds",
                          y: str = "quality", policy: str = "policy", label: str | None = None,
                          quality_label: str = "quality (exact match, %)",
                          title: str = "Quality vs mean executed rounds",
                          stem: str = "quality_vs_depth", yerr: str | None = None) -> list[Path]:
    """One line per policy through its points (x = mean executed rounds per decode token,
    y = quality), the policy's Pareto front drawn solid over its faint raw points.

    Columns: policy, mean_rounds, quality; optional `label` (text next to each point, e.g. the
    threshold) and `yerr` (error bar half-width, same unit as y).
    """
    df = _frame(df, [x, y, policy])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    palette = sns.color_palette("tab10", n_colors=max(1, df[policy].nunique()))
    labelled: set[tuple] = set()   # (x, y, text) already written: series often coincide
    for series, (color, (name, group)) in enumerate(zip(palette, df.groupby(policy, sort=False))):
        group = group.sort_values(x)
        ax.scatter(group[x], group[y], color=color, alpha=0.35, s=18)
        front = group.iloc[pareto_front(group[x].to_numpy(), group[y].to_numpy())]
        ax.plot(front[x], front[y], marker="o", color=color, label=str(name), lw=1.8)
        if yerr and yerr in group:
            ax.errorbar(group[x], group[y], yerr=group[yerr], fmt="none", ecolor=color,
                        alpha=0.5, capsize=2)
        if label and label in group:   # label the front only (the other points are faint)
            for _, row in front.iterrows():
                key = (round(float(row[x]), 1), round(float(row[y])), _short(row[label]))
                if key in labelled:
                    continue
                labelled.add(key)
                ax.annotate(key[2], (row[x], row[y]), fontsize=7, color=color,
                            xytext=(3, 3 + 8 * (series % 3)), textcoords="offset points")
    ax.set_xlabel("mean executed rounds per decode token (rounds)")
    ax.set_ylabel(quality_label)
    if (df[y] >= 0).all():
        top = df[y] + (df[yerr].fillna(0) if yerr and yerr in df else 0)   # error bars in view
        ax.set_ylim(bottom=0, top=max(1.0, float(top.max()) * 1.1))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title=policy, fontsize=8)
    return save_figure(fig, out_dir, stem)


def plot_speedup_vs_concurrency(df: Any, out_dir: str | os.PathLike, *,
                                concurrency: str = "concurrency", speedup: str = "speedup",
                                series: str = "policy", title: str | None = None,
                                stem: str = "speedup_vs_concurrency") -> list[Path]:
    """Speedup (x, vs the baseline measured in the same run) against concurrency
    (requests in flight, log2 axis), one line per series; a dashed line marks 1.0x."""
    df = _frame(df, [concurrency, speedup])
    if series not in df:
        df[series] = "speedup"
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sns.lineplot(data=df, x=concurrency, y=speedup, hue=series, marker="o", ax=ax,
                 errorbar=("pi", 100) if df.duplicated([series, concurrency]).any() else None)
    ax.axhline(1.0, ls="--", color="gray", lw=1)
    if (df[concurrency] > 0).all() and df[concurrency].nunique() > 1:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speedup vs baseline (x)")
    ax.set_title(title or "Decode speedup vs concurrency")
    ax.grid(alpha=0.3)
    return save_figure(fig, out_dir, stem)


def plot_depth_histogram(depths_by_policy: Mapping[str, Any], out_dir: str | os.PathLike, *,
                         num_rounds: int | None = None, title: str | None = None,
                         stem: str = "depth_histogram") -> list[Path]:
    """Share of decode tokens per exit round, one bar group per policy.

    Values: a flat list of per-token rounds (first output token already excluded, see
    rltlab.eval.metrics.depth_stats), or a histogram dict {round: count}.
    """
    if not depths_by_policy:
        raise ValueError("plot_depth_histogram needs at least one policy")
    counts: dict[str, dict[int, float]] = {}
    for name, values in depths_by_policy.items():
        if isinstance(values, Mapping):
            counts[name] = {int(k): float(v) for k, v in values.items()}
        else:
            arr = np.asarray(list(values), dtype=int).ravel()
            uniq, cnt = np.unique(arr, return_counts=True)
            counts[name] = dict(zip(uniq.tolist(), cnt.astype(float).tolist()))
    top = num_rounds or max(max(c) if c else 1 for c in counts.values())
    rows = []
    for name, hist in counts.items():
        total = sum(hist.values()) or 1.0
        for r in range(1, top + 1):
            rows.append({"policy": name, "round": r, "share": 100.0 * hist.get(r, 0.0) / total})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sns.barplot(data=pd.DataFrame(rows), x="round", y="share", hue="policy", ax=ax)
    ax.set_xlabel("exit round (rounds executed)")
    ax.set_ylabel("decode tokens (%)")
    ax.set_title(title or "Exit-depth histogram (first output token excluded)")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, out_dir, stem)


def plot_calibration(probs: Sequence[float], labels: Sequence[int], out_dir: str | os.PathLike,
                     *, num_bins: int = 10, title: str | None = None,
                     stem: str = "calibration") -> list[Path]:
    """Reliability curve: mean predicted probability vs observed frequency per equal-width bin,
    marker size ~ bin count, with the diagonal and the expected calibration error (ECE)."""
    p = np.asarray(probs, dtype=float).ravel()
    y = np.asarray(labels, dtype=float).ravel()
    if p.shape != y.shape or p.size == 0:
        raise ValueError(f"probs and labels must be non-empty and equally long "
                         f"({p.size} vs {y.size})")
    curve = reliability_curve(p, y, num_bins)
    fig, (ax, axh) = plt.subplots(2, 1, figsize=(5.6, 6.2), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1, label="perfect calibration")
    sizes = 10 + 200 * curve["count"] / max(1, curve["count"].max())
    ax.plot(curve["mean_prob"], curve["frequency"], color="C0", lw=1.5)
    ax.scatter(curve["mean_prob"], curve["frequency"], s=sizes, color="C0",
               label=f"model (ECE {100 * curve['ece']:.1f} pp)")
    ax.set_ylabel("observed frequency of label 1 (fraction)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title or "Reliability curve")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axh.hist(p, bins=np.linspace(0, 1, num_bins + 1), color="C0", alpha=0.7)
    axh.set_xlabel("predicted probability (fraction)")
    axh.set_ylabel("count (examples)")
    return save_figure(fig, out_dir, stem)


def reliability_curve(probs, labels, num_bins: int = 10) -> dict[str, Any]:
    """Per non-empty bin: mean predicted prob, observed frequency, count; plus ECE."""
    p, y = np.asarray(probs, float).ravel(), np.asarray(labels, float).ravel()
    edges = np.linspace(0, 1, num_bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1]), 0, num_bins - 1)
    mean_prob, freq, count = [], [], []
    for b in range(num_bins):
        sel = idx == b
        if sel.any():
            mean_prob.append(p[sel].mean())
            freq.append(y[sel].mean())
            count.append(int(sel.sum()))
    mean_prob, freq, count = map(np.asarray, (mean_prob, freq, count))
    ece = float(np.sum(count / count.sum() * np.abs(mean_prob - freq))) if count.size else 0.0
    return {"mean_prob": mean_prob, "frequency": freq, "count": count, "ece": ece}


def plot_series(df: Any, out_dir: str | os.PathLike, *, x: str, y: str, hue: str | None = None,
                xlabel: str, ylabel: str, title: str, stem: str) -> list[Path]:
    """A generic labeled line plot (e.g. per-round loss); units belong in xlabel/ylabel."""
    df = _frame(df, [x, y] + ([hue] if hue else []))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sns.lineplot(data=df, x=x, y=y, hue=hue, marker="o", ax=ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return save_figure(fig, out_dir, stem)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def show(paths: Sequence[str | os.PathLike]) -> None:
    """Display saved PNGs inline in a notebook (no-op outside IPython)."""
    try:
        from IPython.display import Image, display
    except ImportError:
        return
    for path in paths:
        if str(path).endswith(".png"):
            display(Image(filename=str(path)))


def frame(rows: Sequence[dict[str, Any]], drop: Sequence[str] = ("executed_hist", "key")):
    """A pandas DataFrame of result rows for display (bulky columns dropped)."""
    df = pd.DataFrame(list(rows))
    return df.drop(columns=[c for c in drop if c in df.columns])
