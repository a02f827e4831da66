"""Issue 17: the one-row round's fusion of RoPE + K/V write into the q/k/v GEMV's epilogue
(EngineConfig.fused_qkv_rope) changes how a round is launched, never what it computes. (Call 2
of 2026-12-02-s4 ran it at 391a6f1 with two more configurations, the split merge fused into the
decode attention on and off; that fusion was reverted as slower, see
docs/benchmarks/2026-12-02-s4-h200.md.)

The embedded model (fp32; on a GPU the static path's one-row rounds run the Triton GEMVs, split
decode attention and CUDA graphs), 12 requests one at a time (max_num_seqs=1; prompts of 8-300
tokens, greedy and sampled rows, logprobs=0): replayed depths 1-4 and a fixed depth, with the
fusion on and off, against the plain-torch gather path. Prints identical rollouts and the
largest log-prob difference per comparison. Last line: JSON.

    python docs/experiments/scripts/one_row_exactness.py [--device cuda]
"""
import json
import random
import sys

import torch

from chain_exactness import agreement   # this directory: the script's own (sys.path[0])
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer

CONFIGS = {
    "fused": {},   # the defaults: fused RoPE + K/V write, L2 prefetch of 4 MiB per kernel
    "unfused-rope": dict(fused_qkv_rope=False),
    # kernels/l2_prefetch.py: a hint to the memory system, so identical by construction;
    # this checks that adding it to three kernels' launches changed nothing else.
    "no-l2-prefetch": dict(l2_prefetch_mb=0),
    "l2-prefetch-8": dict(l2_prefetch_mb=8),
}


def requests(rng: random.Random):
    prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))]
               for _ in range(12)]
    params = []
    for i in range(12):
        policy = dict(exit_policy="trace", exit_policy_args={
            "depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]}) if i % 3 else \
            dict(exit_policy="fixed", exit_policy_args={"depth": 4})
        params.append(SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, ignore_eos=True,
                                     max_tokens=rng.randrange(16, 40), logprobs=0, **policy))
    return prompts, params


def main(device: str) -> dict:
    model, _ = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    prompts, params = requests(random.Random(0))
    reference = [o.outputs[0] for o in LLM(model, device=device, dtype=torch.float32,
                                           decode_path="gather", max_num_seqs=1
                                           ).generate(prompts, params)]
    results = {}
    for name, kw in CONFIGS.items():
        llm = LLM(model, device=device, dtype=torch.float32, decode_path="static",
                  max_num_seqs=1, **kw)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        got = results[f"{name} vs gather"] = agreement(outs, reference)
        print(f"{device} fp32 one row, {name} vs gather path: identical {got['identical']}, "
              f"max |logprob diff| {got['max_abs_logprob_diff']:.2e}", flush=True)
    return results


if __name__ == "__main__":
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    print(json.dumps(main(device)))
