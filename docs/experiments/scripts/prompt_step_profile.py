"""Where a whole-prompt step's time goes (rltlab.engine.prompt_step) at c = 1 on the embedded
model: the held-out prompts with max_tokens = 1 (each request is its prompt's step and token 0
only), host timers around the step's parts, CUDA-event timings of the rounds' graph replay,
and one torch.profiler pass (top host ops and kernels). Round-step prompts
(whole_prompt_steps=False) in the same process, as the baseline.

    python docs/experiments/scripts/prompt_step_profile.py --device cuda --prompts 32
Last line: JSON.
"""
import argparse
import json
import time

import torch

from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import (LLM, SamplingParams, llm_engine, model_runner, prefill_graphs,
                           prompt_step)
from rltlab.model.checkpoint import load_model
from tree_engine_profile import COUNTS, TIMES, timed   # this folder: the script's own path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    prompts = eval_prompts(tok, md, args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=1, exit_policy="fixed")
    timed(llm_engine.LLMEngine, "step", "engine step")
    timed(llm_engine.LLMEngine, "_sample", "sample token 0")
    timed(prompt_step.WholePrompts, "step", "whole prompt step")
    timed(model_runner.ModelRunner, "prepare", "runner prepare")
    timed(model_runner.ModelRunner, "run_prompts", "runner run_prompts")
    timed(model_runner.ModelRunner, "execute", "runner execute (round steps)")
    timed(prefill_graphs.PrefillGraphs, "_run", "prefill graphs run (staging + replay)")
    max_len = max(map(len, prompts)) + 2
    result = {"prompts": args.prompts, "prompt_tokens": sum(map(len, prompts))}
    for mode in ("whole", "rounds"):
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  whole_prompt_steps=mode == "whole")
        llm.generate(prompts, params)
        llm.generate(prompts, params)          # the second pass captures every bucket
        walls = []
        for _ in range(args.repeats):
            TIMES.clear()
            COUNTS.clear()
            sync(args.device)
            started = time.perf_counter()
            llm.generate(prompts, params)
            sync(args.device)
            walls.append(time.perf_counter() - started)
        row = {"wall_ms_median": 1e3 * sorted(walls)[len(walls) // 2],
               "ms_last_repeat": {k: round(1e3 * v, 3) for k, v in TIMES.items()},
               "calls": dict(COUNTS)}
        graphs = llm.llm_engine.runner.prefill_graphs
        if graphs is not None and args.device == "cuda":   # GPU time of each bucket's replay
            gpu = {}
            for key, bucket in graphs.buckets.items():
                if bucket.replay is None:
                    continue
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(20):
                    bucket.replay()
                end.record()
                end.synchronize()
                gpu[str(key)] = round(start.elapsed_time(end) / 20, 4)
            row["replay_gpu_ms_by_bucket"] = gpu
        if args.device == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params)
            table = prof.key_averages()
            print(table.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            print(table.table(sort_by="self_device_time_total", row_limit=15), flush=True)
            kernels = [e for e in table if e.device_type == torch.autograd.DeviceType.CUDA]
            row["kernels_per_prompt"] = sum(e.count for e in kernels) / args.prompts
            row["kernel_us_per_prompt"] = sum(e.self_device_time_total
                                              for e in kernels) / args.prompts
        result[mode] = row
        print(mode, json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
