"""Labels and features of the N+k lookahead exit predictor (docs/ouro.md).

Everything here reads teacher-mode traces (rltlab.traces: every decode token ran all R rounds)
and is shared by training and by the live engine policy, so the features a checkpoint was
trained on are exactly the ones the engine computes.

Decision round N, target exit round t = N + k (k = 2: "N+2"). Labels for "the token can exit
at round t" (1 = yes), all against the round-R reference (teacher mode: the emitted token):

    argmax   top-1 of round t == top-1 of round R            (CALM classifier label)
    kl       KL(p_R || p_t) <= eps                             (nats)
    stage2   Ouro Stage II improvement label: no later round improves the CE of the reference
             token by more than `margin`: max_{r > t} max(0, CE_{r-1} - CE_r) <= margin
             (margin 0.005 nats, the paper's sigmoid(50 (I_r - 0.005)) crossing 0.5); CE_r =
             -log p_r(reference token). The paper uses the data's next token; in generation
             the reference is the round-R token.
    downstream   argmax at t, and exiting the token at t changes no later output's argmax
                 within `window` outputs (None: to the sequence end), measured by
                 exit_predictor.downstream in teacher forcing ("single": this exit alone;
                 "greedy": with the earlier safe exits of the sequence in place); needs the
                 trace directory's downstream file (attach_downstream adds its two fields)

Features available after round N (fp32):

    h_N                    [H]   normalized hidden state of round N
    g_1 .. g_N             [N]   exit-gate logits so far
    top1_prob, margin,
    entropy at round N     [3]   from softmax(lm_head(h_N)) (probability units, nats)

Features at round N = 0 (before round 1 of token t runs; ROUND0_BLOCKS, fp32, in this order):

    embed        [H]   h_0 = embed(token t): the round-1 input
    prev_stats   [3]   top-1 prob, margin, entropy of the distribution token t was sampled from
                       (lm_head of the state the previous position exited from; in teacher-mode
                       traces: round R of the previous traced position)
    prev_hidden  [H]   that state itself (optional block)

The previous position's executed depth and gate logits are not used: in teacher-mode traces
every token ran R rounds (a constant), and in generation the gates after its exit round do not
exist. The first decode token (output index 1) has no previous traced position (its input
came from the prefill): its previous state is the prefill's (round R of the last prompt
position, as the engine feeds it), taken from the trace directory's prefill states
(exit_predictor.data.PREFILL_FILE) when given; without them N = 0 training uses output
indices >= 2 only. On the k-hop task output index 1 is the answer digit, the one token whose
depth decides the answer.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

LABEL_KINDS = ("argmax", "kl", "stage2", "downstream")
TRACE_FIELDS = ("hidden", "round_mask", "gate_logit", "top1_id", "top1_prob", "margin",
                "entropy", "kl_ref", "logprob_ref", "ref_token", "executed", "prompt_id",
                "weight_version", "token", "output_index", "sample_index")
ROUND0_BLOCKS = ("embed", "prev_stats", "prev_hidden")
DEFAULT_ROUND0_BLOCKS = ("embed", "prev_stats")


def label_spec(kind: str = "argmax", eps: float = 0.1, margin: float = 0.005,
               window: int | None = None) -> dict[str, Any]:
    """A JSON-able label definition (stored in the checkpoint manifest)."""
    if kind not in LABEL_KINDS:
        raise ValueError(f"label kind must be one of {LABEL_KINDS}, got {kind!r}")
    spec: dict[str, Any] = {"kind": kind, "reference": "round R (teacher mode)"}
    if kind == "kl":
        spec["eps"] = float(eps)
    if kind == "stage2":
        spec["margin"] = float(margin)
    if kind == "downstream":
        if window is not None and window < 1:
            raise ValueError(f"downstream window must be >= 1 outputs or None, got {window}")
        spec["window"] = None if window is None else int(window)
    return spec


def make_labels(traces: Mapping[str, torch.Tensor], exit_round: int,
                spec: Mapping[str, Any]) -> torch.Tensor:
    """float [T] in {0, 1}: can each token exit at `exit_round` (1-based)? See module doc."""
    R = traces["round_mask"].shape[1]
    if not 1 <= exit_round <= R:
        raise ValueError(f"exit round must lie in [1, {R}], got {exit_round}")
    t = exit_round - 1
    kind = spec["kind"]
    if kind == "argmax":
        lab = traces["top1_id"][:, t] == traces["top1_id"][:, R - 1]
    elif kind == "kl":
        lab = traces["kl_ref"][:, t] <= float(spec["eps"])
    elif kind == "stage2":
        ce = -traces["logprob_ref"].double()
        if exit_round >= R:
            lab = torch.ones(ce.shape[0], dtype=torch.bool)
        else:
            gain = (ce[:, t:R - 1] - ce[:, t + 1:R]).clamp_min(0)   # I_r for r = t+2 .. R
            lab = gain.max(dim=1).values <= float(spec["margin"])
    elif kind == "downstream":
        if "downstream_first_flip" not in traces:
            raise ValueError("the downstream label needs exit_predictor.downstream."
                             "attach_downstream(traces, trace_dir, exit_round) first")
        if int(traces["downstream_exit_round"]) != exit_round:
            raise ValueError(f"the attached downstream fields measure exit round "
                             f"{int(traces['downstream_exit_round'])}, not {exit_round}")
        flip = traces["downstream_first_flip"]
        window = spec.get("window")
        safe = (flip == 0) if window is None else ((flip == 0) | (flip > int(window)))
        lab = traces["downstream_own_ok"].bool() & safe
    else:
        raise ValueError(f"unknown label kind {kind!r}; known: {LABEL_KINDS}")
    return lab.float()


def feature_names(hidden_size: int, decision_round: int,
                  blocks: tuple[str, ...] = DEFAULT_ROUND0_BLOCKS) -> list[str]:
    if decision_round == 0:
        names = {"embed": [f"h0[{i}]" for i in range(hidden_size)],
                 "prev_stats": ["prev_top1_prob", "prev_margin", "prev_entropy"],
                 "prev_hidden": [f"prev_h[{i}]" for i in range(hidden_size)]}
        return [n for b in check_round0_blocks(blocks) for n in names[b]]
    return ([f"h{decision_round}[{i}]" for i in range(hidden_size)]
            + [f"g{r}" for r in range(1, decision_round + 1)]
            + [f"top1_prob{decision_round}", f"margin{decision_round}",
               f"entropy{decision_round}"])


def prob_stats(logits: torch.Tensor) -> torch.Tensor:
    """[T, 3] (top-1 prob, top-1 minus top-2 prob, entropy in nats) from logits [T, V], fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.exp()
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    second = top2[:, 1] if top2.shape[1] > 1 else torch.zeros_like(top2[:, 0])
    entropy = -(probs * logp).sum(-1)
    return torch.stack([top2[:, 0], top2[:, 0] - second, entropy], dim=-1)


