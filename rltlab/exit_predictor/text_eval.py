"""Teacher-forced held-out text loss of exit policies (the text part of
rltlab.exit_predictor.evaluate): every policy as an exit_fn of OuroForCausalLM.forward, with
LAST_EXITED in the forward."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def _lookahead_exit_fn(policy, R: int, threshold: float):
    """exit_fn (OuroForCausalLM.forward) for a LookaheadExitPolicy at `threshold`."""
    state: dict[str, torch.Tensor] = {}

    def exit_fn(r, gate_logits, hidden):
        n = policy.decision_round
        if r == n:
            b, t, h = hidden.shape
            p = policy.score(hidden.reshape(-1, h), gate_logits.reshape(b * t, -1)[:, :n])
            state["fire"] = (p >= threshold).reshape(b, t).to(hidden.device)
        if r == min(policy.exit_round, R) and "fire" in state:
            return state["fire"]
        return torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return exit_fn


def _rule_exit_fn(kind: str, eps: float, weight: torch.Tensor | None = None):
    state: dict[str, torch.Tensor] = {}

    def exit_fn(r, _gate_logits, hidden):
        h = hidden.float()
        cur = h if kind == "hidden_delta" else torch.log_softmax(h @ weight.float().T, -1)
        old = state.get("prev")
        state["prev"] = cur
        if old is None or r < 2:
            return torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        if kind == "hidden_delta":
            dist = (cur - old).norm(dim=-1) / old.norm(dim=-1).clamp_min(1e-12)
        else:
            dist = (cur.exp() * (cur - old)).sum(-1)
        return dist <= eps
    return exit_fn


@torch.no_grad()
def text_table(model, rows: torch.Tensor, lookahead: dict[str, Any], settings: Sequence[dict]
               ) -> list[dict[str, Any]]:
    """Teacher-forced held-out text loss (nats/token) per setting (LAST_EXITED in the forward;
    the oracle uses the full-depth forward's earliest round agreeing with round R)."""
    from rltlab.eval.tasks import text_perplexity
    from rltlab.model.generate import make_exit_fn

    R = model.config.num_rounds
    out = []
    per = text_perplexity(model, rows, per_round=True)
    for r in per["rounds"]:
        out.append({"policy": "fixed", "setting": f"depth={r['round']}",
                    "mean_rounds": float(r["round"]), "loss": r["loss"], "ppl": r["ppl"]})
    for s in settings:
        fn = None
        if s["policy"] == "q_exit":
            fn = make_exit_fn(R, threshold=s["threshold"], min_loops=1)
        elif s["policy"] in ("hidden_delta", "successive_kl"):
            fn = _rule_exit_fn(s["policy"], s["args"]["eps"], model.lm_head.weight)
        elif s["policy"] in lookahead and lookahead[s["policy"]]["policy"].decision_round == 0:
            continue    # round-0 features need the generated context: generation only
        elif s["policy"] in lookahead:
            fn = _lookahead_exit_fn(lookahead[s["policy"]]["policy"], R, s["args"]["threshold"])
        elif s["policy"] == "oracle":
            device = next(model.parameters()).device
            tops = []
            for lo in range(0, len(rows), 16):    # batches: [B, T, V] logits per round
                full = model(rows[lo:lo + 16].to(device), all_logits=True)
                tops.append(torch.stack([lg.argmax(-1) for lg in full.logits], -1).cpu())
                del full
            top = torch.cat(tops)
            ex = torch.where(top == top[..., -1:], torch.arange(1, R + 1), R + 1).min(-1).values
            res = text_perplexity(model, rows, exit_rounds=ex)
            out.append({"policy": "oracle", "setting": "oracle (teacher-forced)",
                        "mean_rounds": res["mean_rounds"], "loss": res["loss"],
                        "ppl": res["ppl"]})
            continue
        if fn is None:
            continue
        res = text_perplexity(model, rows, exit_fn=fn)
        out.append({"policy": s["policy"], "setting": s["setting"],
                    "mean_rounds": res["mean_rounds"], "loss": res["loss"], "ppl": res["ppl"]})
    return out
