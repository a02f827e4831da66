"""Exit policies: one small interface, a registry, and the built-in policies.

After each round of a decode token the engine asks the token's policy (grouped: one call per
policy for all rows at any rounds) for a target round per row:

    0        keep going, ask me again after the next round
    t == r   exit now, after the round r just completed
    t >  r   exit at round t (a lookahead answer: committed, not asked again)

Round R always exits. Prompt positions never ask (prefill is full depth). A policy reads its
per-request settings from the effective SamplingParams of each row's sequence
(min_loops / max_loops / exit_threshold / exit_policy_args); its factory receives the model
config and the engine-level keyword arguments (EngineConfig.exit_policy_args).

    register_exit_policy("mine", lambda model_config, **kw: MyPolicy(...))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rltlab import gates
from rltlab.config import OuroConfig
from rltlab.engine.sampling import SamplingParams


@dataclass
class RoundInfo:
    rounds: torch.Tensor        # int64 [N]: round r just completed (1-based)
    gate_logits: torch.Tensor   # fp32 [N, R]: g_1..g_r per row, zeros after r
    hidden: torch.Tensor        # [N, H]: h_r
    seqs: list                  # the rows' Sequences (params, num_output_tokens, ...)
    num_rounds: int

    def cdf_now(self) -> torch.Tensor:
        """CDF_r at each row's current round (fp32 [N]); zero padding after r is harmless."""
        cdf = gates.exit_cdf(self.gate_logits)
        return cdf.gather(-1, (self.rounds - 1)[:, None]).squeeze(-1)


class ExitPolicy:
    name = "base"

    def validate(self, params: SamplingParams, num_rounds: int) -> None:
        """Raise ValueError naming the field if a request's settings cannot work."""

    def decide(self, info: RoundInfo) -> torch.Tensor:
        raise NotImplementedError


def _q_fire(info: RoundInfo) -> torch.Tensor:
    """Stock Q-exit decision per row (gates.q_exit_now with each row's own settings)."""
    cdf, fire = info.cdf_now(), torch.zeros(len(info.seqs), dtype=torch.bool)
    groups: dict[tuple, list[int]] = {}
    for row, (seq, r) in enumerate(zip(info.seqs, info.rounds.tolist())):
        p = seq.params
        groups.setdefault((r, p.exit_threshold, p.min_loops, p.max_loops), []).append(row)
    for (r, threshold, min_loops, max_loops), rows in groups.items():
        idx = torch.tensor(rows)
        fire[idx] = gates.q_exit_now(cdf[idx].cpu(), r, threshold, min_loops, max_loops)
    return fire


class FixedDepth(ExitPolicy):
    """Exit at exit_policy_args["depth"] (default max_loops), decided after round 1."""
    name = "fixed"

    def validate(self, params, num_rounds):
        depth = params.exit_policy_args.get("depth", params.max_loops)
        if not isinstance(depth, int) or not 1 <= depth <= num_rounds:
            raise ValueError(f"SamplingParams.exit_policy_args['depth'] must lie in "
                             f"[1, {num_rounds}], got {depth!r}")

    def decide(self, info):
        depth = [s.params.exit_policy_args.get("depth", s.params.max_loops) for s in info.seqs]
        return torch.maximum(torch.tensor(depth), info.rounds.cpu())


class QExit(ExitPolicy):
    """Stock Q-exit: exit after r if r >= max_loops or (thr < 1, r >= min_loops, CDF_r >= thr)."""
    name = "q_exit"

    def decide(self, info):
        rounds = info.rounds.cpu()
        return torch.where(_q_fire(info), rounds, torch.zeros_like(rounds))


class DelayedQExit(ExitPolicy):
    """The stock gate one round late: it fires at r (< max_loops) -> exit at r + 1."""
    name = "q_exit_delayed"

    def decide(self, info):
        rounds, fire = info.rounds.cpu(), _q_fire(info)
        max_loops = torch.tensor([s.params.max_loops for s in info.seqs])
        target = torch.where(rounds >= max_loops, rounds, rounds + 1)
        return torch.where(fire, target, torch.zeros_like(rounds))


