"""Which proposer to measure next on the H200: tau and verified rows per program of tree
proposers with the shipped lookahead heads, on the CPU. Greedy tokens, and so tau, do not depend
on the device's speed (the engine's outputs are the target's own greedy tokens on either); the
GPU cost of a program grows with its rows (5 rows: 0.305 ms of R rounds, 16 rows: 0.471 ms,
docs/benchmarks/2026-12-04-s20-h200.md, call 5), so tau alone does not rank them.

    python docs/experiments/scripts/tau_screen.py --prompts 32 --max-tokens 32 --lookup 10
Last line: JSON.
"""
import argparse
import json

import torch

from rltlab.bench.tree_spec import HEADS, tau_by_kind
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompt_kinds, eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok, md = load_model(None, dtype="float32", device="cpu")
    heads, artifact_tree, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    kinds = eval_prompt_kinds(args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    chain = [tuple([0] * j) for j in range(1, 5)]
    trees = {"chain K=4": chain, f"artifact tree B={len(artifact_tree)}": artifact_tree}
    proposers = {f"{name} +lookup{args.lookup}{' adaptive' * adaptive}{' first' * first}":
                 TreeProposer(heads, tree, lookup=args.lookup, adaptive_lookup=adaptive,
                              first_drafts=first)
                 for name, tree in trees.items() for adaptive in (False, True)
                 for first in (False, True)}
    target = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len)
    reference = [list(o.outputs[0].token_ids) for o in target.generate(prompts, params)]
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "lookup": args.lookup,
              "heads": HEADS, "configs": {}}
    for name, proposer in proposers.items():
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private_blocks(proposer), decode_path="static")
        llm.set_proposer(proposer)
        outs = llm.generate(prompts, params)
        stats = [o.spec_stats for o in outs]
        steps = sum(s["steps"] for s in stats)
        tau, by_kind = tau_by_kind([(s["steps"], s["emitted"]) for s in stats], kinds)
        row = {"tau": tau, "tau_by_kind": by_kind,
               "programs": steps,
               "rows_per_program": 1 + sum(s["drafted"] for s in stats) / steps,
               "identical": sum(list(o.outputs[0].token_ids) == r
                                for o, r in zip(outs, reference))}
        result["configs"][name] = row
        print(f"{name:>42}: tau {row['tau']:.2f} ({by_kind}) rows/program "
              f"{row['rows_per_program']:.1f} programs {steps} identical "
              f"{row['identical']}/{len(prompts)}", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
