"""Baseline exit rules and the oracle for real-generation evaluation (LAST_EXITED).

Rules: the hidden-state-delta rule (exit after r >= 2 when ||h_r - h_{r-1}|| / ||h_{r-1}|| <= eps)
and the successive-KL rule (exit after r >= 2 when KL(p_r || p_{r-1}) <= eps, nats), registered as
engine exit policies. Oracle: every round computed; the token exits at the earliest round whose
argmax equals round R's.
"""
from __future__ import annotations

import torch

from rltlab.engine.exit_policies import ExitPolicy, RoundInfo, register_exit_policy
from rltlab.eval.tasks import GenOutput
from rltlab.model.generate import left_pad

# ----------------------------------------------------------------------------- rule policies


class _SuccessiveRule(ExitPolicy):
    """Exit after round r >= 2 when distance(state_r, state_{r-1}) <= exit_policy_args["eps"];
    round max_loops always exits. Keeps the previous round's state per decode token."""

    def __init__(self, name: str):
        self.name = name
        self.prev: dict[tuple[int, int], torch.Tensor] = {}

    def validate(self, params, num_rounds):
        eps = params.exit_policy_args.get("eps")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"SamplingParams.exit_policy_args['eps'] must be a number >= 0, "
                             f"got {eps!r}")

    def state(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def distance(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def decide(self, info: RoundInfo) -> torch.Tensor:
        """The states and distances are computed where the hidden states are (the engine's
        device), the distances of all rows read back at once; targets on the host."""
        rounds = info.rounds.cpu()
        targets = torch.zeros_like(rounds)
        states = self.state(info.hidden.float())
        olds = [self.prev.pop((seq.seq_id, seq.num_tokens), None) for seq in info.seqs]
        compare = [row for row, old in enumerate(olds) if old is not None and rounds[row] >= 2]
        dist = {}
        if compare:
            values = torch.stack([self.distance(states[row], olds[row]) for row in compare])
            dist = dict(zip(compare, values.tolist()))
        for row, seq in enumerate(info.seqs):
            r = int(rounds[row])
            if r >= seq.params.max_loops:
                targets[row] = r
                continue
            if row in dist and dist[row] <= seq.params.exit_policy_args["eps"]:
                targets[row] = r
                continue
            self.prev[(seq.seq_id, seq.num_tokens)] = states[row]
        return targets


class HiddenDeltaRule(_SuccessiveRule):
    def state(self, hidden):
        return hidden

    def distance(self, new, old):
        return (new - old).norm() / old.norm().clamp_min(1e-12)


class SuccessiveKLRule(_SuccessiveRule):
    def __init__(self, name: str, lm_head_weight: torch.Tensor):
        super().__init__(name)
        self.weight = lm_head_weight.detach().float().clone()

    def state(self, hidden):
        if self.weight.device != hidden.device:
            self.weight = self.weight.to(hidden.device)
        return torch.log_softmax(hidden @ self.weight.T, dim=-1)

    def distance(self, new, old):
        return (new.exp() * (new - old)).sum().clamp_min(0)


def register_rule_policies(model) -> dict[str, str]:
    """Register "hidden_delta" and "successive_kl" (overwriting) for `model`."""
    register_exit_policy("hidden_delta", lambda _cfg, **_kw: HiddenDeltaRule("hidden_delta"),
                         overwrite=True)
    weight = model.lm_head.weight
    register_exit_policy("successive_kl",
                         lambda _cfg, **_kw: SuccessiveKLRule("successive_kl", weight),
                         overwrite=True)
    return {"hidden_delta": "hidden_delta", "successive_kl": "successive_kl"}


# ----------------------------------------------------------------------------- oracle

@torch.no_grad()
def oracle_generate(model, prompts: list[list[int]], max_new_tokens: int, *,
                    eos_token_id: int | None = 0, min_round: int = 1) -> list[GenOutput]:
    """Greedy generation where every decode token computes all R rounds, then exits at the
    earliest round e whose argmax equals round R's (its token is round R's): its K/V of
    round e is copied into planes e+1..R (LAST_EXITED), as if it had exited at e.
    exit_depths = e per output token (first = R); executed_depths reports the same e (the
    oracle's selected depth; it actually needed R rounds to know e). min_round m > 1: the
    floored oracle, e = max(m, earliest agreeing round)."""
    from rltlab.model.architecture import LoopedKVCache

    R = model.config.num_rounds
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    bsz, width = len(prompts), max(len(p) for p in prompts)
    ids, key_mask, positions = left_pad(prompts, 0, device)
    next_pos = positions[:, -1] + 1
    cache = LoopedKVCache(model.config, bsz, width + max_new_tokens, dtype, device)
    out = model(ids, positions=positions, key_mask=key_mask, cache=cache)
    token = out.final_logits[:, -1].argmax(-1)
    exit_round = torch.full((bsz,), R, dtype=torch.long)
    tokens, rounds = [token], [exit_round]
    done = token == eos_token_id if eos_token_id is not None else \
        torch.zeros(bsz, dtype=torch.bool, device=device)
    rounds_1_to_R = torch.arange(1, R + 1, device=device)
    for step in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        out = model(token[:, None], positions=(next_pos + step)[:, None], cache=cache,
                    all_logits=True)
        top = torch.stack([lg[:, -1].argmax(-1) for lg in out.logits], dim=-1)   # [B, R]
        agree = top == top[:, -1:]
        exit_round = torch.where(agree, rounds_1_to_R, R + 1).min(-1).values.cpu()
        exit_round = exit_round.clamp_min(min(max(1, min_round), R))
        pos = cache.length - 1
        for b, e in enumerate(exit_round.tolist()):
            if e < R:
                cache.k[e:, :, b, :, pos] = cache.k[e - 1, :, b, :, pos]
                cache.v[e:, :, b, :, pos] = cache.v[e - 1, :, b, :, pos]
        token = top[:, -1]
        tokens.append(token)
        rounds.append(exit_round)
        if eos_token_id is not None:
            done = done | (token == eos_token_id)
    tok = torch.stack(tokens, 1).tolist()
    rnd = torch.stack(rounds, 1).tolist()
    outs = []
    for t, r in zip(tok, rnd):
        end = t.index(eos_token_id) + 1 if eos_token_id is not None and eos_token_id in t \
            else len(t)
        outs.append(GenOutput(t[:end], r[:end], r[:end]))
    return outs


