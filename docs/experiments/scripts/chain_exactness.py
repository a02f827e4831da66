"""Issue 17: window chaining (EngineConfig.window_chain) changes when windows are read back,
never what the rows compute. The embedded model (fp32; Triton kernels and CUDA graphs on a GPU),
a closed loop of 32 requests at 8 rows (prompts of 8-300 tokens, chunk 96, greedy and sampled
rows, logprobs=0): replayed depths 1-4 (round windows) and one fixed depth per request batch
(token windows), chained (the default) and unchained (window_chain=1), against round steps with
gather prefill. The "-greedy" kinds make every row greedy without log-probs, so windows sample
through runner.greedy (kernels/greedy.py on a GPU) while round steps keep the general sampler.
On a GPU the windowed engines also replay small whole-prompt prefill steps as bucketed CUDA
graphs (EngineConfig.prefill_graph_tokens, on there by default): their eager / replayed steps
are printed.
Prints identical rollouts and the largest log-prob difference per comparison. Last line: JSON.

    python docs/experiments/scripts/chain_exactness.py [--device cuda] [--kinds trace-greedy,...]
"""
import json
import random
import sys

import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer


def requests(kind: str, rng: random.Random):
    greedy = kind.endswith("-greedy")
    prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))]
               for _ in range(32)]
    params = []
    for i in range(32):
        policy = dict(exit_policy="trace", exit_policy_args={
            "depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]}) \
            if kind.startswith("trace") \
            else dict(exit_policy="fixed", exit_policy_args={"depth": 3})
        params.append(SamplingParams(temperature=0.0 if greedy else (0.0, 1.0)[i % 2], seed=i,
                                     ignore_eos=True, max_tokens=rng.randrange(16, 40),
                                     logprobs=None if greedy else 0, **policy))
    return prompts, params


def agreement(outs, reference) -> dict:
    """Completions against the reference's, in order: how many have identical tokens and exit
    depths, and the largest |log-prob difference| among those with identical tokens."""
    pairs = list(zip(outs, reference))
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
    diff = max((abs(x - y) for a, b in pairs if a.token_ids == b.token_ids and a.logprobs
                for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    return {"identical": f"{same}/{len(pairs)}", "max_abs_logprob_diff": float(f"{diff:.3g}")}


KINDS = ("trace", "fixed", "trace-greedy", "fixed-greedy")


def main(device: str, kinds=KINDS) -> dict:
    model, _ = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    results = {}
    for kind in kinds:
        prompts, params = requests(kind, random.Random(0 if kind.startswith("trace") else 1))
        outs, stats, prefill = {}, {}, {}
        for name, kw in (("rounds", dict(fused_tokens=False, fused_prefill=False)),
                         ("chained", {}), ("unchained", dict(window_chain=1))):
            llm = LLM(model, device=device, dtype=torch.float32, decode_path="static",
                      max_num_seqs=8, prefill_chunk=96, max_num_batched_tokens=512, **kw)
            outs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
            window = llm.llm_engine._round_window if kind.startswith("trace") else \
                llm.llm_engine._token_window
            stats[name] = dict(window.stats) if window is not None else None
            graphs = llm.llm_engine.runner.prefill_graphs   # on by default on a GPU
            prefill[name] = dict(graphs.stats) if graphs is not None else None
        for other in ("chained", "unchained"):
            got = results[f"{kind} {other} vs rounds"] = agreement(outs[other], outs["rounds"])
            print(f"{device} fp32 {kind}: {other} vs round steps + gather prefill: identical "
                  f"{got['identical']}, max |logprob diff| {got['max_abs_logprob_diff']:.2e}",
                  flush=True)
        results[f"{kind} window stats"] = {k: v for k, v in stats.items() if v is not None}
        print(kind, "window stats", json.dumps(results[f"{kind} window stats"]), flush=True)
        results[f"{kind} prefill graph steps"] = prefill
        print(kind, "prefill graph steps", json.dumps(prefill), flush=True)
    return results


if __name__ == "__main__":
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    kinds = sys.argv[sys.argv.index("--kinds") + 1].split(",") if "--kinds" in sys.argv else KINDS
    if set(kinds) - set(KINDS):
        sys.exit(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; choose from {KINDS}")
    print(json.dumps(main(device, kinds)))
