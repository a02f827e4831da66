"""Splits, metrics and calibration of the exit predictor (used by train.py)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def split_by_prompt(prompt_ids: torch.Tensor, fractions: Sequence[float] = (0.7, 0.15, 0.15),
                    seed: int = 0) -> list[torch.Tensor]:
    """Boolean masks (train, calibration, test): whole prompts go to one split (seeded)."""
    uniq = torch.unique(prompt_ids)
    order = uniq[torch.randperm(len(uniq), generator=torch.Generator().manual_seed(seed))]
    cuts = np.cumsum([0] + [round(f * len(uniq)) for f in fractions[:-1]] + [len(uniq)])
    cuts = np.minimum(cuts, len(uniq))
    masks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        masks.append(torch.isin(prompt_ids, order[lo:hi]))
    return masks


# ----------------------------------------------------------------------------- metrics

def roc_auc(scores: Sequence[float], labels: Sequence[float]) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count one half); NaN with one class."""
    s, y = np.asarray(scores, float), np.asarray(labels, float) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):           # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor, threshold: float
                   ) -> dict[str, float]:
    fire = probs >= threshold
    y = labels > 0.5
    tp, fp = int((fire & y).sum()), int((fire & ~y).sum())
    fn = int((~fire & y).sum())
    return {"tokens": int(len(y)), "label_rate": float(y.float().mean()) if len(y) else math.nan,
            "fire_rate": float(fire.float().mean()) if len(y) else math.nan,
            "precision": tp / (tp + fp) if tp + fp else math.nan,
            "recall": tp / (tp + fn) if tp + fn else math.nan,
            "auc": roc_auc(probs.tolist(), labels.tolist())}


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, steps: int = 200) -> float:
    """Temperature T > 0 minimizing the NLL of sigmoid(logit / T) (LBFGS on log T)."""
    if logits.numel() == 0 or labels.min() == labels.max():
        return 1.0
    log_t = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=steps)
    z, y = logits.detach().float(), labels.float()

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z / log_t.exp(), y)
        loss.backward()
        return loss
    opt.step(closure)
    t = float(log_t.detach().exp())
    return t if math.isfinite(t) and t > 0 else 1.0


def choose_threshold(probs: torch.Tensor, labels: torch.Tensor, target_precision: float,
                     min_fires: int = 5) -> tuple[float, bool]:
    """Smallest threshold whose precision on (probs, labels) is >= target_precision with at
    least min_fires firing tokens: (threshold, reached). Not reachable -> (1.0, False)."""
    p, y = probs.double().numpy(), labels.numpy() > 0.5
    order = np.argsort(-p, kind="mergesort")
    tp = np.cumsum(y[order])
    count = np.arange(1, len(p) + 1)
    precision = tp / count
    ok = (precision >= target_precision) & (count >= min_fires)
    # a threshold equal to p[order[i]] fires every token with p >= it: only positions where
    # the next score differs are valid cut points
    distinct = np.r_[p[order][1:] != p[order][:-1], True] if len(p) else np.zeros(0, bool)
    ok &= distinct
    if not ok.any():
        return 1.0, False
    i = int(np.nonzero(ok)[0].max())
    return float(p[order][i]), True


def calibrate(logits: torch.Tensor, labels: torch.Tensor, calib: torch.Tensor,
              target_precision: float) -> tuple[float, torch.Tensor, float, bool]:
    """On the calibration rows (bool mask `calib`): a temperature, then the threshold for the
    target precision. -> (temperature, calibrated probabilities of every row, threshold,
    reached)."""
    temperature = fit_temperature(logits[calib], labels[calib])
    probs = torch.sigmoid(logits / temperature)
    threshold, reached = choose_threshold(probs[calib], labels[calib], target_precision)
    return temperature, probs, threshold, reached


def expected_rounds(fire: torch.Tensor, exit_round: int, num_rounds: int) -> float:
    """Mean executed rounds of the lookahead rule on traced tokens (N + k if fired, else R)."""
    return float(torch.where(fire, float(exit_round), float(num_rounds)).mean()) \
        if len(fire) else math.nan
