"""Screen (CPU replay, cost model; nothing here is a measurement): would a table of the target's
own n-gram continuations, built from its greedy rollouts on TRAINING-split prompts, draft the
lookup chain better than prompt lookup alone, where prompt lookup finds no long match?

The table maps each context of the last 4, 3 or 2 tokens seen in the rollouts (longest first)
to its most frequent next token, chained to the lookup's length. The lookup chain takes the
table's drafts where prompt lookup's match is shorter than `k` tokens (k = 0: never, the
shipped proposer) and the table knows the context. tree_sim.replay is run with that draft rule
in place of prompt_lookup_match (patched in this process only), for chain K = 4 + lookup with
first drafts: always, the hits and agree rules, and the oracle bound.

    python docs/experiments/scripts/rollout_table_screen.py --train-prompts 16384 --train-tokens 48

Last line: JSON.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

import rltlab.bench.tree_sim as tree_sim
from rltlab.engine.prompt_lookup import prompt_lookup_match

ORDERS = (4, 3, 2)


def build_table(rollouts: list[tuple[list[int], list[int]]]) -> dict[int, dict]:
    """order -> {context: most frequent next token}, over the contexts whose next token is one
    the model generated."""
    tables = {}
    for n in ORDERS:
        counts = collections.defaultdict(collections.Counter)
        for prompt, tokens in rollouts:
            seq = prompt + tokens
            for j in range(max(0, len(prompt) - n), len(seq) - n):
                counts[tuple(seq[j:j + n])][seq[j + n]] += 1
        tables[n] = {ctx: c.most_common(1)[0][0] for ctx, c in counts.items()}
    return tables


def table_drafts(tables, history: list[int], length: int) -> tuple[list[int], int]:
    """-> (drafts, the order of the context the first one came from; 0: the table knows none)."""
    seq, drafts, order = list(history), [], 0
    while len(drafts) < length:
        n = next((n for n in ORDERS if tuple(seq[-n:]) in tables[n]), 0)
        if not n:
            break
        order = order or n
        drafts.append(tables[n][tuple(seq[-n:])])
        seq.append(drafts[-1])
    return drafts + [seq[-1]] * (length - len(drafts)), order


def with_table(tables, k: int):
    def drafts(history, length, ngram):
        own, matched = prompt_lookup_match(history, length, ngram)
        if matched >= k:
            return own, matched
        table, order = table_drafts(tables, history, length)
        return (table, order) if order else (own, matched)
    return drafts


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-prompts", type=int, default=16384)
    ap.add_argument("--train-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    from rltlab.bench.tree_spec import HEADS
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.draft_heads.lookahead_train import capture_rollouts
    from rltlab.draft_heads.rollout_data import training_prompts
    from rltlab.engine import TreeProposer
    from rltlab.model.checkpoint import load_model
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    heads, _, _ = lookahead.load(HEADS, model)
    n = args.train_prompts
    prompts = [p for p, _ in training_prompts(tok, n - n // 2, n // 2, 24, args.seed)]
    rollouts = [(p, y.tolist()) for p, (y, _) in
                zip(prompts, capture_rollouts(model, prompts, args.train_tokens, 128, None))]
    tables = build_table(rollouts)
    result = {"train_prompts": n, "train_tokens": args.train_tokens, "seed": args.seed,
              "contexts": {n: len(t) for n, t in tables.items()}, "rows": {}}
    chain = [(0,) * j for j in range(1, heads.depth + 1)]
    for prompts_n, max_tokens, lookup, token_ms in ((32, 32, 10, 0.388), (16, 128, 16, 0.321),
                                                    (128, 32, 10, 0.388)):
        held = tree_sim.record(model, heads, eval_prompts(tok, model_dir, prompts_n), max_tokens,
                               model.config.eos_token_id)
        cost = tree_sim.CostModel(target_token=token_ms)
        for rule in (False, "hits", "agree"):
            proposer = TreeProposer(heads, chain, lookup=lookup, adaptive_lookup=rule,
                                    first_drafts=True)
            for k in (0, 1, 2, 3):
                tree_sim.prompt_lookup_match = with_table(tables, k) if k else \
                    prompt_lookup_match
                for bound in ((None, "oracle") if rule == "hits" else (None,)):
                    row = tree_sim.summary([tree_sim.replay(r, proposer, max_tokens, rule=bound)
                                            for r in held], held, cost)
                    name = (f"{prompts_n}x{max_tokens} lookup{lookup} "
                            f"{'oracle (bound)' if bound else rule or 'always'} table<{k}")
                    result["rows"][name] = row
                    print(f"{name:>44}: tau {row['tau']:.3f}, {row['rows_per_program']:4.1f} "
                          f"rows, cost model {row['model_ratio']:.3f}x", flush=True)
    tree_sim.prompt_lookup_match = prompt_lookup_match
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
