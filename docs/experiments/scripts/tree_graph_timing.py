"""GPU time of one tree iteration inside the engine (rltlab.engine.tree_graph), by CUDA events
over replays of its captured graph (a replay reads only staged inputs, so it can be repeated),
for each tree, chain length and EngineConfig.gemv_rows (--gemv-rows: 1 = multi-row rounds
through cuBLAS, G > 1 = trees of up to G rows through the Triton GEMV path); and the same
engine's target-only decoding per token (wall time of LLM.generate over the tokens it
produced, host included), in the same process.

    python docs/experiments/scripts/tree_graph_timing.py --trees-from \\
        docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json --budgets 8 32
"""
import argparse
import itertools
import json
import time

import torch

from rltlab.bench.tree_spec import HEADS, _trees
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import TreeShape, private_blocks
from rltlab.model.checkpoint import load_model


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _replay_ms(program, replays: int) -> float:
    """ms per replay of the program's graph (CUDA events), or per eager run elsewhere."""
    if program._graph is None:
        started = time.perf_counter()
        for _ in range(replays):
            program._program()
        return 1e3 * (time.perf_counter() - started) / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        program._graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees-from", default=None)
    ap.add_argument("--budgets", type=int, nargs="*", default=[])
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, artifact_tree, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, 8)
    max_len = max(map(len, prompts)) + 33
    params = SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed")
    trees = _trees(args, artifact_tree)
    base = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len)
    base.generate(prompts, params)
    _sync(args.device)
    started = time.perf_counter()
    outs = base.generate(prompts, params)
    _sync(args.device)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"target_only_ms_per_token": 1e3 * (time.perf_counter() - started) / tokens,
              "rows": []}
    private = sum(private_blocks(t) for t in trees.values())
    for chain, gemv in itertools.product(args.chains, args.gemv_rows):
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  spec_chain=chain, num_blocks=-(-max_len // 16) + private,
                  decode_path="static", gemv_rows=gemv,
                  spec_pipeline=1)   # replayed over and over: a following program moves on
        for name, tree in trees.items():
            llm.set_proposer(TreeProposer(heads, tree))
            llm.generate(prompts[:2], params)
            program = llm.llm_engine._spec._tree._programs[chain, False, True, False]
            ms = _replay_ms(program, args.replays) / chain
            shape = TreeShape(tree, "cpu")
            row = {"tree": name, "chain": chain, "gemv_rows": gemv, "nodes": len(tree),
                   "rows": shape.num_rows, "ms_per_iteration": ms}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
