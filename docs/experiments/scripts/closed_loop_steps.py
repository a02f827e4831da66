"""Issue 17: where a closed loop's time goes, by kind of engine step (H200, Ouro-1.4B shape,
bf16, random weights). Runs a workload's closed loop (rltlab.bench's harness: `concurrency`
requests in flight, a new one added as each finishes) with the device synchronised after every
engine step, and sums the wall time of each kind: round windows (round_window.py), whole-token
steps (token_step.py) and round-per-step steps, with their counts. Synchronising each step
removes what little host / device overlap there is, so totals run slightly above the bench's.
Usage: python closed_loop_steps.py W7 graph [graph-ragged ...]. Last line: JSON."""
import collections
import json
import sys
import time

import torch

from rltlab.bench.__main__ import bench_engine, build_model, prompts_for
from rltlab.bench.engine import MODES, WORKLOADS, workload_params
from rltlab.engine import LLM


class Args:
    model, preset, device, dtype = None, "ouro-1.4b", "cuda", "bfloat16"


def timed(stats, kind, fn):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        torch.cuda.synchronize()
        stats[kind + "_s"] += time.perf_counter() - start
        stats[kind] += 1
        return out
    return wrapper


def main(name: str, modes: list[str]) -> dict:
    model = build_model(Args)
    spec = WORKLOADS[name]
    c = spec["concurrency"]
    prompts = prompts_for(spec["requests"], spec["prompt_len"], model.config.vocab_size, 0)
    params = workload_params(spec, 4, spec["requests"], model.config.vocab_size)
    results = {}
    for mode in modes:
        llm = LLM(model, max_num_seqs=c, max_model_len=spec["prompt_len"] + spec["max_tokens"],
                  max_num_batched_tokens=max(16384, spec["prompt_len"] + c),
                  prefill_chunk=max(512, spec["prompt_len"]), kv_cache_memory_gib=110.0,
                  **MODES[mode])
        bench_engine(llm, prompts[:c], params[:c], c)   # captures outside the timing
        eng, stats = llm.llm_engine, collections.Counter()
        if eng._round_window is not None:
            eng._round_window.step = timed(stats, "window", eng._round_window.step)
        if eng._whole_tokens is not None:
            eng._whole_tokens.step = timed(stats, "token_step", eng._whole_tokens.step)
        eng.runner.execute = timed(stats, "round_step", eng.runner.execute)
        figures = bench_engine(llm, prompts, params, c)
        results[mode] = {"closed_loop": figures,
                         "steps": {k: round(v, 3) if isinstance(v, float) else v
                                   for k, v in sorted(stats.items())}}
        print(mode, json.dumps(results[mode]), flush=True)
        del llm, eng
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))
