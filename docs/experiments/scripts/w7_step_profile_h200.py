"""Issue 17: where W7's decode phase loses against its depth savings (H200, Ouro-1.4B shape,
bf16, random weights). W6 (fixed depth 4, token windows) and W7 (replayed depths, round
windows) decode 128 rows of 128-token prompts; after the prefill and two warm-up steps, a few
engine steps run under torch.profiler. Per workload: decode tokens, wall and GPU kernel time per
token, GPU busy %, and every kernel's time per token, so that W7 / W6 per kernel can be read
against the rounds ratio (2.8 / 4). Last line: JSON.

    python docs/experiments/scripts/w7_step_profile_h200.py [--steps 3]
    (CPU smoke test: --preset tiny --device cpu --dtype float32 --kv-gib 0.5)
"""
import gc
import json
import sys
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.engine import WORKLOADS, make_llm, workload_params
from rltlab.bench.engine_checks import free_device_memory, sync


class Args:
    model, preset, device, dtype = None, "ouro-1.4b", "cuda", "bfloat16"


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def generated(engine, done) -> int:
    return (sum(s.num_output_tokens for r in engine.requests.values() for s in r.seqs)
            + sum(len(c.token_ids) for o in done for c in o.outputs))


def profile_decode(model, name: str, steps: int) -> dict:
    spec = WORKLOADS[name]
    c = spec["concurrency"]
    llm = make_llm(model, spec, "graph", kv_gib=float(option("--kv-gib", "40")))
    engine = llm.llm_engine
    prompts = prompts_for(c, spec["prompt_len"], model.config.vocab_size, seed=7)
    for i, (p, sp) in enumerate(zip(prompts, workload_params(spec, 4, c,
                                                               model.config.vocab_size))):
        engine.add_request(f"r{i}", p, sp)
    done = []
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        done += engine.step()
    for _ in range(2):   # captures and the first windows
        done += engine.step()
    sync()
    tokens0, start = generated(engine, done), time.perf_counter()
    # On a CPU (smoke test) nothing is profiled: the GPU figures read 0.
    cuda = torch.cuda.is_available()
    with (profile(activities=[ProfilerActivity.CUDA]) if cuda else nullcontext()) as prof:
        for _ in range(steps):
            done += engine.step()
        sync()
    wall_ms = 1e3 * (time.perf_counter() - start)
    tokens = generated(engine, done) - tokens0
    events = [e for e in (prof.key_averages() if cuda else []) if e.device_type.name == "CUDA"]
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
    events.sort(key=lambda e: -e.self_device_time_total)
    kernels = [(e.key[:90], round(e.self_device_time_total / 1e3 / tokens * 1e3, 3), e.count)
               for e in events]
    out = {"workload": name, "tokens": tokens, "steps": steps,
           "wall_us_per_token": round(1e3 * wall_ms / tokens, 3),
           "gpu_us_per_token": round(1e3 * gpu_ms / tokens, 3),
           "gpu_busy_pct": round(100 * gpu_ms / wall_ms, 1),
           "kernels_us_per_token": kernels}
    del llm, engine
    gc.collect()
    free_device_memory()
    return out


def main(steps: int) -> dict:
    model = build_model(Args)
    runs = {name: profile_decode(model, name, steps) for name in ("W6", "W7")}
    w6, w7 = runs["W6"], runs["W7"]
    six = {k: t for k, t, _ in w6["kernels_us_per_token"]}
    print(f"W6 {w6['wall_us_per_token']} us/token wall, {w6['gpu_us_per_token']} GPU "
          f"({w6['gpu_busy_pct']}% busy); W7 {w7['wall_us_per_token']} wall, "
          f"{w7['gpu_us_per_token']} GPU ({w7['gpu_busy_pct']}% busy)")
    for key, t7, count in w7["kernels_us_per_token"][:30]:
        print(f"  {t7:9.3f} us/tok W7 (x{count}), W6 {six.get(key, 0):9.3f}, ratio "
              f"{t7 / six[key] if six.get(key) else float('nan'):.3f}  {key[:70]}")
    return {"date": time.strftime("%Y-%m-%d"), "runs": runs}


if __name__ == "__main__":
    Args.preset, Args.device, Args.dtype = (option("--preset", Args.preset),
                                            option("--device", Args.device),
                                            option("--dtype", Args.dtype))
    print(json.dumps(main(int(option("--steps", "3")))))
