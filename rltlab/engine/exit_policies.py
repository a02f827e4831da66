"""Exit policies: one small interface, a registry, and the built-in policies.

After each round of a decode token the engine asks the token's policy (grouped: one call per
policy for all rows at any rounds) for a target round per row:

    0        keep going, ask me again after the next round
    t == r   exit now, after the round r just completed
    t >  r   exit at round t (a lookahead answer: committed, not asked again)

Round min(R, max_loops) always exits (the engine enforces it; policies are not asked there).
Prompt positions never ask (prefill is full depth).

Host syncs: a policy with `decision_lag = L >= 1` promises answers t == 0 or t >= r + L. Its
decide() may return a device tensor; the engine copies it to the host asynchronously and reads it
only at the end of round r + L, so the GPU never waits on the host in the round that computed
the score (delayed Q-exit: L = 1; lookahead N -> N + k: L >= 1). A policy with `reads_gates =
False` gets no gate history (RoundInfo.gate_logits is None), which keeps fixed-depth and
trace-replay decoding free of device reads altogether. A policy reads its
per-request settings from the effective SamplingParams of each row's sequence
(min_loops / max_loops / exit_threshold / exit_policy_args); its factory receives the model
config and the engine-level keyword arguments (EngineConfig.exit_policy_args).

Argument names are checked, so a typo fails loudly instead of falling back to a default: a
policy lists the per-request keys it reads in `arg_names` (the engine refuses other keys,
naming them and the valid ones; None = not declared, nothing checked), and create_exit_policy
refuses engine-level keyword arguments that the factory does not take.

Round 0: a policy with `asks_before_round1 = True` (and decision_lag >= 1) is also asked once
per decode token BEFORE its round 1 runs, with rounds = 0, hidden = h_0 = embed(token) and no
gate logits; it answers 0 (no decision) or t >= decision_lag, read (lagged, as above) at the
end of round decision_lag. The emitting state of the previous output token is on the
sequence (Sequence.emit_hidden). Other policies are first asked after round 1.

    register_exit_policy("mine", lambda model_config, **kw: MyPolicy(...))
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rltlab.model import gates
from rltlab.model.config import OuroConfig
from rltlab.common.device import tensor_to_device, to_device
from rltlab.engine.sampling import SamplingParams


@dataclass
class RoundInfo:
    rounds: torch.Tensor        # int64 [N] on the host: round r just completed (1-based)
    gate_logits: torch.Tensor | None   # fp32 [N, R] on the model's device: g_1..g_r, zeros
                                       # after r (None for a policy with reads_gates False)
    hidden_source: torch.Tensor  # [T, H] on the model's device: the step's h_r (see hidden)
    seqs: list                  # the rows' Sequences (params, num_output_tokens, ...)
    num_rounds: int
    source_rows: list[int] | None = None   # the rows' indices into hidden_source (None: all)

    @functools.cached_property
    def hidden(self) -> torch.Tensor:
        """[N, H] h_r of the rows, gathered on first use: a policy that never reads it (fixed
        depth, trace replay) costs no index upload and no gather."""
        if self.source_rows is None:
            return self.hidden_source
        return self.hidden_source[to_device(self.source_rows, torch.int64, self.device)]

    @property
    def device(self) -> torch.device:
        return self.hidden_source.device

    @functools.cached_property
    def rounds_on_device(self) -> torch.Tensor:
        """rounds on the model's device, copied once without waiting for the device (a
        non-blocking .to() of pageable memory still waits for the stream to drain)."""
        return tensor_to_device(self.rounds, self.device)

    def select(self, rows: list[int]) -> "RoundInfo":
        """The same round for a subset of the rows (hidden still gathered only when read)."""
        idx = torch.tensor(rows, dtype=torch.int64)
        source = self.source_rows
        gates = None if self.gate_logits is None else \
            self.gate_logits[tensor_to_device(idx, self.device)]
        return RoundInfo(self.rounds[idx], gates,
                         self.hidden_source, [self.seqs[i] for i in rows], self.num_rounds,
                         [source[i] for i in rows] if source is not None else list(rows))

    def per_row(self, values: list, dtype=torch.float32) -> torch.Tensor:
        """A per-row host list as a tensor on the model's device (no sync: a host->device copy)."""
        return to_device(values, dtype, self.device)

    def cdf_now(self) -> torch.Tensor:
        """CDF_r at each row's current round (fp32 [N], on the device)."""
        cdf = gates.exit_cdf(self.gate_logits)
        rounds = self.rounds_on_device
        return cdf.gather(-1, (rounds - 1)[:, None]).squeeze(-1)


