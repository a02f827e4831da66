"""Which chain, tree and lookup settings to time next: rltlab.bench.tree_sim replays (exact
tau and rows) and its cost model (not a measurement) on 512 TRAINING-split prompts x 32 tokens,
the held-out 32 x 32 and the held-out 16 x 128. Every proposer has first drafts.
  - trees: tree_from_ranks of the training split's ranks, budgets 4 (the chain K = 4) to 10,
    with lookup 10 by hits and by agreement;
  - the chain with lookup 6-16 and ngram 2-4, by hits and by agreement.

    python docs/experiments/scripts/tree_sim_sweep.py
Last line: JSON.
"""
import json

import torch

from rltlab.bench import tree_sim
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.draft_heads.lookahead import tree_from_ranks
from rltlab.draft_heads.rollout_data import training_prompts
from rltlab.engine import TreeProposer
from rltlab.model.checkpoint import load_model

SETS = {"train 512x32": 0.388, "eval 32x32": 0.388, "eval 16x128": 0.321}   # target_token


def main() -> dict:
    torch.set_num_threads(2)
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    heads, _, _ = lookahead.load(HEADS, model)
    eos = model.config.eos_token_id
    train = [p for p, _ in training_prompts(tok, 256, 256, 24, 7)]
    rollouts = {"train 512x32": tree_sim.record(model, heads, train, 32, eos),
                "eval 32x32": tree_sim.record(model, heads, eval_prompts(tok, model_dir, 32),
                                              32, eos),
                "eval 16x128": tree_sim.record(model, heads, eval_prompts(tok, model_dir, 16),
                                               128, eos)}
    ranks = [torch.tensor(r.ranks[:r.end]) for r in rollouts["train 512x32"]]
    proposers = {}
    for budget in range(4, 11):
        tree = tree_from_ranks(ranks, budget)
        for rule in ("hits", "agree"):
            proposers[f"tree B={budget} {rule}"] = (tree, 10, 3, rule)
    chain = [(0,) * j for j in range(1, 5)]
    for lookup in (6, 8, 10, 12, 16):
        for ngram in (2, 3, 4):
            for rule in ("hits", "agree"):
                proposers[f"chain lookup{lookup} ngram{ngram} {rule}"] = (chain, lookup, ngram,
                                                                         rule)
    out = {"heads": HEADS, "first_drafts": True, "cost_model": "rltlab.bench.tree_sim.CostModel",
           "trees": {f"B={b}": [list(p) for p in tree_from_ranks(ranks, b)]
                     for b in range(4, 11)}, "rows": {}}
    for name, (tree, lookup, ngram, rule) in proposers.items():
        proposer = TreeProposer(heads, tree, lookup=lookup, ngram=ngram, adaptive_lookup=rule,
                                first_drafts=True)
        row = {}
        for label, rolls in rollouts.items():
            max_tokens = 128 if label.endswith("128") else 32
            cost = tree_sim.CostModel(target_token=SETS[label])
            s = tree_sim.summary([tree_sim.replay(r, proposer, max_tokens) for r in rolls],
                                 rolls, cost)
            row[label] = {k: round(s[k], 4) for k in ("tau", "rows_per_program", "model_ratio")}
        out["rows"][name] = row
        print(f"{name:>28}: " + "; ".join(f"{label} tau {v['tau']:.2f} rows "
                                          f"{v['rows_per_program']:.1f} model "
                                          f"{v['model_ratio']:.3f}" for label, v in row.items()),
              flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
