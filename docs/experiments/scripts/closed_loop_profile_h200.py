"""Issue 17: where a decode step's time goes at c = 128 (H200, Ouro-1.4B shape, bf16, random
weights). Per workload and mode: wall ms per engine step (synchronised; with round windows a
step is a whole window), GPU kernel ms per step (torch.profiler), the host functions that take
the rest (cProfile), and for prefill the heaviest kernels of prefill round steps.
--decode-only skips the prefill part, --prefill-only the decode part; --runs W3:graph,W4:graph
picks the decode runs. Last line: JSON. As run on 2026-12-01 (before this
script counted the tokens of requests that finish while it measures, so its W4 window rows of
that day are void): docs/benchmarks/data/2026-12-01-closed-loop-profile-before-h200.json and
2026-12-01-round-windows-v*-h200.json."""
import cProfile, gc, io, json, pstats, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.engine import MODES, WORKLOADS, workload_params
from rltlab.bench import engine_checks
from rltlab.engine import LLM


class Args:
    model, preset, device, dtype = None, "ouro-1.4b", "cuda", "bfloat16"


def make_llm(model, spec, mode):
    return LLM(model, max_num_seqs=spec["concurrency"],
               max_model_len=spec["prompt_len"] + spec["max_tokens"],
               max_num_batched_tokens=max(16384, spec["prompt_len"] + spec["concurrency"]),
               prefill_chunk=max(512, spec["prompt_len"]), kv_cache_memory_gib=110.0, **MODES[mode])


def kernels_of(prof, top=10):
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    return total / 1e3, [(e.key[:70], round(e.self_device_time_total / 1e3, 2), e.count)
                         for e in events[:top]]


def host_top(pr, top=14):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    lines = s.getvalue().splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [line for line in lines[head + 1:] if line.strip()][:top]


def decode_profile(model, name, mode, steps=4):
    spec = WORKLOADS[name]
    c = spec["concurrency"]
    llm = make_llm(model, spec, mode)
    prompts = prompts_for(c, spec["prompt_len"], model.config.vocab_size, 7)
    params = workload_params(spec, 4, c, model.config.vocab_size)
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done = []   # finished requests leave eng.requests: count their tokens from the outputs

    def generated():
        return (sum(s.num_output_tokens for r in eng.requests.values() for s in r.seqs)
                + sum(len(c.token_ids) for o in done for c in o.outputs))

    while any(s.num_output_tokens == 0 for r in eng.requests.values() for s in r.seqs):
        done += eng.step()
    for _ in range(2):   # captures (every run's steps stay within its 128 tokens per request)
        done += eng.step()
    torch.cuda.synchronize()
    tok0 = generated()
    t0 = time.perf_counter()
    for _ in range(steps):
        done += eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    tokens = (generated() - tok0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            done += eng.step()
        torch.cuda.synchronize()
    gpu_ms, top = kernels_of(prof, 16)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        done += eng.step()
    torch.cuda.synchronize()
    pr.disable()
    out = {"workload": name, "mode": mode, "wall_ms_per_step": round(1e3 * wall, 3),
           "tokens_per_step": tokens, "tok_s": round(tokens / wall, 1),
           "gpu_kernel_ms_per_step": round(gpu_ms / steps, 3),
           "gpu_busy_pct": round(100 * gpu_ms / steps / (1e3 * wall), 1), "top_kernels": top,
           "host_top": host_top(pr)}
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def prefill_profile(model, name="W3", mode="graph"):
    spec = WORKLOADS[name]
    llm = make_llm(model, spec, mode)
    prompts = prompts_for(48, spec["prompt_len"], model.config.vocab_size, 9)
    params = workload_params({**spec, "max_tokens": 1}, 4, 48, model.config.vocab_size)
    llm.generate(prompts[:16], params[:16])   # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts[16:], params[16:])
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[16:], params[16:])
        torch.cuda.synchronize()
    gpu_ms, top = kernels_of(prof, 16)
    cfg = model.config
    per_tok = 2 * sum(p.numel() for p in model.model.layers.parameters()) * cfg.num_rounds
    flops = 32 * spec["prompt_len"] * per_tok
    out = {"workload": name, "mode": mode, "prompts": 32, "wall_s": round(wall, 4),
           "gpu_kernel_s": round(gpu_ms / 1e3, 4), "linear_tflop_s": round(flops / wall / 1e12, 1),
           "top_kernels": top}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    model = build_model(Args)
    results = {"matmul_tflop_s": None}
    from rltlab.bench import ceilings
    results["matmul_tflop_s"] = ceilings.matmul_tflop_s("cuda", torch.bfloat16)
    if "--decode-only" not in sys.argv:
        results["prefill"] = [prefill_profile(model, "W3", m) for m in ("graph",)]
        print(json.dumps(results["prefill"], indent=1), flush=True)
    if "--prefill-only" in sys.argv:
        print(json.dumps(results))
        sys.exit(0)
    runs = [("W3", "graph"), ("W4", "graph"), ("W4", "graph-ragged"), ("W6", "graph"),
            ("W7", "graph"), ("W7", "graph-ragged"), ("W7", "graph-rounds")]
    if "--runs" in sys.argv:   # e.g. --runs W3:graph,W4:graph
        runs = [tuple(run.split(":")) for run in sys.argv[sys.argv.index("--runs") + 1].split(",")]
    results["decode"] = []
    for name, mode in runs:
        r = decode_profile(model, name, mode)
        results["decode"].append(r)
        print(json.dumps(r, indent=1), flush=True)
    print(json.dumps(results))
