"""Short whole-prompt steps as static decode rows (EngineConfig.prompt_rows, twenty-eighth
session) against the fused prefill's graphs they replace, paired in one process.

The claim's 32 x 32 workload (held-out prompts, greedy, c = 1): target only early and target
only compiled early, each with gemv_rows 1 and 64 (one-row decoding ignores it: only the
prompt rows differ), and the claimed tree config (chain K = 4 + lookup 10 by agreement, first
drafts, early launches, compiled, gemv_rows 64). Every config is built twice: "rows" (the
engine's prompt_rows: 64 on CUDA) and "prefill" (prompt_rows 0: the fused prefill, its graphs
and run_from_ids, as the twenty-seventh session shipped). Each repeat runs every engine once,
the order rotating. Per config: prefill over rows (median of per-repeat ratios, mean ± SE);
per mode: the tree against the fastest target-only row of the same repeat and mode, as
bench.tree_spec's vs_faster. Every run's tokens are checked against the first run's.

    python docs/experiments/scripts/prompt_rows_ab.py --device cuda
    python docs/experiments/scripts/prompt_rows_ab.py --device cpu --prompts 4 --max-tokens 8 \
        --repeats 2 --prompt-rows 64      # a dry run (no graphs off CUDA)
Last line: JSON.
"""
import argparse
import json
import time

import torch

from from_ids_ab import paired
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer, model_runner
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

TARGETS = ("target only early", "target only compiled early",
           "target only early gemv<=64", "target only compiled early gemv<=64")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--prompt-rows", type=int, default=None,
                    help="the rows mode's EngineConfig.prompt_rows (default: the engine's)")
    args = ap.parse_args()
    if args.prompts < 1 or args.repeats < 1:
        ap.error("--prompts and --repeats must be >= 1")
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    proposer = TreeProposer(heads, [(0,) * d for d in range(1, heads.depth + 1)], lookup=10,
                            adaptive_lookup="agree", first_drafts=True)
    modes = {"rows": args.prompt_rows, "prefill": 0}
    engines = {}
    for mode, rows in modes.items():
        common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len,
                      launch_behind_prompt=True, prompt_rows=rows)
        for gemv, suffix in ((1, ""), (64, " gemv<=64")):
            engines[f"target only early{suffix}", mode] = LLM(model, gemv_rows=gemv, **common)
            engines[f"target only compiled early{suffix}", mode] = LLM(
                model, gemv_rows=gemv, compile=True, **common)
        engines["tree", mode] = LLM(model, num_blocks=-(-max_len // 16) +
                                    private_blocks(proposer), decode_path="static",
                                    gemv_rows=64, compile=True, **common)
        engines["tree", mode].set_proposer(proposer)
    as_rows, run_prompt_rows = [], model_runner.run_prompt_rows

    def counted(*call):
        as_rows.append(1)
        return run_prompt_rows(*call)
    model_runner.run_prompt_rows = counted
    rows_steps = {}
    for key, llm in engines.items():              # warm-up: compiles, captures
        as_rows.clear()
        for _ in range(3):
            llm.generate(prompts, params)
        rows_steps[f"{key[0]} ({key[1]})"] = len(as_rows)
    seconds = {key: [] for key in engines}
    reference, identical, runs = None, {key: 0 for key in engines}, list(engines)
    for repeat in range(args.repeats):
        for key in runs[repeat % len(runs):] + runs[:repeat % len(runs)]:
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            outs = engines[key].generate(prompts, params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[key].append(time.perf_counter() - started)
            tokens = [o.outputs[0].token_ids for o in outs]
            reference = reference or tokens
            identical[key] += tokens == reference
    result = {"device": args.device, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "rows_steps_in_warmup": rows_steps,
              "identical_runs": {f"{n} ({m})": c for (n, m), c in identical.items()},
              "prefill_over_rows": {}, "tree_vs_fastest_target": {},
              "seconds": {f"{n} ({m})": s for (n, m), s in seconds.items()}}
    for name in dict.fromkeys(name for name, _ in engines):
        result["prefill_over_rows"][name] = paired(
            [p / r for p, r in zip(seconds[name, "prefill"], seconds[name, "rows"])])
    for mode in modes:
        fastest = map(min, *(seconds[t, mode] for t in TARGETS))
        result["tree_vs_fastest_target"][mode] = paired(
            [f / t for f, t in zip(fastest, seconds["tree", mode])])
    for key in ("rows_steps_in_warmup", "prefill_over_rows", "tree_vs_fastest_target"):
        print(key, json.dumps(result[key]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
