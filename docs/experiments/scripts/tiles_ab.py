"""The few-row FMA tiles by row count (kernels.small_batch.TILES["few_rows_fma", N, K, T]: rounds
of at most T rows, the heads-only tree program's 5 and the lead program's 16) against the
tiles before them, paired in one process: two tree engines (chain K = 4 + a lookup chain of
--lookup, adaptive with --adaptive-lookup, gemv_rows 64, glue compiled), one captured with the
entries of the tiers in --tiers removed (default: every tier), beside target-only
decoding (uncompiled and compiled), the held-out prompts at c = 1, greedy. Per repeat the
engines run interleaved (the order rotating); ratios are medians of per-repeat time ratios,
with mean ± SE (glue_combo_ab.py's pairing).

    python docs/experiments/scripts/tiles_ab.py --device cuda --lookup 10 --adaptive-lookup \\
        --repeats 15 [--tiers 16]
Last line: JSON.
"""
import argparse
import json

import torch

from glue_combo_ab import _paired, _timed
from rltlab import kernels
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=10)
    ap.add_argument("--adaptive-lookup", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tiers", type=int, nargs="+", default=list(kernels.small_batch.FMA_ROW_TIERS),
                    help="the row tiers whose entries the 'tiles before' engine goes without")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    chain = [tuple([0] * j) for j in range(1, 5)]
    engines = {name: LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                         compile=compiled)
               for name, compiled in (("target only", False), ("target only compiled", cuda))}
    for name in ("tree, tiles before", "tree"):
        proposer = TreeProposer(heads, chain, lookup=args.lookup,
                                adaptive_lookup=args.adaptive_lookup)
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private_blocks(proposer),
                  decode_path="static", gemv_rows=64, compile=cuda)
        llm.set_proposer(proposer)
        engines[name] = llm
    tiles = kernels.small_batch.TILES
    few = {key: tiles[key] for key in tiles if len(key) == 4 and key[3] in args.tiers}
    for name, llm in engines.items():        # warm-up: graph captures (with their tiles)
        if name == "tree, tiles before":
            for key in few:
                del tiles[key]
        try:
            llm.generate(prompts, params)
        finally:
            tiles.update(few)
    seconds, tokens = {n: [] for n in engines}, {}
    names = list(engines)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            took, tokens[name] = _timed(engines[name], prompts, params, cuda)
            seconds[name].append(took)
    base = tokens["target only"]
    faster = [min(a, b) for a, b in zip(seconds["target only"], seconds["target only compiled"])]
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "lookup": args.lookup,
              "tiers": args.tiers,
              "adaptive_lookup": args.adaptive_lookup, "repeats": args.repeats,
              "few_tiles": {str(k): v for k, v in few.items()}, "seconds": seconds,
              "identical": {n: f"{sum(a == b for a, b in zip(tokens[n], base))}/{len(base)}"
                            for n in engines},
              "vs_target_only": {n: _paired(seconds["target only"], seconds[n])
                                 for n in engines},
              "vs_faster_target_only": {n: _paired(faster, seconds[n]) for n in engines},
              "few_tiles_over_before": _paired(seconds["tree, tiles before"], seconds["tree"])}
    for name in engines:
        print(f"{name:>22}: {result['vs_target_only'][name]} vs faster "
              f"{result['vs_faster_target_only'][name]} identical {result['identical'][name]}")
    print("few-row tiles over the tiles before:", result["few_tiles_over_before"])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
