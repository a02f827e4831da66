"""Issue 17, W5: what a W5-shaped decode step spends its time on, at the Ouro-1.4B shape.

In the thirteenth session's call 3 the decode phase alone (16 prompts of 512 tokens x n = 8,
all 128 rows in flight, T = 1) took ~28-32 ms per token step, while its decode attention took
5.6 ms (shared prefix) / 10.6 ms (plain) and the weights ~3 ms: most of the step is elsewhere.
Here, same engine, same rows, alternating: greedy (T = 0: the one-kernel argmax) against
sampled (T = 1: the per-row generators, rltlab.engine.sampling.sample_on_device) decoding,
then one sampled generate under torch.profiler: the top operators by device time and by host
time, and the device's busy share of the wall time. Last line: JSON.

    python docs/experiments/scripts/w5_decode_profile_h200.py --preset ouro-1.4b \\
        --device cuda --dtype bfloat16
"""
import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rltlab.bench.__main__ import add_model_arguments, build_model
from rltlab.engine import LLM, SamplingParams


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def top_ops(prof, key: str, count: int = 12) -> list:
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    return [[e.key[:60], round(getattr(e, key) / 1e3, 2), e.count] for e in events[:count]]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    model = build_model(args)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=g).tolist() for _ in range(16)]
    params = {t: [SamplingParams(n=8, temperature=t, seed=i, max_tokens=args.tokens,
                                 ignore_eos=True, exit_policy="fixed") for i in range(16)]
              for t in (0.0, 1.0)}
    llm = LLM(model, device=device, decode_path="static", max_num_seqs=128,
              kv_cache_memory_gib=8.0, max_model_len=args.prompt + args.tokens + 1)
    secs = {0.0: [], 1.0: []}
    for t in secs:
        llm.generate(prompts, params[t])   # warm-up
    for rep in range(args.repeats):
        for t in ((0.0, 1.0) if rep % 2 == 0 else (1.0, 0.0)):
            sync(device)
            started = time.perf_counter()
            llm.generate(prompts, params[t])
            sync(device)
            secs[t].append(time.perf_counter() - started)
    steps = args.tokens
    result = {"ms_per_step": {str(t): round(1e3 * statistics.median(s) / steps, 2)
                              for t, s in secs.items()}, "seconds": {str(t): s
                                                                      for t, s in secs.items()}}
    print(f"per token step (16 x n=8 rows, incl. prefill): greedy "
          f"{result['ms_per_step']['0.0']} ms, sampled {result['ms_per_step']['1.0']} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    sync(device)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, params[1.0])
        sync(device)
    wall = time.perf_counter() - started
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, device_key) for e in prof.key_averages()) / 1e6
    result["profile_sampled"] = {
        "wall_s": round(wall, 3), "device_busy_s": round(busy, 3),
        "top_device_ms": top_ops(prof, device_key),
        "top_host_ms": top_ops(prof, "self_cpu_time_total")}
    print(f"profiled sampled generate: wall {wall:.2f} s, device busy {busy:.2f} s")
    for name, ms, count in result["profile_sampled"]["top_device_ms"][:8]:
        print(f"  device {ms:9.1f} ms x{count:6d} {name}")
    for name, ms, count in result["profile_sampled"]["top_host_ms"][:8]:
        print(f"  host   {ms:9.1f} ms x{count:6d} {name}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
