"""The static decode path's attention off CUDA: the per-row reference
(kernels.paged_decode_attention_ref: one gather and two einsums per row) against the batched
torch path the engine now uses there (kernels.paged_decode_attention_torch), in the same run.

A W7-shaped closed loop on the tiny preset (64 requests, 32 in flight, 32-token prompts, 64
output tokens, replayed depths), static path, fp32, one CPU thread; the two attention functions
alternate, `--repeats` loops each, on fresh engines. Prints seconds per loop and the ratio.

    python docs/experiments/scripts/cpu_static_decode_attention.py

Last line: JSON.
"""
import argparse
import json
import statistics
import time

import torch

from rltlab import kernels
from rltlab.bench import engine_checks
from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, make_llm, workload_params


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(1)
    model = build_model(argparse.Namespace(model=None, preset="tiny", device="cpu",
                                           dtype="float32"))
    spec = dict(WORKLOADS["W7"], requests=64, concurrency=32, prompt_len=32, max_tokens=64)
    prompts = prompts_for(spec["requests"], spec["prompt_len"], model.config.vocab_size, seed=7)
    params = workload_params(spec, model.config.num_rounds, spec["requests"],
                             model.config.vocab_size)
    costs = ModelCosts.of(model)
    arms = {"per_row_ref": kernels.paged_decode_attention_ref,
            "batched": kernels.paged_decode_attention_torch}
    seconds = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, attention in arms.items():
            llm = make_llm(model, spec, "graph", 0.05)
            llm.llm_engine.runner.static._attention = attention
            start = time.perf_counter()
            engine_checks.closed_loop(llm, prompts, params, spec["concurrency"], costs)
            seconds[name].append(round(time.perf_counter() - start, 3))
    out = {"workload": "W7-shaped closed loop, tiny preset: 64 requests, c=32, 32/64 tokens",
           "device": "cpu", "threads": 1, "dtype": "float32", "seconds": seconds,
           "speedup": round(statistics.median(seconds["per_row_ref"])
                            / statistics.median(seconds["batched"]), 2)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
