"""The engine's tree iteration at another model shape (random weights): GPU time of one
iteration per tree (CUDA events over graph replays, as tree_graph_timing.py) against the
engine's target-only decoding per token (wall time of 256 extra new tokens, ignore_eos, same
process). With random weights nothing is accepted, so the figure that matters is the cost
ratio; "implied" multiplies it by a tau measured elsewhere (a cost model, labelled as such).

    python docs/experiments/scripts/tree_shape_cost.py --preset ouro-1.4b --dtype bfloat16 \\
        --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \\
        --budgets 8 16 32 --tau 2.05 2.27 2.46 2.60
"""
import argparse
import json
import time

import torch

from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import TreeShape, private_blocks
from tree_graph_timing import _replay_ms, _sync   # this script's folder is on sys.path


def main():
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--trees-from", required=True)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--tau", type=float, nargs="+", default=[],
                    help="a tau per tree (chain first, then the budgets) for the implied figure")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--replays", type=int, default=100)
    args = ap.parse_args()
    args.dtype = args.dtype or "float32"
    model = build_model(args)
    found = json.load(open(args.trees_from))
    found = found.get("result", found)["trees"]
    trees = {"root only": [], "chain K=4": [tuple([0] * j) for j in range(1, 5)],
             **{f"tree B={b}": [tuple(p) for p in found[f"tree B={b}"]] for b in args.budgets}}
    prompt = prompts_for(1, args.prompt_len, model.config.vocab_size, 0)
    max_len = args.prompt_len + 260
    base = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len)
    seconds = {}
    for new in (1, 257, 1, 257):           # the second pair is timed
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                exit_policy="fixed")
        _sync(args.device)
        started = time.perf_counter()
        base.generate(prompt, params)
        _sync(args.device)
        seconds[new] = time.perf_counter() - started
    token_ms = 1e3 * (seconds[257] - seconds[1]) / 256
    heads = LookaheadHeads(model, depth=4).to(device=args.device,
                                              dtype=getattr(torch, args.dtype)).eval()
    private = sum(private_blocks(t) for t in trees.values())
    llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
              num_blocks=-(-max_len // 16) + private, decode_path="static",
              spec_pipeline=1)   # replayed over and over: a following program moves on
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            exit_policy="fixed")
    rows = []
    for name, tree in trees.items():
        llm.set_proposer(TreeProposer(heads, tree))
        llm.generate(prompt, params)
        program = llm.llm_engine._spec._tree._programs[1, False, True, False]
        ms = _replay_ms(program, args.replays)
        rows.append({"tree": name, "nodes": len(tree), "rows": TreeShape(tree, "cpu").num_rows,
                     "ms_per_iteration": ms, "iteration_in_tokens": ms / token_ms})
        print(json.dumps(rows[-1]), flush=True)
    for row, tau in zip(rows[1:], args.tau):
        row["tau_used"] = tau
        row["implied_speedup_cost_model"] = tau / row["iteration_in_tokens"]
    result = {"preset": args.preset, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "target_only_ms_per_token": token_ms, "rows": rows}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
