"""Other lookup rules and a lookup-continued heads' chain, replayed on the CPU (twenty-fifth
session; no device): can chain K = 4 + lookup 10 with first drafts gain past the agree rule
without better heads?

Two families, each against the engine's agree rule (whose replay here must equal
rltlab.bench.tree_sim.replay's, checked below):
  - rules: the lookup chain's rows verified where a threshold rule on what the program knows
    holds: `agree` = how many of the next lookup drafts equal the heads' chain (0-4),
    `matched` = the lookup's n-gram match (0-3), the last iteration's lookup hits (drafts that
    began its emitted tokens), its heads' and lookup's accepted lengths;
  - continued chains: the heads' 4 drafts followed by `cont` prompt-lookup drafts over the
    history and those 4 (one chain of 5 + cont rows), with the agree rule's lookup chain beside
    it or alone.
Speed is tree_sim's CostModel (fitted to H200 calls; a model, not a measurement). Rules are
chosen on TRAINING-split prompts (--split train) and then read on the held-out ones.

    python docs/experiments/scripts/lookup_rule_screen.py --split train --prompts 512
    python docs/experiments/scripts/lookup_rule_screen.py --split eval --prompts 32
Last line: JSON.
"""
import argparse
import json

from rltlab.bench.tree_sim import CostModel, Iteration, recorded, replay, summary
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.engine import TreeProposer
from rltlab.engine.prompt_lookup import prompt_lookup_match
from rltlab.model.checkpoint import load_model

DEPTH, LOOKUP, NGRAM = 4, 10, 3
HEADS_ROWS, ALL_ROWS = DEPTH + 1, DEPTH + 1 + LOOKUP + 1


def _accepted(drafts, tokens, start, cap) -> int:
    m = 0
    while m < min(cap, len(drafts)) and drafts[m] == tokens[start + m]:
        m += 1
    return m


def run(rollout, max_tokens, rule=None, cont=0, lookup=True) -> list[Iteration]:
    """The iterations of chain K = 4 (+ cont lookup drafts after it) with first drafts, and the
    lookup chain's rows where rule(facts) holds (None: the agree rule as the engine has it)."""
    tokens, history = rollout.tokens, list(rollout.prompt)
    its, i, last = [], 0, None
    while i + 1 < rollout.end:
        history[len(rollout.prompt):] = tokens[:i + 1]
        left = max_tokens - (i + 1) - 1
        chain = list(rollout.top1[i][:DEPTH])
        chain += prompt_lookup_match(history + chain, cont, NGRAM)[0] if cont else []
        drafts, matched = prompt_lookup_match(history, LOOKUP, NGRAM)
        agree = _accepted(drafts, chain, 0, DEPTH)
        facts = {"agree": agree, "matched": matched, "last": last}
        use = lookup and (i == 0 or (rule or _agree_rule)(facts))
        n = _accepted(chain, tokens, i + 1, min(left, len(chain)))
        m = _accepted(drafts, tokens, i + 1, min(left, LOOKUP)) if use else 0
        emitted = tokens[i + 1: i + 2 + max(n, m)]
        last = {"n": n, "m": m, "hits": _accepted(drafts, emitted, 0, len(emitted))}
        its.append(Iteration(1 + len(chain) + (LOOKUP + 1) * use, 0, max(n, m) + 1, use))
        i += max(n, m) + 1
    return its


def _agree_rule(f) -> bool:
    return f["agree"] >= 1 or (f["last"]["hits"] > 0 and f["matched"] >= 2)


def rules() -> dict:
    def hit(f, h=1):
        return f["last"]["hits"] >= h
    out = {}
    for a in (1, 2, 3, 4):
        for mh in (1, 2, 3):
            out[f"agree >= {a} or hit and matched >= {mh}"] = \
                lambda f, a=a, mh=mh: f["agree"] >= a or hit(f) and f["matched"] >= mh
        out[f"agree >= {a}"] = lambda f, a=a: f["agree"] >= a
    for h in (2, 3, 5):
        out[f"agree >= 1 or hits >= {h} and matched >= 2"] = \
            lambda f, h=h: f["agree"] >= 1 or hit(f, h) and f["matched"] >= 2
    out["agree >= 1 and matched >= 2 or hit and matched >= 2"] = \
        lambda f: f["agree"] >= 1 and f["matched"] >= 2 or hit(f) and f["matched"] >= 2
    out["last lookup beat the heads"] = lambda f: f["last"]["m"] > f["last"]["n"]
    out["agree >= 1 or last lookup beat the heads"] = \
        lambda f: f["agree"] >= 1 or f["last"]["m"] > f["last"]["n"]
    out["agree >= 1 or hits > last n and matched >= 2"] = \
        lambda f: f["agree"] >= 1 or f["last"]["hits"] > f["last"]["n"] and f["matched"] >= 2
    out["matched >= 2"] = lambda f: f["matched"] >= 2
    out["matched >= 3"] = lambda f: f["matched"] >= 3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", choices=["eval", "train"], default="train")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device="cpu")
    heads, _, _ = lookahead.load(HEADS, model)
    n = args.prompts
    if args.split == "eval":
        from rltlab.draft_heads.evaluate import eval_prompts
        prompts = eval_prompts(tok, md, n)
    else:
        from rltlab.draft_heads.rollout_data import training_prompts
        prompts = [p for p, _ in training_prompts(tok, n - n // 2, n // 2, 24, args.seed)]
    rolls = recorded(model, heads, prompts, args.max_tokens, model.config.eos_token_id)
    cost, mt = CostModel(), args.max_tokens

    def row(per_request):
        s = summary(per_request, rolls, cost)
        return {k: round(s[k], 4) for k in ("tau", "rows_per_program", "lookup_share",
                                            "model_ratio")}
    engine = TreeProposer(heads, [(0,) * j for j in range(1, DEPTH + 1)], lookup=LOOKUP,
                          adaptive_lookup="agree", first_drafts=True)
    reference = row([replay(r, engine, mt) for r in rolls])
    here = row([run(r, mt) for r in rolls])
    assert here == reference, (here, reference)   # this replay is the engine's rule
    oracle = TreeProposer(heads, engine.tree, lookup=LOOKUP, adaptive_lookup="hits",
                          first_drafts=True)
    result = {"split": args.split, "prompts": len(rolls), "max_tokens": mt, "heads": HEADS,
              "seed": args.seed if args.split == "train" else None,
              "cost_model": cost.__dict__, "agree rule (engine)": reference,
              "oracle (bound)": row([replay(r, oracle, mt, rule="oracle") for r in rolls]),
              "rules": {}, "continued chains": {}}
    for name, rule in rules().items():
        result["rules"][name] = row([run(r, mt, rule) for r in rolls])
    for lookup in (True, False):
        for cont in (1, 2, 3, 5, 7):
            name = f"chain + {cont} lookup drafts" + (", agree rule's lookup chain" * lookup)
            result["continued chains"][name] = row([run(r, mt, cont=cont, lookup=lookup)
                                                    for r in rolls])
    base = reference["model_ratio"]
    for family in ("rules", "continued chains"):
        for name, r in sorted(result[family].items(), key=lambda kv: -kv[1]["model_ratio"]):
            print(f"{name:>58}: tau {r['tau']:.3f}, {r['rows_per_program']:5.2f} rows, cost "
                  f"model {r['model_ratio']:.4f} ({r['model_ratio'] / base - 1:+.2%})")
    print(f"agree rule {base:.4f}, oracle {result['oracle (bound)']['model_ratio']:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