def build_features(hidden: torch.Tensor, gate_logits: torch.Tensor,
                   stats: torch.Tensor) -> torch.Tensor:
    """[T, H + N + 3] fp32 from h_N [T, H], gate logits g_1..g_N [T, N], stats [T, 3]."""
    return torch.cat([hidden.float(), gate_logits.float(), stats.float()], dim=-1)


def trace_features(traces: Mapping[str, torch.Tensor], decision_round: int) -> torch.Tensor:
    """Features at round N from teacher-mode traces (needs full, unprojected h_r)."""
    n = decision_round - 1
    stats = torch.stack([traces["top1_prob"][:, n], traces["margin"][:, n],
                         traces["entropy"][:, n]], dim=-1)
    return build_features(traces["hidden"][:, n], traces["gate_logit"][:, :decision_round],
                          stats)


def check_round0_blocks(blocks) -> tuple[str, ...]:
    blocks = tuple(blocks)
    bad = [b for b in blocks if b not in ROUND0_BLOCKS]
    if bad or not blocks or len(set(blocks)) != len(blocks):
        raise ValueError(f"round-0 feature blocks must be distinct names out of "
                         f"{ROUND0_BLOCKS}, got {list(blocks)}")
    return blocks


def build_round0_features(embed: torch.Tensor, prev_stats: torch.Tensor,
                          prev_hidden: torch.Tensor | None,
                          blocks: tuple[str, ...] = DEFAULT_ROUND0_BLOCKS) -> torch.Tensor:
    """[T, F] fp32: the named blocks of embed [T, H], prev_stats [T, 3], prev_hidden [T, H]."""
    parts = {"embed": embed, "prev_stats": prev_stats, "prev_hidden": prev_hidden}
    return torch.cat([parts[b].float() for b in check_round0_blocks(blocks)], dim=-1)


