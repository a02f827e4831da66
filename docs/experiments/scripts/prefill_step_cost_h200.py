"""Issue 17 (W7/W6): what one prefill step costs against its tokens (H200, Ouro-1.4B shape, bf16).

The eleventh session's closed-loop split (s11_call2_h200.sh) found W7's loop spending 0.80-1.01 s
in 32 prefill steps where W6's spent 0.57 s in 8 for the same 256 prompts: W7 admits its second
wave a few prompts at a time (7 events), W6 in one. A line through (16,384 tokens, 72 ms) and
(~2,300, ~22 ms) puts ~14 ms on every step whatever its size. This measures it directly: waves of
n whole 128-token prompts (max_tokens 1) on the bench's W7 engine, every engine step synchronised,
with CUDA events around ModelRunner.execute (its GPU time, host launch gaps included); then one
16-prompt wave under torch.profiler (device time by kernel, and the host's share).

    python docs/experiments/scripts/prefill_step_cost_h200.py

Last line: JSON.
"""
import argparse
import json
import statistics
import time

import torch

from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.engine import WORKLOADS, make_llm, warm_up, workload_params
from rltlab.engine import SamplingParams


def wave(llm, prompts, sp, execute_ms: list | None = None) -> tuple[list[dict], list]:
    """Prefill `prompts` one synchronised engine step at a time -> (per step: wall ms and, with
    execute_ms (the timed ModelRunner.execute's event readers), GPU ms; the outputs in prompt
    order)."""
    eng, steps, outs = llm.llm_engine, [], []
    for i, p in enumerate(prompts):
        eng.add_request(f"w{time.monotonic_ns()}-{i}", p, sp)
    while eng.has_unfinished_requests():
        before = len(execute_ms or [])
        t0 = time.perf_counter()
        outs += eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append({"wall_ms": 1e3 * (time.perf_counter() - t0),
                      "execute_ms": None if execute_ms is None
                      else sum(e() for e in execute_ms[before:])})
    return steps, sorted(outs, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    model = build_model(args)
    spec, cfg = WORKLOADS["W7"], model.config
    llm = make_llm(model, spec, "graph", kv_gib=110.0 if cuda else 1.0)
    pool = prompts_for(4096, args.prompt_len, cfg.vocab_size, seed=11)
    warm_up(llm, pool, workload_params(spec, cfg.num_rounds, 128, cfg.vocab_size), 128)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    runner, execute_ms = llm.llm_engine.runner, []
    inner = runner.execute

    def timed(seqs):
        if not cuda:
            return inner(seqs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(seqs)
        end.record()
        execute_ms.append(lambda: start.elapsed_time(end))
        return out
    runner.execute = timed
    used, sizes = 0, {}
    for n in args.sizes:
        wave(llm, pool[used: used + n], sp, execute_ms)   # this size's first: one-off costs
        used += n
        per = []
        for _ in range(args.repeats):
            per += wave(llm, pool[used: used + n], sp, execute_ms)[0]
            used += n
        sizes[n] = {"tokens_per_step": n * args.prompt_len, "steps": len(per),
                    "step_wall_ms_median": round(statistics.median(s["wall_ms"] for s in per), 2),
                    "execute_ms_median": round(statistics.median(s["execute_ms"] for s in per), 2)}
        print(n, sizes[n], flush=True)
    del runner.__dict__["execute"]
    xs = [v["tokens_per_step"] for v in sizes.values()]
    ys = [v["step_wall_ms_median"] for v in sizes.values()]
    slope, intercept = statistics.linear_regression(xs, ys)
    profile = None
    if cuda:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            wave(llm, pool[used: used + 16], sp, [])
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        table = sorted(events, key=lambda e: -e.device_time_total)[:15]
        profile = {"wall_ms": round(1e3 * wall, 2),
                   "device_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 2),
                   "top": [{"name": e.key[:80], "calls": e.count,
                            "device_ms": round(e.device_time_total / 1e3, 3),
                            "cpu_ms": round(e.cpu_time_total / 1e3, 3)} for e in table]}
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    out = {"workload": f"waves of n whole {args.prompt_len}-token prompts, max_tokens 1, W7's "
                       "engine", "device": args.device, "dtype": args.dtype, "sizes": sizes,
           "fit_step_ms": {"fixed_ms": round(intercept, 3), "us_per_token": round(1e3 * slope, 4)},
           "profile_16": profile}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
