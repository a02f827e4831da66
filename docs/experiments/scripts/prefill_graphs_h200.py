"""Issue 17: small whole-prompt prefill steps with and without bucketed CUDA graphs
(rltlab.engine.prefill_graphs) on one engine (H200, Ouro-1.4B shape, bf16, random weights).

Per size n (prompts per step, 100-128 tokens each, drawn): waves of n prompts (max_tokens 1,
depth 4, greedy, log-probs), every engine step synchronised, the graphs switched off and on
wave by wave (`runner.prefill_graphs`), after an untimed wave of each (one-off costs, and the
bucket's first, eager step). Reported: ms per step of each arm (median) and their ratio, and
exactness: the first tokens and their log-probs with graphs against without, same prompts
(bf16: GEMMs over padded rows may round differently). `--arms eager padded graphs` adds eager
steps with the whole prompts' attention padded within length buckets
(EngineConfig.pad_prefill_attention: one launch per bucket and layer instead of one per
distinct length); every arm is compared with the first.

    python docs/experiments/scripts/prefill_graphs_h200.py --graph-tokens 4096
    python docs/experiments/scripts/prefill_graphs_h200.py --arms eager padded graphs \
        --sizes 1 4 16 32 64 128

Last line: JSON.
"""
import argparse
import json
import statistics

import torch

from prefill_step_cost_h200 import wave   # this directory: the script's own
from rltlab.bench.__main__ import add_model_arguments, build_model
from rltlab.bench.engine import WORKLOADS, make_llm, warm_up, workload_params
from rltlab.engine import SamplingParams
from rltlab.engine.prefill_graphs import PrefillGraphs


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graph-tokens", type=int, default=4096)
    ap.add_argument("--arms", nargs="+", default=["eager", "graphs"],
                    choices=["eager", "padded", "graphs"])
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    if args.graph_tokens < 1 or args.repeats < 1 or min(args.sizes) < 1:
        ap.error("--graph-tokens, --repeats and --sizes must be >= 1")
    if len(set(args.arms)) != len(args.arms):
        ap.error(f"--arms must differ, got {args.arms}")
    model = build_model(args)
    spec, cfg = WORKLOADS["W7"], model.config
    llm = make_llm(model, spec, "graph", kv_gib=110.0 if args.device == "cuda" else 1.0)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(1, cfg.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(100, 129, (4096,), generator=gen)]
    warm_up(llm, prompts, workload_params(spec, cfg.num_rounds, 128, cfg.vocab_size), 128)
    runner = llm.llm_engine.runner
    graphs = PrefillGraphs(runner.prefill, args.graph_tokens)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, exit_policy="fixed",
                        exit_policy_args={"depth": cfg.num_rounds})
    used, sizes = 128, {}
    first = args.arms[0]
    for n in args.sizes:
        ms, outs = {arm: [] for arm in args.arms}, {}
        for arm in args.arms * (args.repeats + 1):
            runner.prefill_graphs = graphs if arm == "graphs" else None
            runner.prefill.pad_lengths = arm == "padded"
            # the first arm draws new prompts, the others rerun them
            batch = prompts[used: used + n] if arm == first else prompts[used - n: used]
            used += n if arm == first else 0
            steps, got = wave(llm, batch, sp)
            if arm not in outs:   # the untimed first wave of each arm; the same prompts
                outs[arm] = got
            else:
                ms[arm] += [step["wall_ms"] for step in steps]
        base = statistics.median(ms[first])
        sizes[n] = {f"{first}_ms_per_step": round(base, 2)}
        for arm in args.arms[1:]:
            a, b = outs[first], outs[arm]
            sizes[n].update({
                f"{arm}_ms_per_step": round(statistics.median(ms[arm]), 2),
                f"{arm}_speedup": round(base / statistics.median(ms[arm]), 3),
                f"{arm}_same_first_token": sum(x.token_ids == y.token_ids for x, y in zip(a, b)),
                f"{arm}_max_abs_logprob_diff": round(max(abs(x.logprobs[0] - y.logprobs[0])
                                                         for x, y in zip(a, b)), 5)})
        print(n, sizes[n], flush=True)
    runner.prefill_graphs, runner.prefill.pad_lengths = None, False
    out = {"workload": "waves of n whole prompts (100-128 tokens), max_tokens 1, W7's engine",
           "device": args.device, "dtype": args.dtype, "graph_tokens": args.graph_tokens,
           "arms": args.arms,
           "buckets": sorted(graphs.buckets), "stats": graphs.stats, "sizes": sizes}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
