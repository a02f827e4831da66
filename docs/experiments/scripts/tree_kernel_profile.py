"""Which kernels the GPU runs, and how long it idles, in target-only decoding and in the tree
path (rltlab.engine.tree_graph), on the s19 workload (held-out prompts, greedy, c = 1, fixed
depth 4): one torch.profiler pass over a warmed-up generate per config, kernels inside CUDA
graph replays included. Per config: kernels and their summed device time per generated token,
the GPU's busy time (the union of kernel intervals) against the span from the first kernel to
the last, and the costliest kernels (count, total, mean). "prompt steps only" is target only at
max_tokens = 1 (each request is its prompt step and token 0), so the decode phase's share of
the other rows is theirs minus that one's.

    python docs/experiments/scripts/tree_kernel_profile.py --device cuda --lookup 10 \\
        --adaptive-lookup [hits|agree] [--first-drafts] [--prompts 32 --max-tokens 32 --top 30]
Last line: JSON.
"""
import argparse
import json
import re

import torch

from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

CHAIN = [tuple([0] * j) for j in range(1, 5)]   # chain K = 4, as the bench's "chain K=4"


def _kernel_family(name: str) -> str:
    """A kernel's name without launch-specific suffixes (inductor's numbered kernels keep their
    fused op list, which is what tells them apart)."""
    name = re.sub(r"<.*", "", name)
    return name[:100]


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy


def profile(llm: LLM, prompts, params, top: int) -> dict:
    llm.generate(prompts, params)                # warm-up: graph captures, compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "Memcpy" not in e.name and "Memset" not in e.name]
    copies = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and ("Memcpy" in e.name or "Memset" in e.name)]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels + copies]
    families: dict = {}
    for e in kernels:
        f = families.setdefault(_kernel_family(e.name), [0, 0.0])
        f[0] += 1
        f[1] += e.time_range.end - e.time_range.start
    ranked = sorted(families.items(), key=lambda kv: -kv[1][1])[:top]
    kernel_us = sum(f[1] for f in families.values())
    span = max(hi for _, hi in spans) - min(lo for lo, _ in spans)
    return {"tokens": tokens, "kernels": len(kernels), "copies": len(copies),
            "kernels_per_token": len(kernels) / tokens, "kernel_us": kernel_us,
            "kernel_us_per_token": kernel_us / tokens, "busy_us": _busy_us(spans),
            "span_us": span, "busy_share": _busy_us(spans) / span,
            "top": [{"kernel": k, "count": c, "us": round(us, 1), "mean_us": round(us / c, 2)}
                    for k, (c, us) in ranked]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=10)
    ap.add_argument("--adaptive-lookup", nargs="?", const="hits", choices=["hits", "agree"],
                    help="TreeProposer(adaptive_lookup=RULE), 'hits' without RULE")
    ap.add_argument("--first-drafts", action="store_true",
                    help="TreeProposer(first_drafts=True)")
    ap.add_argument("--gemv-rows", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.device != "cuda":
        raise SystemExit("this profile reads CUDA kernels: --device cuda")
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    rule = args.adaptive_lookup if args.lookup > 0 else None
    proposer = TreeProposer(heads, CHAIN, lookup=args.lookup, adaptive_lookup=rule or False,
                            first_drafts=args.first_drafts)
    common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len)
    target = LLM(model, **common)
    tree = LLM(model, **common, num_blocks=-(-max_len // 16) + private_blocks(proposer),
               decode_path="static", gemv_rows=args.gemv_rows, compile=True)
    tree.set_proposer(proposer)
    configs = [("prompt steps only", target, SamplingParams(temperature=0.0, max_tokens=1,
                                                            exit_policy="fixed")),
               ("target only", target, params),
               ("target only compiled", LLM(model, **common, compile=True), params),
               (f"chain K=4 +lookup{args.lookup}{f' {rule}' if rule else ''}"
                f"{' first' * args.first_drafts}", tree, params)]
    result = {"args": vars(args)}
    for name, llm, p in configs:
        row = profile(llm, prompts, p, args.top)
        result[name] = row
        print(f"== {name}: {row['tokens']} tokens, {row['kernels_per_token']:.1f} kernels and "
              f"{row['kernel_us_per_token']:.1f} us of kernels a token, GPU busy "
              f"{row['busy_us'] / 1e3:.1f} of {row['span_us'] / 1e3:.1f} ms", flush=True)
        for t in row["top"]:
            print(f"  {t['count']:6d} {t['us']:10.1f} us {t['mean_us']:7.2f}  {t['kernel']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
