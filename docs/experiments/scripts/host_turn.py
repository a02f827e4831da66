"""The host's turn between two requests at c = 1, timed on the CPU: from the read-back that
ends a request's decoding (its last tree program or token window) to the next request's
prompt step entering its rounds. On a GPU the device idles through this turn
(docs/benchmarks/2026-12-05-s27-h100.md: 286-406 us a request on H100 hosts). On the CPU the
rounds run synchronously, so the interval holds host work alone: finishing the request, the
engine's step boundary, scheduling the next and building its prompt step. The prompt steps
take the captured buckets' path (prefill_graph_tokens on: run_from_ids from a bucket's third
step), as on a GPU.

Engines: target only with token windows launched behind the prompt step, and the claimed tree
config (chain K = 4 + lookup 10 by agreement, first drafts, launch behind the prompt), each
on the held-out prompts, greedy, fixed depth R.

    python docs/experiments/scripts/host_turn.py [--prompts 32 --max-tokens 32 --repeats 3]

The last line is a JSON object: per engine, the median turn (us) over every request of every
repeat but the first (warm-up) and the tokens (identical across engines).
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
from rltlab.engine import fused_prefill, token_window, tree_program
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

LAST_READ: list[float] = []   # when the latest read-back returned
TURNS: list[float] = []       # seconds from a read-back to the next prompt's rounds


def _after(owner, name: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        finally:
            LAST_READ[:] = [time.perf_counter()]
    setattr(owner, name, wrapper)


def _before(owner, name: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if LAST_READ:
            TURNS.append(time.perf_counter() - LAST_READ.pop())
        return inner(*args, **kwargs)
    setattr(owner, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.repeats < 2:
        ap.error("--repeats must be >= 2 (the first is a warm-up)")
    torch.set_num_threads(1)
    _after(tree_program.TreeProgram, "read")
    _after(token_window, "read_back")
    _before(fused_prefill.FusedPrefill, "run_rounds")
    model, tok, md = load_model(None, dtype="float32", device="cpu")
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    proposer = TreeProposer(heads, [tuple([0] * j) for j in range(1, 5)], lookup=10,
                            adaptive_lookup="agree", first_drafts=True)
    common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len, decode_path="static",
                  launch_behind_prompt=True, prefill_graph_tokens=4096)
    target = LLM(model, **common)
    tree = LLM(model, num_blocks=-(-max_len // 16) + private_blocks(proposer), **common)
    tree.set_proposer(proposer)
    result = {}
    for name, llm in {"target only early": target, "tree claimed config": tree}.items():
        turns, tokens = [], None
        for repeat in range(args.repeats):
            LAST_READ.clear()
            TURNS.clear()
            outs = llm.generate(prompts, params)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if repeat:
                turns += TURNS
        result[name] = {"turn_us_median": 1e6 * statistics.median(turns),
                        "turns": len(turns), "tokens": tokens}
        print(f"{name}: {result[name]['turn_us_median']:.1f} us a request "
              f"({len(turns)} turns)", flush=True)
    same = result["target only early"]["tokens"] == result["tree claimed config"]["tokens"]
    print(json.dumps({"identical": same, **{name: {k: v for k, v in row.items() if k != "tokens"}
                                            for name, row in result.items()}}))


if __name__ == "__main__":
    main()
