"""Paired comparison of two quality-vs-depth curves measured on the same examples.

A curve is a list of points, each (mean executed rounds x, per-example scores s[0..n-1]);
quality = mean(s). Its Pareto curve Q(x) is "the best quality reachable with at most x mean
rounds": the Pareto front (rltlab.eval.plots.pareto_front) joined linearly (time-sharing between two
neighbouring settings) and flat to the right of its last front point, up to the curve's
largest x. The per-example scores are interpolated the same way, so at every x both curves
have per-example scores and the difference has a paired standard error:

    d_i(x) = s_after_i(x) - s_before_i(x),   diff(x) = mean(d),   se(x) = sd(d) / sqrt(n)

compare_curves evaluates this on the overlap of the two curves' x ranges, at every front point
of either curve that lies in it (plus the overlap's ends). Rule ("no worse"): no grid point with
diff(x) < -z * se(x) (z = 2 by default). With se = 0 any negative difference counts. The
uncertainty of the x values themselves (mean rounds are measured too) is not propagated, and
the grid points are not independent tests (with ~10 points a false alarm at z = 2 is more
likely than 2.3%).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def pareto_curve(points: Sequence[tuple[float, Sequence[float]]]
                 ) -> tuple[np.ndarray, np.ndarray, float]:
    """(front x [m], front per-example scores [m, n], largest x of all points)."""
    from rltlab.eval.plots import pareto_front

    xs = np.array([float(p[0]) for p in points])
    scores = np.array([np.asarray(p[1], float) for p in points])
    if scores.ndim != 2 or len(xs) == 0:
        raise ValueError("a curve needs at least one point with per-example scores")
    keep = pareto_front(xs, scores.mean(1))
    return xs[keep], scores[keep], float(xs.max())


def curve_scores_at(front_x: np.ndarray, front_s: np.ndarray, x: float) -> np.ndarray:
    """Per-example scores of the Pareto curve at x (linear between front points, flat right
    of the last one); x left of the first front point is outside the curve (ValueError)."""
    if x < front_x[0] - 1e-12:
        raise ValueError(f"x = {x} is left of the curve's first point {front_x[0]}")
    j = int(np.searchsorted(front_x, x, side="right"))
    if j >= len(front_x):
        return front_s[-1]
    lo, hi = j - 1, j
    a = (x - front_x[lo]) / (front_x[hi] - front_x[lo])
    return (1 - a) * front_s[lo] + a * front_s[hi]


def compare_curves(before: Sequence[tuple[float, Sequence[float]]],
                   after: Sequence[tuple[float, Sequence[float]]], *, z: float = 2.0
                   ) -> dict[str, Any]:
    """Paired comparison of `after` against `before` (same examples, same order); see the
    module docstring. Quality figures in percent (percentage points for differences)."""
    from rltlab.eval.metrics import paired_difference

    bx, bs, bmax = pareto_curve(before)
    ax, as_, amax = pareto_curve(after)
    if bs.shape[1] != as_.shape[1]:
        raise ValueError(f"curves scored on {bs.shape[1]} and {as_.shape[1]} examples")
    lo, hi = max(bx[0], ax[0]), min(bmax, amax)
    res: dict[str, Any] = {
        "rule": f"no worse: at every grid point x in the overlap of the two Pareto curves, "
                f"Q_after(x) - Q_before(x) >= -{z:g} paired SE (linear interpolation on the "
                f"Pareto fronts, flat to the right)",
        "z": z, "n": int(bs.shape[1]), "overlap": [float(lo), float(hi)] if lo <= hi else None,
        "before_front": [[float(x), 100 * float(s.mean())] for x, s in zip(bx, bs)],
        "after_front": [[float(x), 100 * float(s.mean())] for x, s in zip(ax, as_)],
        "points": []}
    if lo > hi:
        res.update(no_worse=None, why="the two curves' mean-round ranges do not overlap")
        return res
    grid = sorted({float(lo), float(hi)} | {float(x) for x in np.r_[bx, ax] if lo <= x <= hi})
    for x in grid:
        sb, sa = curve_scores_at(bx, bs, x), curve_scores_at(ax, as_, x)
        d = paired_difference(sa, sb)
        worse = d.diff < -z * d.se - 1e-12
        res["points"].append({"mean_rounds": x, "before": 100 * d.mean_b, "after": 100 * d.mean_a,
                              "diff_pp": 100 * d.diff, "se_pp": 100 * d.se,
                              "z": (d.diff / d.se) if d.se > 0 else None, "worse": bool(worse)})
    res["worst_point"] = min(res["points"], key=lambda p: p["diff_pp"])   # most negative diff
    res["no_worse"] = not any(p["worse"] for p in res["points"])
    return res
