"""Evaluation metrics (docs/ouro.md): paired differences with a standard error, token
agreement with full depth, depth statistics without the first output token, and speed figures
(tokens/s, TTFT, TPOT) from timing records.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np


# ----------------------------------------------------------------------------- quality

@dataclass
class PairedDifference:
    """mean(a - b) over paired examples with its standard error (sd of the differences / sqrt n).

    z = diff / se; ci95 = diff +- 1.96 se. Also the two accuracies and the discordant counts
    (a right & b wrong, a wrong & b right), which are what drive the difference.
    """
    n: int
    mean_a: float
    mean_b: float
    diff: float
    se: float
    ci95: tuple[float, float]
    a_only: int
    b_only: int

    @property
    def z(self) -> float:
        return self.diff / self.se if self.se > 0 else (0.0 if self.diff == 0 else math.inf)

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean_a": self.mean_a, "mean_b": self.mean_b, "diff": self.diff,
                "se": self.se, "ci95": list(self.ci95), "a_only": self.a_only,
                "b_only": self.b_only, "z": self.z if math.isfinite(self.z) else None}

    def __str__(self) -> str:
        return (f"{100 * self.mean_a:.1f}% vs {100 * self.mean_b:.1f}%: diff "
                f"{100 * self.diff:+.1f} pp +- {100 * self.se:.1f} (se, n={self.n})")


def paired_difference(scores_a: Sequence[float], scores_b: Sequence[float]) -> PairedDifference:
    """Paired difference of two per-example score lists (0/1 or any real scores), a - b.

    se = sample standard deviation of d_i = a_i - b_i (ddof 1) / sqrt(n); 0 for n = 1.
    """
    a, b = np.asarray(scores_a, dtype=float), np.asarray(scores_b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores must be two equally long 1-D lists ({a.shape} vs "
                         f"{b.shape}); pair them by example id first")
    if a.size == 0:
        raise ValueError("paired_difference needs at least one example")
    d = a - b
    n = d.size
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    diff = float(d.mean())
    return PairedDifference(n=n, mean_a=float(a.mean()), mean_b=float(b.mean()), diff=diff,
                            se=se, ci95=(diff - 1.96 * se, diff + 1.96 * se),
                            a_only=int(((a > b)).sum()), b_only=int(((b > a)).sum()))


def mean_with_se(scores: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample sd / sqrt n) of one score list."""
    x = np.asarray(scores, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def token_agreement(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
                    ) -> dict[str, float]:
    """Agreement of generated sequences with the full-depth reference, pooled over sequences.

    position: share of reference positions where the token is the same (a missing position
    counts as a disagreement); prefix: share of reference tokens inside the common prefix
    (the tokens generated before the first divergence); exact: share of identical sequences.
    """
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} sequences vs {len(reference)} references")
    same = prefix = total = exact = 0
    for seq, ref in zip(tokens, reference):
        seq, ref = list(seq), list(ref)
        total += len(ref)
        matches = [x == y for x, y in zip(seq, ref)]
        same += sum(matches)
        prefix += next((i for i, m in enumerate(matches) if not m), len(matches))
        exact += int(seq == ref)
    total = max(total, 1)
    return {"position": same / total, "prefix": prefix / total,
            "exact": exact / max(len(reference), 1)}


# ----------------------------------------------------------------------------- depth

def decode_depths(depths_per_seq: Iterable[Sequence[int]]) -> list[int]:
    """Flatten per-sequence depth lists, dropping each sequence's FIRST output token (it comes
    from the full-depth prefill, docs/ouro.md, KV semantics)."""
    out: list[int] = []
    for depths in depths_per_seq:
        out.extend(int(d) for d in list(depths)[1:])
    return out


def depth_histogram(depths_per_seq: Iterable[Sequence[int]], num_rounds: int
                    ) -> dict[int, int]:
    """{round: decode-token count} for rounds 1..num_rounds, first output token excluded."""
    flat = decode_depths(depths_per_seq)
    hist = {r: 0 for r in range(1, num_rounds + 1)}
    for d in flat:
        if not 1 <= d <= num_rounds:
            raise ValueError(f"depth {d} outside 1..{num_rounds}")
        hist[d] += 1
    return hist


