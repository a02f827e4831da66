"""Exit-gate math of looped models (docs/ouro.md, the exit gate), always in fp32.

Conventions: the round axis is the LAST axis of every tensor here, rounds are 1-based in
names and results (round r lives at index r-1).

    hazard     lambda_r = sigmoid(g_r)
    survival   S_r      = prod_{j<=r} (1 - lambda_j)
    exit dist  p(r)     = lambda_r * S_{r-1}   (r < R),   p(R) = S_{R-1}
    CDF        CDF_r    = 1 - S_r
"""
from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half types to fp32; keep fp64 (gradient checks run the whole model in fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def hazards(gate_logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(at_least_fp32(gate_logits))


def survival(gate_logits: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(1.0 - hazards(gate_logits), dim=-1)


def exit_cdf(gate_logits: torch.Tensor) -> torch.Tensor:
    return 1.0 - survival(gate_logits)


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """p(r) for r = 1..R; sums to 1 over the last axis. The last round's hazard is unused."""
    lam = hazards(gate_logits)
    surv = torch.cumprod(1.0 - lam, dim=-1)
    prev_surv = torch.cat([torch.ones_like(surv[..., :1]), surv[..., :-1]], dim=-1)
    probs = lam * prev_surv
    return torch.cat([probs[..., :-1], prev_surv[..., -1:]], dim=-1)


def validate_loops(num_rounds: int, min_loops: int, max_loops: int, threshold: float) -> None:
    if not 1 <= min_loops <= num_rounds:
        raise ValueError(f"min_loops must lie in [1, {num_rounds}], got {min_loops}")
    if not min_loops <= max_loops <= num_rounds:
        raise ValueError(f"max_loops must lie in [min_loops={min_loops}, {num_rounds}], "
                         f"got {max_loops}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"exit threshold must lie in [0, 1], got {threshold}")


def q_exit_now(cdf_r: torch.Tensor, round_idx: int, threshold: float,
               min_loops: int, max_loops: int) -> torch.Tensor:
    """Q-exit decision after round `round_idx` (1-based) given CDF_r: a bool tensor."""
    if round_idx >= max_loops:
        return torch.ones_like(cdf_r, dtype=torch.bool)
    if threshold >= 1.0 or round_idx < min_loops:
        return torch.zeros_like(cdf_r, dtype=torch.bool)
    return cdf_r >= threshold


def q_exit_rounds(gate_logits: torch.Tensor, threshold: float, min_loops: int = 1,
                  max_loops: int | None = None) -> torch.Tensor:
    """The stock Q-exit round (1-based, int64) for every position, from all R gate logits.

    Rounds before min_loops still contribute their hazard to the CDF.
    """
    num_rounds = gate_logits.shape[-1]
    max_loops = num_rounds if max_loops is None else max_loops
    validate_loops(num_rounds, min_loops, max_loops, threshold)
    cdf = exit_cdf(gate_logits)
    exit_round = torch.full(cdf.shape[:-1], max_loops, dtype=torch.long, device=cdf.device)
    # Walk from the deepest allowed round down so the earliest qualifying round wins.
    for r in range(max_loops - 1, 0, -1):
        fire = q_exit_now(cdf[..., r - 1], r, threshold, min_loops, max_loops)
        exit_round = torch.where(fire, torch.full_like(exit_round, r), exit_round)
    return exit_round