class ExitPolicy:
    name = "base"
    reads_gates = True      # the engine keeps each token's gate logits for RoundInfo
    decision_lag = 0        # see the module docstring
    asks_before_round1 = False   # round-0 ask (see the module docstring)
    arg_names: frozenset[str] | None = None   # per-request exit_policy_args keys (None: unchecked)

    def check_arg_names(self, params: SamplingParams) -> None:
        """Refuse exit_policy_args keys this policy does not read (if it declares arg_names)."""
        if self.arg_names is None:
            return
        unknown = sorted(set(params.exit_policy_args) - self.arg_names, key=repr)
        if unknown:
            valid = (f"valid keys: {', '.join(map(repr, sorted(self.arg_names)))}"
                     if self.arg_names else "it takes no per-request arguments")
            raise ValueError(f"SamplingParams.exit_policy_args has unknown key(s) "
                             f"{', '.join(map(repr, unknown))} for exit policy {self.name!r}; "
                             f"{valid}")

    def validate(self, params: SamplingParams, num_rounds: int) -> None:
        """Raise ValueError naming the field if a request's settings cannot work."""

    def decide(self, info: RoundInfo) -> torch.Tensor:
        raise NotImplementedError


def _is_int(value: Any) -> bool:
    """An int that is not a bool (True would pass as round 1), as prompt ids are checked."""
    return isinstance(value, int) and not isinstance(value, bool)


def _q_fire(info: RoundInfo) -> torch.Tensor:
    """Stock Q-exit decision per row on the device (gates.q_exit_now, vectorized over rows with
    their own threshold / min_loops / max_loops)."""
    params = [seq.params for seq in info.seqs]
    threshold = info.per_row([p.exit_threshold for p in params])
    min_loops = info.per_row([p.min_loops for p in params], torch.int64)
    max_loops = info.per_row([p.max_loops for p in params], torch.int64)
    rounds = info.rounds_on_device
    gate_fires = (threshold < 1.0) & (rounds >= min_loops) & (info.cdf_now() >= threshold)
    return (rounds >= max_loops) | gate_fires


class FixedDepth(ExitPolicy):
    """Exit at exit_policy_args["depth"] (default max_loops), decided on the host after round 1."""
    name = "fixed"
    reads_gates = False
    arg_names = frozenset({"depth"})

    def validate(self, params, num_rounds):
        depth = params.exit_policy_args.get("depth", params.max_loops)
        if not _is_int(depth) or not 1 <= depth <= params.max_loops:
            raise ValueError(f"SamplingParams.exit_policy_args['depth'] must lie in "
                             f"[1, max_loops={params.max_loops}], got {depth!r}")

    def decide(self, info):
        depth = [s.params.exit_policy_args.get("depth", s.params.max_loops) for s in info.seqs]
        return torch.maximum(torch.tensor(depth), info.rounds)


class QExit(ExitPolicy):
    """Stock Q-exit: exit after r if r >= max_loops or (thr < 1, r >= min_loops, CDF_r >= thr).
    The answer is needed now, so the engine reads it at once (one host sync per round)."""
    name = "q_exit"
    arg_names = frozenset()

    def decide(self, info):
        rounds = info.rounds_on_device
        return torch.where(_q_fire(info), rounds, torch.zeros_like(rounds))


class DelayedQExit(ExitPolicy):
    """The stock gate one round late: it fires at r (< max_loops) -> exit at r + 1. The engine
    reads the answer a round later, without a host sync in the round that computed it."""
    name = "q_exit_delayed"
    decision_lag = 1
    arg_names = frozenset()

    def decide(self, info):
        rounds = info.rounds_on_device
        return torch.where(_q_fire(info), rounds + 1, torch.zeros_like(rounds))