def depth_stats(selected: Iterable[Sequence[int]], executed: Iterable[Sequence[int]] | None = None,
                num_rounds: int = 4) -> dict[str, Any]:
    """Mean selected and executed rounds per decode token and their histograms (first output
    token of every sequence excluded). executed None = same as selected (plain generation
    executes exactly the selected rounds)."""
    selected = [list(s) for s in selected]
    executed = selected if executed is None else [list(e) for e in executed]
    sel, exe = decode_depths(selected), decode_depths(executed)
    return {"decode_tokens": len(sel),
            "mean_selected": float(np.mean(sel)) if sel else math.nan,
            "mean_executed": float(np.mean(exe)) if exe else math.nan,
            "selected_hist": depth_histogram(selected, num_rounds),
            "executed_hist": depth_histogram(executed, num_rounds)}


# ----------------------------------------------------------------------------- speed

def _get(record: Any, *names: str) -> Any:
    for name in names:
        if isinstance(record, Mapping) and name in record:
            return record[name]
        if not isinstance(record, Mapping) and hasattr(record, name):
            return getattr(record, name)
    return None


def timing_records(outputs: Iterable[Any]) -> list[dict[str, Any]]:
    """Timing records from engine RequestOutputs (metrics.arrival_time / first_token_time /
    finished_time, perf_counter seconds) with the output token count of all samples."""
    records = []
    for out in outputs:
        m = out.metrics
        n = sum(len(c.token_ids) for c in out.outputs)
        records.append({"arrival_time": m.arrival_time, "first_token_time": m.first_token_time,
                        "finished_time": m.finished_time, "num_tokens": n})
    return records


def timing_stats(records: Iterable[Any], warmup: int = 0) -> dict[str, float]:
    """Speed figures from per-request timing records (seconds, one clock).

    A record is a dict or object with arrival_time (or start), first_token_time, finished_time
    (or end) and num_tokens (or num_output_tokens, or token_ids). The first `warmup` records
    (in arrival order) are dropped. Returns:
      tokens_per_s  output tokens of all requests / (last finish - first arrival)
      ttft_*        time to first token = first_token - arrival (median, mean, p90), s
      tpot_*        time per output token after the first = (finish - first_token)/(n - 1), s
                    (requests with one token have none)
      e2e_median    median request latency, s
    """
    rows = []
    for rec in records:
        arrival = _get(rec, "arrival_time", "start", "start_time")
        first = _get(rec, "first_token_time", "first_token")
        finish = _get(rec, "finished_time", "end", "end_time", "finish_time")
        n = _get(rec, "num_tokens", "num_output_tokens")
        if n is None:
            ids = _get(rec, "token_ids")
            n = len(ids) if ids is not None else None
        if arrival is None or finish is None or n is None:
            raise ValueError(f"timing record lacks arrival/finish/token count: {rec!r}")
        rows.append((float(arrival), None if first is None else float(first), float(finish),
                     int(n)))
    rows.sort(key=lambda r: r[0])
    rows = rows[warmup:]
    if not rows:
        raise ValueError("no timing records left after warm-up")
    span = max(r[2] for r in rows) - min(r[0] for r in rows)
    tokens = sum(r[3] for r in rows)
    ttft = np.array([r[1] - r[0] for r in rows if r[1] is not None])
    tpot = np.array([(r[2] - r[1]) / (r[3] - 1) for r in rows if r[1] is not None and r[3] > 1])
    e2e = np.array([r[2] - r[0] for r in rows])

    def pick(arr, fn):
        return float(fn(arr)) if arr.size else math.nan
    return {"requests": len(rows), "output_tokens": tokens, "wall_s": span,
            "tokens_per_s": tokens / span if span > 0 else math.nan,
            "ttft_median": pick(ttft, np.median), "ttft_mean": pick(ttft, np.mean),
            "ttft_p90": pick(ttft, lambda a: np.percentile(a, 90)),
            "tpot_median": pick(tpot, np.median), "tpot_mean": pick(tpot, np.mean),
            "tpot_p90": pick(tpot, lambda a: np.percentile(a, 90)),
            "e2e_median": pick(e2e, np.median)}
