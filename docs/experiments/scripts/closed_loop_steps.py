"""Issue 17: where a closed loop's time goes, by kind of engine step (H200, Ouro-1.4B shape,
bf16, random weights). Runs a workload's closed loop (rltlab.bench's harness: `concurrency`
requests in flight, a new one added as each finishes) with the device synchronised after every
engine step, and records each step: its kind, wall time, decode rows and prefill tokens.

Kinds: `window` (round windows, round_window.py), `tokens` (whole-token steps and token windows,
token_step.py / token_window.py), `prefill` (a round step of prefill rows only), `mixed` (a
round step of decode rows beside prefill rows), `decode` (a round step of decode rows only).
Per mode: the sum per kind, the decode rows' mean occupancy over time, and the timeline. Steps
synchronised one by one lose what little host / device overlap there is, so totals run slightly
above the bench's.

    python closed_loop_steps.py W4 graph graph-mixed-prefill [--passes N] [--out FILE]

--passes N times N closed loops on each engine: a slow step in the first pass only is a one-off
cost (a capture, a Triton specialisation compiled) rather than the steady state.

A mode may add engine options: `graph+round_window_admit=16`. Last line: JSON.
"""
import argparse
import collections
import gc
import json
import time

import torch

from rltlab.bench.__main__ import bench_engine, build_model, prompts_for
from rltlab.bench.engine import MODES, WORKLOADS, workload_params
from rltlab.engine import LLM


class Args:
    model, preset, device, dtype = None, "ouro-1.4b", "cuda", "bfloat16"


def engine_options(mode: str) -> dict:
    """`name+key=value+...` -> MODES[name] with the extra options (ints where they parse)."""
    name, *extra = mode.split("+")
    options = dict(MODES[name])
    for item in extra:
        key, value = item.split("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options


def record_steps(engine, timeline: list, origin: list[float]) -> None:
    """Wrap the engine's step kinds so each appends (end s after origin[0], kind, decode rows,
    prefill tokens, wall s) to timeline, the device synchronised."""
    def timed(kind_of, fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            timeline.append((round(t1 - origin[0], 5), *kind_of(*args), round(t1 - t0, 6)))
            return out
        return wrapper

    def round_step(seqs):
        decode = sum(1 for s in seqs if s.span.exit_rounds is None)
        prefill = sum(int(s.span.num_active) for s in seqs if s.span.exit_rounds is not None)
        kind = "mixed" if decode and prefill else ("decode" if decode else "prefill")
        return kind, decode, prefill

    running = lambda *_: ("tokens", len(engine.scheduler.running), 0)
    if engine._round_window is not None:
        engine._round_window.step = timed(lambda plan: ("window", len(plan.seqs), 0),
                                          engine._round_window.step)
    if engine._whole_tokens is not None:
        engine._whole_tokens.step = timed(running, engine._whole_tokens.step)
    if engine._token_window is not None:
        engine._token_window.step = timed(running, engine._token_window.step)
    engine.runner.execute = timed(round_step, engine.runner.execute)


def summarise(timeline: list, wall: float, concurrency: int) -> dict:
    kinds = collections.defaultdict(lambda: {"steps": 0, "s": 0.0, "prefill_tokens": 0})
    row_seconds = 0.0
    for _, kind, rows, prefill, seconds in timeline:
        k = kinds[kind]
        k["steps"] += 1
        k["s"] += seconds
        k["prefill_tokens"] += prefill
        row_seconds += rows * seconds
    stepped = sum(k["s"] for k in kinds.values())
    return {"kinds": {name: {**k, "s": round(k["s"], 4)} for name, k in sorted(kinds.items())},
            "stepped_s": round(stepped, 4), "host_between_steps_s": round(wall - stepped, 4),
            # decode rows in flight, time-weighted over the stepped time, as a share of c
            "decode_occupancy": round(row_seconds / stepped / concurrency, 4)}


def main(name: str, modes: list[str], passes: int = 1) -> dict:
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
                  **engine_options(mode))
        bench_engine(llm, prompts[:c], params[:c], c)   # captures outside the timing
        timeline, origin = [], [0.0]
        record_steps(llm.llm_engine, timeline, origin)
        for n in range(passes):   # later passes: whatever the first compiled or captured is warm
            timeline.clear()
            origin[0] = time.perf_counter()
            figures = bench_engine(llm, prompts, params, c)
            key = mode if n == 0 else f"{mode} pass {n + 1}"
            results[key] = {"closed_loop": figures, **summarise(timeline, figures["wall_s"], c),
                            "slowest_steps": sorted(timeline, key=lambda e: -e[-1])[:6],
                            "timeline": list(timeline)}
            print(key, json.dumps({k: v for k, v in results[key].items() if k != "timeline"}),
                  flush=True)
        del llm   # the step wrappers and the engine refer to each other: collect the cycle
        gc.collect()
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("modes", nargs="+")
    parser.add_argument("--passes", type=int, default=1,
                        help="closed loops per engine, each timed (default 1)")
    parser.add_argument("--out", help="write the JSON (timelines included) here too")
    args = parser.parse_args()
    for mode in args.modes:
        engine_options(mode)   # a bad mode fails before the model is built
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    out = {"workload": args.workload,
           "results": main(args.workload, args.modes, args.passes)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    print(json.dumps({m: {k: v for k, v in r.items() if k != "timeline"}
                      for m, r in out["results"].items()}))
