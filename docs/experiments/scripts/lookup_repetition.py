"""How much the embedded model's greedy continuations repeat themselves, and what that gives a
prompt-lookup chain (rltlab.engine.prompt_lookup) beside the lookahead heads' chain, offline on
the CPU: the bench's held-out prompts (rltlab.bench.tree_spec: half arithmetic, half text),
greedy full-depth rollouts (eos 0 stops), then per kind

  - lookup_next_token: how often the lookup's first draft is the next token;
  - looping: rollouts whose last 32 tokens repeat with a period of at most 16;
  - tau (tokens per iteration) of the acceptance rule replayed on the rollouts: heads chain
    K = 4 alone, the lookup chain alone, and both (an iteration accepts the longer), as
    rltlab.engine.tree_graph accepts them (its first iteration verifies the lookup only);
    "... adaptive" verifies the lookup chain only in the first iteration and after one whose
    lookup drafts began with the token it emitted first (TreeProposer(adaptive_lookup=True)),
    and counts the iterations that do (lookup_iterations).

    python docs/experiments/scripts/lookup_repetition.py --prompts 16 --max-tokens 128
Last line: JSON.
"""
import argparse
import json

import torch

from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompt_kinds, eval_prompts
from rltlab.draft_heads.lookahead_train import capture_rollouts
from rltlab.engine.prompt_lookup import prompt_lookup_ref
from rltlab.model.checkpoint import load_model


def _accepted(drafts, truth) -> int:
    return next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t),
                min(len(drafts), len(truth)))


def _tau(prompt, tokens, head_drafts, lookup: int, use_heads: bool, adaptive: bool = False
         ) -> tuple[int, int, int]:
    """(tokens, iterations, iterations verifying the lookup) of one rollout: the pending
    token tokens[i] verifies the heads' drafts made at i (not in the first iteration) and the
    lookup's from prompt + tokens[:i+1] (adaptive: only after a hit)."""
    i, iterations, with_lookup, hit = 0, 0, 0, True
    while i < len(tokens):
        truth = tokens[i + 1:]
        n = _accepted(head_drafts[i], truth) if use_heads and iterations else 0
        drafts = prompt_lookup_ref(prompt + tokens[:i + 1], lookup, 3) if lookup else []
        if lookup and (hit or not adaptive or not iterations):
            n, with_lookup = max(n, _accepted(drafts, truth)), with_lookup + 1
        hit = bool(drafts) and drafts[:1] == truth[:1]
        i, iterations = i + n + 1, iterations + 1
    return len(tokens), iterations, with_lookup


def _period(tail: list[int], longest: int) -> int | None:
    return next((p for p in range(1, longest + 1)
                 if all(tail[j] == tail[j - p] for j in range(p, len(tail)))), None)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, nargs="+", default=[8, 16])
    # e.g. --prompts 32 --max-tokens 32 --lookup 8 10 for the 32 x 32 bench
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok, md = load_model(None, dtype="float32", device="cpu")
    model.eval()
    heads, _, _ = lookahead.load(HEADS, model)
    prompts, kinds = eval_prompts(tok, md, args.prompts), eval_prompt_kinds(args.prompts)
    rollouts = capture_rollouts(model, prompts, args.max_tokens, 64, eos=0)
    configs = ["heads chain K=4"] + [f"{w}lookup{n}{a}" for n in args.lookup
                                     for w, a in (("", ""), ("heads chain K=4 + ", ""),
                                                  ("heads chain K=4 + ", " adaptive"))]
    stats = {kind: {"rollouts": 0, "tokens": 0, "lookup_next_token": 0, "looping": 0,
                    **{c: [0, 0, 0] for c in configs}} for kind in sorted(set(kinds))}
    for prompt, (y, h), kind in zip(prompts, rollouts, kinds):
        tokens, s = y.tolist(), stats[kind]
        with torch.no_grad():
            head_drafts = heads(h, y).argmax(-1).tolist()       # [L, 4]: drafts of y[i+1..]
        s["rollouts"] += 1
        s["tokens"] += len(tokens)
        s["lookup_next_token"] += sum(prompt_lookup_ref(prompt + tokens[:i], 1, 3)[0] == t
                                      for i, t in enumerate(tokens) if i)
        s["looping"] += len(tokens) >= 32 and _period(tokens[-32:], 16) is not None
        for c in configs:
            n = int(c.split("lookup")[1].split()[0]) if "lookup" in c else 0
            got = _tau(prompt, tokens, head_drafts, n, c.startswith("heads"),
                       c.endswith("adaptive"))
            s[c] = [a + b for a, b in zip(s[c], got)]
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "by_kind": {
        kind: {"rollouts": s["rollouts"], "tokens": s["tokens"],
               "lookup_next_token": round(s["lookup_next_token"]
                                          / max(s["tokens"] - s["rollouts"], 1), 3),
               "looping_rollouts": s["looping"],
               "tau": {c: round(s[c][0] / s[c][1], 3) for c in configs},
               "lookup_iterations": {c: f"{s[c][2]}/{s[c][1]}" for c in configs if "lookup" in c}}
        for kind, s in stats.items()}}
    for kind, r in result["by_kind"].items():
        print(kind, r)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