class TraceReplay(ExitPolicy):
    """Replay given depths: exit_policy_args["depths"][i] is the exit round for output token i,
    aligned like RequestOutput.exit_depths (so a rollout's exit_depths replay it exactly);
    depths[0] is the prefill's and must be R. Past the trace's end: exit_policy_args
    ["fallback"] (default R)."""
    name = "trace"

    def validate(self, params, num_rounds):
        depths = params.exit_policy_args.get("depths")
        if not isinstance(depths, (list, tuple)) or not depths or not all(
                isinstance(d, int) and 1 <= d <= num_rounds for d in depths):
            raise ValueError("SamplingParams.exit_policy_args['depths'] must be a non-empty "
                             f"list of rounds in [1, {num_rounds}], got {depths!r}")
        if depths[0] != num_rounds:
            raise ValueError("SamplingParams.exit_policy_args['depths'][0] is the prefill's "
                             f"depth and must be R={num_rounds}, got {depths[0]}")
        fallback = params.exit_policy_args.get("fallback", num_rounds)
        if not isinstance(fallback, int) or not 1 <= fallback <= num_rounds:
            raise ValueError("SamplingParams.exit_policy_args['fallback'] must lie in "
                             f"[1, {num_rounds}], got {fallback!r}")

    def decide(self, info):
        targets = []
        for seq in info.seqs:
            depths, i = seq.params.exit_policy_args["depths"], seq.num_output_tokens
            targets.append(depths[i] if i < len(depths)
                           else seq.params.exit_policy_args.get("fallback", info.num_rounds))
        return torch.maximum(torch.tensor(targets), info.rounds.cpu())


class Lookahead(ExitPolicy):
    """After round N (args "round", default 1) a predictor scores "can exit at N + k" (args "k",
    default 2); score >= args "threshold" (default 0.5) -> exit at min(N + k, max_loops), else
    at max_loops. predictor(info) -> fp32 [N] in [0, 1] is the factory's keyword argument; the
    default is a placeholder: the stock gate's CDF at round N (no trained predictor exists)."""
    name = "lookahead"

    def __init__(self, predictor: Callable[[RoundInfo], torch.Tensor] | None = None):
        self.predictor = predictor or RoundInfo.cdf_now

    def _args(self, params):
        args = params.exit_policy_args
        return args.get("round", 1), args.get("k", 2), args.get("threshold", 0.5)

    def validate(self, params, num_rounds):
        n, k, threshold = self._args(params)
        if not isinstance(n, int) or not 1 <= n <= num_rounds:
            raise ValueError(f"SamplingParams.exit_policy_args['round'] must lie in "
                             f"[1, {num_rounds}], got {n!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"SamplingParams.exit_policy_args['k'] must be an int >= 1, got {k!r}")
        if not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise ValueError("SamplingParams.exit_policy_args['threshold'] must lie in [0, 1], "
                             f"got {threshold!r}")

    def decide(self, info):
        rounds = info.rounds.cpu()
        targets = torch.zeros_like(rounds)
        score = self.predictor(info).float().cpu()
        for row, seq in enumerate(info.seqs):
            n, k, threshold = self._args(seq.params)
            r, max_loops = int(rounds[row]), seq.params.max_loops
            if r >= max_loops:
                targets[row] = r
            elif r == n:
                targets[row] = min(n + k, max_loops) if score[row] >= threshold else max_loops
        return targets


_REGISTRY: dict[str, Callable[..., ExitPolicy]] = {}


def register_exit_policy(name: str, factory: Callable[..., ExitPolicy], *,
                         overwrite: bool = False) -> None:
    """factory(model_config: OuroConfig, **engine_kwargs) -> ExitPolicy."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"exit policy name must be a non-empty str, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"exit policy {name!r} is already registered (pass overwrite=True)")
    _REGISTRY[name] = factory


def available_exit_policies() -> list[str]:
    return sorted(_REGISTRY)


def create_exit_policy(name: str, model_config: OuroConfig, **kwargs: Any) -> ExitPolicy:
    if name not in _REGISTRY:
        raise ValueError(f"unknown exit policy {name!r}; registered: {available_exit_policies()}")
    policy = _REGISTRY[name](model_config, **kwargs)
    if not isinstance(policy, ExitPolicy):
        raise TypeError(f"factory of exit policy {name!r} returned {type(policy).__name__}, "
                        "not an ExitPolicy")
    return policy


for _cls in (FixedDepth, QExit, DelayedQExit, TraceReplay):
    register_exit_policy(_cls.name, lambda _cfg, _cls=_cls: _cls())
register_exit_policy(Lookahead.name, lambda _cfg, predictor=None: Lookahead(predictor))
