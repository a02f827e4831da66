"""Issue 17, W5: shared-prefix decode attention (EngineConfig.shared_prefix_attention,
kernels/shared_prefix.py) changes the order of the attention sums, never the rollouts. The
embedded model (fp32; Triton kernels and CUDA graphs on a GPU), one engine per setting, the same
requests through each: first 16 independent prompts (captures the graphs without groups), then
16 prompts x n = 8 (sampled, T = 1, seeded, log-probs) and 8 x n = 8 greedy, prompts of 40-300
tokens, stop-token ended. Prints identical completions, the largest log-prob difference and
how many decode steps / windows the shared engine planned groups for. Last line: JSON.

    python docs/experiments/scripts/shared_prefix_exactness.py [--device cuda]
"""
import argparse
import json
import random

import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer


def batches(rng: random.Random) -> list[tuple[list, list]]:
    def prompt():
        return [0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(40, 300))]
    solo = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, logprobs=0)
            for i in range(16)]
    sampled = [SamplingParams(n=8, temperature=1.0, seed=100 + i, max_tokens=64, logprobs=0,
                              stop_token_ids=[3, 7, 11]) for i in range(16)]
    greedy = [SamplingParams(n=8, temperature=0.0, max_tokens=64, stop_token_ids=[3, 7, 11])
              for _ in range(8)]
    return [([prompt() for _ in ps], ps) for ps in (solo, sampled, greedy)]


def completions(outs) -> list:
    return [c for o in outs for c in o.outputs]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    work = batches(random.Random(0))
    runs, planned = {}, []
    for shared in (False, True):
        llm = LLM(model, tokenizer=tokenizer, device=args.device, dtype=torch.float32,
                  decode_path="static", max_num_seqs=64, block_size=16,
                  kv_cache_memory_gib=2.0, shared_prefix_attention=shared)
        groups = llm.llm_engine.runner.static.groups if llm.llm_engine.runner.static else None
        if shared and groups is not None:
            plan = groups.plan
            groups.plan = lambda *a: planned.append(groups.count(made := plan(*a))) or made
        runs[shared] = [completions(llm.generate(prompts, params)) for prompts, params in work]
        del llm
    result = {"device": args.device, "batches": {}}
    for name, plain, grouped in zip(("independent", "groups T=1", "groups greedy"),
                                    runs[False], runs[True]):
        same = sum(a.token_ids == b.token_ids for a, b in zip(plain, grouped))
        diff = max((abs(x - y) for a, b in zip(plain, grouped)
                    if a.token_ids == b.token_ids and a.logprobs
                    for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
        result["batches"][name] = {"identical": f"{same}/{len(plain)}",
                                   "max_abs_logprob_diff": float(f"{diff:.3g}")}
        print(f"{name:14s} identical {same}/{len(plain)}, max |log-prob diff| {diff:.3g}")
    result["plans_with_groups"] = sum(g > 0 for g in planned)
    result["plans"] = len(planned)
    print(f"plans with groups: {result['plans_with_groups']} of {result['plans']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
