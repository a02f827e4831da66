"""The tree program's compiled glue with inductor's combo kernels (horizontal fusion of
independent small kernels, torch._inductor.config.combo_kernels) against the glue as the
engine compiles it, paired in one process: chain K = 4 + a lookup chain of --lookup (adaptive
with --adaptive-lookup), gemv_rows 64, glue compiled, the held-out prompts at c = 1, greedy,
with target-only decoding (uncompiled and compiled) as the baselines. Per repeat the engines
run interleaved (the order rotating); ratios are medians of per-repeat time ratios, with mean
± SE. The combo engine's glue is compiled while torch.compile is wrapped to pass
options={"combo_kernels": True}; nothing else is compiled then.

    python docs/experiments/scripts/glue_combo_ab.py --device cuda --lookup 10 \\
        --adaptive-lookup --repeats 11
Last line: JSON.
"""
import argparse
import functools
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


def _timed(llm, prompts, params, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=10)
    ap.add_argument("--adaptive-lookup", action="store_true")
    ap.add_argument("--repeats", type=int, default=11)
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
    compile_ = torch.compile
    for name in ("tree", "tree, combo glue"):
        proposer = TreeProposer(heads, chain, lookup=args.lookup,
                                adaptive_lookup=args.adaptive_lookup)
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private_blocks(proposer),
                  decode_path="static", gemv_rows=64, compile=cuda)
        llm.set_proposer(proposer)
        engines[name] = llm
    for name, llm in engines.items():        # warm-up: graph captures, compiles
        if name == "tree, combo glue":
            torch.compile = functools.partial(compile_, options={"combo_kernels": True})
        try:
            llm.generate(prompts, params)
        finally:
            torch.compile = compile_
    seconds, tokens = {n: [] for n in engines}, {}
    names = list(engines)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            took, tokens[name] = _timed(engines[name], prompts, params, cuda)
            seconds[name].append(took)
    base = tokens["target only"]
    result = {"prompts": args.prompts, "max_tokens": args.max_tokens, "lookup": args.lookup,
              "adaptive_lookup": args.adaptive_lookup, "repeats": args.repeats,
              "seconds": seconds,
              "identical": {n: f"{sum(a == b for a, b in zip(tokens[n], base))}/{len(base)}"
                            for n in engines},
              "vs_target_only": {n: _paired(seconds["target only"], seconds[n])
                                 for n in engines},
              "combo_over_default": _paired(seconds["tree"], seconds["tree, combo glue"])}
    for name in engines:
        print(f"{name:>22}: {result['vs_target_only'][name]} identical {result['identical'][name]}")
    print("combo glue over default glue:", result["combo_over_default"])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
