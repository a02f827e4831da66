"""A traced rollout with the stock Q-exit, and per-round summaries of a trace directory."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

from rltlab.engine.sampling import q_exit_params
from rltlab.traces.collect import collect_traces


def collect_rollout_traces(llm, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike, *,
                           threshold: float, max_tokens: int, teacher: bool = True,
                           temperature: float = 0.0, seed: int = 0, min_loops: int = 1,
                           stop: Sequence[str] = (),
                           **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """Trace a rollout of `prompts` with the Q-exit at `threshold` (teacher mode by default).
    stop: stop strings (SamplingParams.stop; a few-shot task's, e.g. GSM8K's "Q:").
    rltlab.workbench.collect_rollout_traces is the same call that hands the work to N ranks
    under `rltlab run --num-processes N`."""
    params = rollout_params(threshold, max_tokens, min_loops=min_loops, seed=seed,
                            temperature=temperature, stop=stop)
    return collect_traces(llm, prompts, params, out_dir, teacher=teacher, **collector_kwargs)


def rollout_params(threshold: float, max_tokens: int, *, min_loops: int = 1, seed: int = 0,
                   temperature: float = 0.0, stop: Sequence[str] = ()):
    """The SamplingParams of a traced rollout: Q-exit at `threshold`, stopping where the engine
    stops (its model's eos_token_id) and at the `stop` strings."""
    params = q_exit_params(threshold, max_tokens, min_loops=min_loops, seed=seed,
                           temperature=temperature)
    return dataclasses.replace(params, stop=list(stop)) if stop else params


def trace_summary(trace_dir: str | os.PathLike) -> dict[str, Any]:
    """Per-round means over traced tokens (executed rounds only): entropy (nats), top-1 prob,
    agreement of the round-r top-1 with the reference (round-R) token, KL(p_ref || p_r) (nats),
    CDF; plus the selected/executed depth histograms and calibration pairs (CDF_r vs agreement
    at r) for rounds below R."""
    from rltlab.traces import load_traces

    tr = load_traces(trace_dir, fields=["round_mask", "entropy", "top1_prob", "top1_id",
                                        "ref_token", "kl_ref", "cdf", "selected", "executed"])
    mask = tr["round_mask"]
    n, R = mask.shape
    agree = (tr["top1_id"] == tr["ref_token"][:, None]).float()
    per_round = []
    for r in range(R):
        m = mask[:, r]
        if not m.any():
            continue
        per_round.append({
            "round": r + 1, "tokens": int(m.sum()),
            "entropy": float(tr["entropy"][m, r].mean()),
            "top1_prob": float(tr["top1_prob"][m, r].mean()),
            "agree_with_ref": float(agree[m, r].mean()),
            "kl_ref": float(tr["kl_ref"][m, r].mean()), "cdf": float(tr["cdf"][m, r].mean())})
    hist = {k: {int(d): int((tr[k] == d).sum()) for d in range(1, R + 1)}
            for k in ("selected", "executed")}
    below = mask[:, :R - 1]
    calib = {"probs": tr["cdf"][:, :R - 1][below].tolist(),
             "labels": agree[:, :R - 1][below].tolist()}
    return {"tokens": n, "per_round": per_round, "hist": hist, "calibration": calib,
            "mean_selected": float(tr["selected"].float().mean()) if n else math.nan,
            "mean_executed": float(tr["executed"].float().mean()) if n else math.nan}
