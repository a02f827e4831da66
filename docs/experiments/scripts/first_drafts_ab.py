"""A request's first tree iteration with the heads' drafts from token 0's state (the engine
since 2026-12-04, TreeGraph._draft_first) against without them (the root and the lookup chain
only, as before: _draft_first switched off on a second engine), paired in one process, with
target-only decoding as the baseline of both: chain K = 4 (+ a lookup chain of --lookup),
gemv_rows 64, glue compiled, the held-out prompts at c = 1, greedy. Per repeat the three run
interleaved (the order rotating); ratios are medians of per-repeat time ratios, with mean ±
SE.

    python docs/experiments/scripts/first_drafts_ab.py --device cuda --lookup 8 --repeats 9
Last line: JSON.
"""
import argparse
import json
import statistics
import time

import torch

from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model


def _paired(num, den) -> dict:
    ratios = [a / b for a, b in zip(num, den)]
    return {"median": round(statistics.median(ratios), 4),
            "mean": round(statistics.mean(ratios), 4),
            "se": round(statistics.stdev(ratios) / len(ratios) ** 0.5, 4)
            if len(ratios) > 1 else 0.0}


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    chain = [tuple([0] * j) for j in range(1, 5)]
    engines = {"target only": LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len)}
    for name in ("first drafts", "no first drafts"):
        proposer = TreeProposer(heads, chain, lookup=args.lookup)
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private_blocks(proposer),
                  decode_path="static", gemv_rows=64, compile=args.device == "cuda")
        llm.set_proposer(proposer)
        if name == "no first drafts":
            llm.llm_engine._spec._tree._draft_first = lambda seq: False
        engines[name] = llm
    seconds, tokens, stats = {n: [] for n in engines}, {}, {}
    names = list(engines)
    for llm in engines.values():
        llm.generate(prompts, params)             # warm-up: graph captures, compiles
    for rep in range(args.repeats):
        for name in names[rep % 3:] + names[:rep % 3]:
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            spec = [o.spec_stats for o in outs if o.spec_stats]
            if spec:
                stats[name] = {"steps": sum(s["steps"] for s in spec),
                               "emitted": sum(s["emitted"] for s in spec)}
    base = tokens["target only"]
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "lookup": args.lookup,
              "repeats": args.repeats, "seconds": seconds,
              "identical": {n: f"{sum(a == b for a, b in zip(tokens[n], base))}/{len(base)}"
                            for n in names},
              "tau": {n: round(s["emitted"] / s["steps"], 3) for n, s in stats.items()},
              "speedup_vs_target": {n: _paired(seconds["target only"], seconds[n])
                                    for n in names[1:]},
              "first_drafts_vs_none": _paired(seconds["no first drafts"],
                                              seconds["first drafts"])}
    for key in ("identical", "tau", "speedup_vs_target", "first_drafts_vs_none"):
        print(key, result[key], flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