def previous_rows(traces: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """int64 [T]: index of the traced position whose output is token t's input (same prompt,
    sample, output index - 1), or -1 if it is not in the traces (output index 1: the input
    came from the prefill) or its emitted token is unknown."""
    key = ((traces["prompt_id"].long() * 8192 + traces["sample_index"].long()) * 1_000_003
           + traces["output_index"].long())
    order = torch.argsort(key)
    want = key - 1
    pos = torch.searchsorted(key[order], want).clamp_max(len(key) - 1)
    found = key[order][pos] == want if len(key) else torch.zeros(0, dtype=torch.bool)
    prev = torch.where(found, order[pos], torch.full_like(pos, -1))
    valid = prev >= 0
    valid[valid.clone()] &= traces["token"][prev[valid]] >= 0
    return torch.where(valid, prev, torch.full_like(prev, -1))


def trace_round0_features(traces: Mapping[str, torch.Tensor], embed_weight: torch.Tensor,
                          blocks: tuple[str, ...] = DEFAULT_ROUND0_BLOCKS,
                          prefill: Mapping[str, torch.Tensor] | None = None,
                          prev_round: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T', F], keep bool [T]) at round 0 from teacher-mode traces: token t's input
    is the token emitted by the previous traced position, whose round-R distribution (the one
    it was sampled from in teacher mode) gives prev_stats and whose h_R is prev_hidden.
    `prefill` (exit_predictor.data.read_prefill_states: prompt_id, first_token, stats, hidden)
    supplies the previous state of output index 1 (sample 0, greedy first token). Other rows
    without a previous position are dropped (keep False). prev_round (default R): the round
    of the previous traced position whose state stands for the one it exited from (in
    generation a token that exited at 2 hands on its round-2 state; the prefill is always
    round R)."""
    prev = previous_rows(traces)
    R = traces["round_mask"].shape[1]
    r = R if prev_round is None else int(prev_round)
    if not 1 <= r <= R:
        raise ValueError(f"prev_round must lie in [1, {R}], got {prev_round}")
    hidden = traces["hidden"][:, r - 1].float()
    stats = torch.stack([traces["top1_prob"][:, r - 1], traces["margin"][:, r - 1],
                         traces["entropy"][:, r - 1]], dim=-1).float()
    token_in = traces["token"].long()
    first = torch.full_like(prev, -1)           # row of `prefill` for output index 1
    if prefill is not None:
        pid = prefill["prompt_id"].long()
        order = torch.argsort(pid)
        pos = torch.searchsorted(pid[order], traces["prompt_id"].long()).clamp_max(len(pid) - 1)
        found = (pid[order][pos] == traces["prompt_id"].long()) & \
            (traces["output_index"] == 1) & (traces["sample_index"] == 0) & (prev < 0)
        first = torch.where(found, order[pos], first)
    keep = (prev >= 0) | (first >= 0)
    p, f = prev[keep], first[keep]
    use_first = f >= 0
    src = torch.where(use_first, 0, p)
    tokens, prev_stats, prev_hidden = token_in[src], stats[src], hidden[src]
    if bool(use_first.any()):
        fr = f[use_first]
        tokens[use_first] = prefill["first_token"].long()[fr]
        prev_stats[use_first] = prefill["stats"].float()[fr]
        prev_hidden[use_first] = prefill["hidden"].float()[fr]
    x = build_round0_features(embed_weight.detach().float()[tokens], prev_stats, prev_hidden,
                              blocks)
    return x, keep


def oracle_rounds(traces: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """int64 [T]: the earliest round whose top-1 equals round R's (the oracle's depth)."""
    top1 = traces["top1_id"]
    agree = top1 == top1[:, -1:]
    R = top1.shape[1]
    first = torch.where(agree, torch.arange(1, R + 1).expand_as(agree),
                        torch.full_like(agree, R + 1, dtype=torch.long))
    return first.min(dim=1).values