class TraceReplay(ExitPolicy):
    """Replay given depths: exit_policy_args["depths"][i] is the exit round for output token i,
    aligned like RequestOutput.exit_depths (so a rollout's exit_depths replay it exactly);
    depths[0] is the prefill's and must be R. Past the trace's end: exit_policy_args
    ["fallback"] (default R). Decided on the host after round 1 (no device reads)."""
    name = "trace"
    reads_gates = False
    arg_names = frozenset({"depths", "fallback"})

    def validate(self, params, num_rounds):
        depths = params.exit_policy_args.get("depths")
        if not isinstance(depths, (list, tuple)) or not depths:
            raise ValueError("SamplingParams.exit_policy_args['depths'] must be a non-empty "
                             f"list of rounds in [1, {num_rounds}], got {depths!r}")
        for i, d in enumerate(depths):
            if not _is_int(d) or not 1 <= d <= num_rounds:
                raise ValueError(f"SamplingParams.exit_policy_args['depths'][{i}] must be an "
                                 f"int round in [1, {num_rounds}], got {d!r}")
        if depths[0] != num_rounds:
            raise ValueError("SamplingParams.exit_policy_args['depths'][0] is the prefill's "
                             f"depth and must be R={num_rounds}, got {depths[0]}")
        fallback = params.exit_policy_args.get("fallback", num_rounds)
        if not _is_int(fallback) or not 1 <= fallback <= num_rounds:
            raise ValueError("SamplingParams.exit_policy_args['fallback'] must lie in "
                             f"[1, {num_rounds}], got {fallback!r}")

    def decide(self, info):
        targets = []
        for seq in info.seqs:
            depths, i = seq.params.exit_policy_args["depths"], seq.num_output_tokens
            targets.append(depths[i] if i < len(depths)
                           else seq.params.exit_policy_args.get("fallback", info.num_rounds))
        return torch.maximum(torch.tensor(targets), info.rounds)


class Lookahead(ExitPolicy):
    """After round N (args "round", default 1) a predictor scores "can exit at N + k" (args "k",
    default 2); score >= args "threshold" (default 0.5) -> exit at min(N + k, max_loops), else
    at max_loops. predictor(info) -> fp32 [N] in [0, 1] (on the device) is the factory's keyword
    argument; the default is a placeholder: the stock gate's CDF at round N. Every answer lies
    at least one round ahead, so the engine reads it without a sync (decision_lag 1)."""
    name = "lookahead"
    decision_lag = 1
    arg_names = frozenset({"round", "k", "threshold"})

    def __init__(self, predictor: Callable[[RoundInfo], torch.Tensor] | None = None):
        self.predictor = predictor or RoundInfo.cdf_now

    def _args(self, params):
        args = params.exit_policy_args
        return args.get("round", 1), args.get("k", 2), args.get("threshold", 0.5)

    def validate(self, params, num_rounds):
        n, k, threshold = self._args(params)
        if not _is_int(n) or not 1 <= n <= num_rounds:
            raise ValueError(f"SamplingParams.exit_policy_args['round'] must lie in "
                             f"[1, {num_rounds}], got {n!r}")
        if not _is_int(k) or k < 1:
            raise ValueError(f"SamplingParams.exit_policy_args['k'] must be an int >= 1, got {k!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not 0 <= threshold <= 1:
            raise ValueError("SamplingParams.exit_policy_args['threshold'] must lie in [0, 1], "
                             f"got {threshold!r}")

    def decide(self, info):
        args = [self._args(seq.params) for seq in info.seqs]
        n = info.per_row([a[0] for a in args], torch.int64)
        ahead = info.per_row([min(a[0] + a[1], s.params.max_loops)
                              for a, s in zip(args, info.seqs)], torch.int64)
        threshold = info.per_row([float(a[2]) for a in args])
        max_loops = info.per_row([s.params.max_loops for s in info.seqs], torch.int64)
        rounds = info.rounds_on_device
        score = self.predictor(info).float()
        target = torch.where(score >= threshold, ahead, max_loops)
        return torch.where(rounds == n, target, torch.zeros_like(target))


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
    _check_factory_args(name, _REGISTRY[name], kwargs)
    policy = _REGISTRY[name](model_config, **kwargs)
    if not isinstance(policy, ExitPolicy):
        raise TypeError(f"factory of exit policy {name!r} returned {type(policy).__name__}, "
                        "not an ExitPolicy")
    return policy


def _check_factory_args(name: str, factory: Callable[..., ExitPolicy], kwargs: dict) -> None:
    """Refuse engine-level arguments the factory does not take (a ValueError naming them and
    the valid ones, instead of the factory's bare TypeError)."""
    try:
        params = list(inspect.signature(factory).parameters.values())[1:]   # after the config
    except (TypeError, ValueError):   # no signature to read: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    valid = sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        hint = (f"valid keys: {', '.join(map(repr, valid))}" if valid
                else "it takes no engine-level arguments")
        raise ValueError(
            f"EngineConfig.exit_policy_args has unknown key(s) {', '.join(map(repr, unknown))} "
            f"for exit policy {name!r} ({hint}); per-request settings go in "
            "SamplingParams.exit_policy_args")


def _no_engine_args(cls: type[ExitPolicy]) -> Callable[[OuroConfig], ExitPolicy]:
    return lambda _cfg: cls()


for _cls in (FixedDepth, QExit, DelayedQExit, TraceReplay):
    register_exit_policy(_cls.name, _no_engine_args(_cls))
register_exit_policy(Lookahead.name, lambda _cfg, predictor=None: Lookahead(predictor))
