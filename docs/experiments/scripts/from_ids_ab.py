"""PrefillGraphs.run_from_ids against the general path it replaces, paired in one process
(twenty-seventh session: built and tested on the CPU, not yet timed on a GPU).

The claim's 32 x 32 workload (held-out prompts, greedy, c = 1): target only early, target only
compiled early, and the claimed tree config (chain K = 4 + lookup 10 by agreement, first drafts,
early launches, compiled, gemv_rows 64). Each repeat runs every config twice, once with
whole-prompt steps built from token ids (as shipped) and once through whole_prompt_inputs and
the bucket's scatters (run_from_ids patched to decline), the order rotating. Per config:
general over from-ids (median of per-repeat ratios, mean ± SE); per mode: the tree against the
fastest target-only row of the same repeat and mode, as bench.tree_spec's vs_faster.
Every run's tokens are checked against target only's.

    python docs/experiments/scripts/from_ids_ab.py --device cuda
    python docs/experiments/scripts/from_ids_ab.py --device cpu --prompts 4 --max-tokens 8 \
        --repeats 2 --prefill-graph-tokens 4096      # a dry run: graphs re-run eagerly
(on the CPU only the tree's engine, on the static path, has prefill graphs; steps_from_ids
counts each engine's steps built from ids, warm-up included). Last line: JSON.
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
from rltlab.engine.prefill_graphs import PrefillGraphs
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

SHIPPED = PrefillGraphs.run_from_ids
MODES = {"from ids": SHIPPED, "general": lambda *args, **kwargs: None}
TARGETS = ("target only early", "target only compiled early")


def paired(ratios: list[float]) -> dict:
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return {"median": round(statistics.median(ratios), 4),
            "mean": round(statistics.mean(ratios), 4), "se": round(se, 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="EngineConfig.prefill_graph_tokens (default: the engine's: on CUDA)")
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
    common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len,
                  launch_behind_prompt=True, prefill_graph_tokens=args.prefill_graph_tokens)
    engines = {TARGETS[0]: LLM(model, **common),
               TARGETS[1]: LLM(model, compile=True, **common),
               "tree": LLM(model, num_blocks=-(-max_len // 16) + private_blocks(proposer),
                           decode_path="static", gemv_rows=64, compile=True, **common)}
    engines["tree"].set_proposer(proposer)
    seconds = {(name, mode): [] for name in engines for mode in MODES}
    reference, identical = None, {key: 0 for key in seconds}
    runs = [(name, mode) for name in engines for mode in MODES]
    for name, mode in runs:                      # warm-up: compiles, captures (3 per bucket)
        PrefillGraphs.run_from_ids = MODES[mode]
        for _ in range(3):
            engines[name].generate(prompts, params)
    for repeat in range(args.repeats):
        for name, mode in runs[repeat % len(runs):] + runs[:repeat % len(runs)]:
            PrefillGraphs.run_from_ids = MODES[mode]
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[name, mode].append(time.perf_counter() - started)
            tokens = [o.outputs[0].token_ids for o in outs]
            reference = reference or tokens
            identical[name, mode] += tokens == reference
    PrefillGraphs.run_from_ids = SHIPPED
    from_ids = {name: engines[name].llm_engine.runner.prefill_graphs.stats.get("from ids", 0)
                if engines[name].llm_engine.runner.prefill_graphs else 0 for name in engines}
    result = {"device": args.device, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "steps_from_ids": from_ids,
              "identical_runs": {f"{n} ({m})": c for (n, m), c in identical.items()},
              "general_over_from_ids": {}, "tree_vs_fastest_target": {},
              "seconds": {f"{n} ({m})": s for (n, m), s in seconds.items()}}
    for name in engines:
        result["general_over_from_ids"][name] = paired(
            [g / f for g, f in zip(seconds[name, "general"], seconds[name, "from ids"])])
    for mode in MODES:
        fastest = map(min, *(seconds[t, mode] for t in TARGETS))
        result["tree_vs_fastest_target"][mode] = paired(
            [f / t for f, t in zip(fastest, seconds["tree", mode])])
    for key in ("steps_from_ids", "general_over_from_ids", "tree_vs_fastest_target"):
        print(key, json.dumps(result[key]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
