"""The share of an oracle's round savings that an exit policy reaches at (almost) no loss.

A policy's savings point is its fewest-rounds setting within max_loss_pp (paired mean
difference) of fixed depth R; savings = R - mean rounds per decode token. Two oracles bound it:

* quality-matched oracle (one setting): the oracle-like setting (plain or floored oracle) with
  the fewest rounds within the same loss. Under LAST_EXITED a token that exits at the round
  whose argmax already equals round R's still leaves shallower K/V for later tokens, so on a
  model whose later tokens need deep K/V every oracle-like setting may lose more than
  max_loss_pp: then there is none and that share is undefined.
* per-problem oracle (always defined): each problem is served by the oracle-like setting, or
  fixed depth R, with the fewest mean decode rounds on that problem among those that score at
  least depth R's score on it. It knows every problem's outcome in advance, loses nothing
  against depth R by construction, and depth R always qualifies; its savings bound those of
  any policy that picks one of these settings per problem without loss.

The oracles' rounds are their SELECTED rounds (an oracle executes all R to find them).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

from rltlab.eval.metrics import decode_depths, paired_difference

ORACLE_POLICIES = ("oracle", "oracle_floor")


def row_key(row: dict) -> str:
    """A results row's setting key, "POLICY SETTING" (the keys of scores / executed_rounds)."""
    return row.get("key") or f"{row['policy']} {row['setting']}"


def _fewest_rounds_within(rows: Sequence[dict], policies: Sequence[str],
                          max_loss_pp: float) -> dict | None:
    ok = [r for r in rows if r["policy"] in policies and r["diff_pp"] >= -max_loss_pp]
    return min(ok, key=lambda r: r["mean_rounds"]) if ok else None


def per_problem_oracle(rows: Sequence[dict], scores: Mapping[str, Sequence[float]],
                       executed: Mapping[str, Sequence[Sequence[int]]], R: int
                       ) -> dict[str, Any]:
    """The per-problem oracle (module docstring) from evaluate.run's per-problem `scores` and
    per-token `executed` rounds (first output token of each problem excluded, as in every
    row's mean_rounds)."""
    reference = f"fixed depth={R}"
    keys = [row_key(r) for r in rows if r["policy"] in ORACLE_POLICIES] + [reference]
    missing = [k for k in keys if k not in scores or k not in executed]
    if missing:
        raise ValueError(f"per-problem scores or executed rounds missing for {missing}")
    n = len(scores[reference])
    uneven = [k for k in keys if len(scores[k]) != n or len(executed[k]) != n]
    if uneven:
        raise ValueError(f"{uneven}: not {n} problems like {reference!r}")
    chosen: Counter[str] = Counter()
    picked_scores: list[float] = []
    rounds = tokens = 0
    for i in range(n):
        depths = {k: decode_depths([executed[k][i]]) for k in keys
                  if scores[k][i] >= scores[reference][i]}
        key = min(depths, key=lambda k: sum(depths[k]) / len(depths[k]) if depths[k] else 0.0)
        chosen[key] += 1
        picked_scores.append(scores[key][i])
        rounds += sum(depths[key])
        tokens += len(depths[key])
    if tokens == 0:
        raise ValueError("no decode tokens: every answer is a single token")
    d = paired_difference(picked_scores, scores[reference])
    return {"mean_rounds": rounds / tokens, "decode_tokens": tokens,
            "quality": 100 * d.mean_a, "diff_pp": 100 * d.diff, "diff_se_pp": 100 * d.se,
            "problems_per_setting": dict(chosen)}


def savings_share(rows: Sequence[dict], label: str, R: int, max_loss_pp: float = 0.5,
                  target: float = 0.8, *, scores: Mapping[str, Sequence[float]] | None = None,
                  executed: Mapping[str, Sequence[Sequence[int]]] | None = None
                  ) -> dict[str, Any]:
    """The share of the oracles' round savings that `label` reaches at <= max_loss_pp loss vs
    fixed depth R (module docstring). `share` / `met` are against the one-setting quality-
    matched oracle (NaN / False when there is none); with `scores` and `executed`,
    `per_problem_share` / `per_problem_met` are against the per-problem oracle."""
    oracle = _fewest_rounds_within(rows, ORACLE_POLICIES, max_loss_pp)
    best = _fewest_rounds_within(rows, (label,), max_loss_pp)
    out: dict[str, Any] = {"policy": label, "max_loss_pp": max_loss_pp, "target_share": target}
    saved = R - best["mean_rounds"] if best is not None else None
    if best is not None:
        out["point"] = {k: best[k] for k in ("setting", "mean_rounds", "quality", "diff_pp",
                                              "diff_se_pp")}
        out["saved_rounds"] = saved
    if oracle is not None:
        out["quality_matched_oracle"] = {k: oracle[k] for k in (
            "policy", "setting", "mean_rounds", "quality", "diff_pp", "diff_se_pp")}
    if oracle is None or best is None:
        out.update(share=math.nan, met=False,
                   why=("no oracle-like setting" if oracle is None else f"no {label} setting")
                   + f" within {max_loss_pp} pp of depth {R}")
    else:
        oracle_saved = R - oracle["mean_rounds"]
        share = saved / oracle_saved if oracle_saved > 0 else math.nan
        out.update(oracle_saved_rounds=oracle_saved, share=share,
                   met=bool(not math.isnan(share) and share >= target))
    if scores is not None and executed is not None:
        per_problem = per_problem_oracle(rows, scores, executed, R)
        out["per_problem_oracle"] = per_problem
        per_problem_saved = R - per_problem["mean_rounds"]
        share = (saved / per_problem_saved if best is not None and per_problem_saved > 0
                 else math.nan)
        out.update(per_problem_share=share,
                   per_problem_met=bool(not math.isnan(share) and share >= target))
    return out
