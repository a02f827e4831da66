"""Throughput / latency benchmark: the engine vs the model's plain cached loop, same run.

    python -m rltlab.bench [--model DIR] [--concurrency 1,8,64] [--prompt-len 64] ...

Engine: closed loop, C requests in flight (a finished one is replaced at once) until
`requests` (default 2C, at least 4) are done; TTFT = first token - arrival, TPOT = (last - first
token) / (tokens - 1), medians over requests. Plain loop (rltlab.model.generate.generate_plain):
static batches of C left-padded prompts; its TTFT is timed by a 1-token run of the same batch
and TPOT = (full run - TTFT) / (tokens - 1). Every request decodes exactly max_tokens
(ignore_eos), full depth (R rounds) on both sides unless --depth is given. Warm-up excluded;
each level is repeated --repeats times and the median run is reported. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.model.generate import generate_plain
from rltlab.bench.models import add_model_arguments, build_model
from rltlab.model.presets import random_prompts
from rltlab.common.environment import git_commit

def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_engine(llm: LLM, prompts, params, concurrency: int, keep: list | None = None) -> dict:
    """params: one SamplingParams for all prompts, or a list aligned with them. Tokens count
    every sample of n > 1 requests; a request's TPOT is over its longest sample. keep: a list
    that receives the RequestOutputs in prompt order."""
    pending, done, start = list(enumerate(prompts)), [], time.perf_counter()
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)

    def admit():
        idx, prompt = pending.pop(0)
        llm.add_request(f"b{idx}", prompt, per_prompt[idx])

    for _ in range(min(concurrency, len(pending))):
        admit()
    while llm.has_unfinished_requests():
        for out in llm.step():
            done.append(out)
            if pending:
                admit()
    _sync(llm.llm_engine.runner.device)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in done for c in o.outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done]
    longest = [max(len(c.token_ids) for c in o.outputs) for o in done]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (n - 1)
            for o, n in zip(done, longest) if n > 1]
    if keep is not None:
        keep.extend(sorted(done, key=lambda o: int(o.request_id[1:])))
    return _metrics(tokens, wall, ttft, tpot)


def bench_plain(model, prompts, max_tokens: int, concurrency: int, depth) -> dict:
    tokens, wall, ttft, tpot = 0, 0.0, [], []
    device = next(model.parameters()).device
    for i in range(0, len(prompts), concurrency):
        wave = prompts[i: i + concurrency]
        t0 = time.perf_counter()
        generate_plain(model, wave, 1, depth=depth)
        _sync(device)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = generate_plain(model, wave, max_tokens, depth=depth)
        _sync(device)
        full = time.perf_counter() - t0
        tokens += sum(len(t) for t in out.token_ids)
        wall += full
        ttft += [first] * len(wave)
        tpot += [(full - first) / max(max_tokens - 1, 1)] * len(wave)
    return _metrics(tokens, wall, ttft, tpot)


def _metrics(tokens, wall, ttft, tpot) -> dict:
    return {"tokens": tokens, "wall_s": round(wall, 4), "tok_s": round(tokens / wall, 2),
            "ttft_ms": round(1e3 * statistics.median(ttft), 3),
            "tpot_ms": round(1e3 * statistics.median(tpot), 3) if tpot else None}


def median_run(fn, repeats: int) -> dict:
    runs = sorted((fn() for _ in range(repeats)), key=lambda m: m["tok_s"])
    return runs[len(runs) // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="per level (default 2C, >= 4)")
    ap.add_argument("--depth", type=int, default=None, help="fixed decode depth (default R)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU: small matmuls only lose to "
                         "thread contention; the torch default on CUDA)")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV cache memory of the engine")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    model = build_model(args)
    cfg = model.config
    levels = [int(c) for c in args.concurrency.split(",")]
    policy = (dict(exit_policy="fixed", exit_policy_args={"depth": args.depth})
              if args.depth else dict(exit_policy="fixed"))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=0, **policy)
    llm = LLM(model, max_num_seqs=max(levels), max_model_len=args.prompt_len + args.max_tokens,
              max_num_batched_tokens=max(2048, args.prompt_len), kv_cache_memory_gib=args.kv_gib)
    warm = random_prompts(2, args.prompt_len, cfg.vocab_size, seed=99)
    llm.generate(warm, params)
    generate_plain(model, warm, 4, depth=args.depth)
    results = {"commit": git_commit(), "argv": sys.argv[1:], "device": args.device, "dtype": args.dtype, "cpu": platform.processor() or
               platform.machine(), "threads": torch.get_num_threads(),
               "model": args.model or f"random:{args.preset}", "rounds": cfg.num_rounds,
               "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "decode_depth": args.depth or cfg.num_rounds, "levels": {}}
    if torch.device(args.device).type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    print(f"# {results['model']} on {args.device} ({args.dtype}), prompt {args.prompt_len}, "
          f"{args.max_tokens} new tokens, decode depth {results['decode_depth']}")
    print(f"{'C':>4} {'system':>7} {'tok/s':>10} {'TTFT ms':>10} {'TPOT ms':>10}")
    for c in levels:
        num = args.requests or max(2 * c, 4)
        prompts = random_prompts(num, args.prompt_len, cfg.vocab_size, seed=c)
        engine = median_run(lambda: bench_engine(llm, prompts, params, c), args.repeats)
        plain = median_run(lambda: bench_plain(model, prompts, args.max_tokens, c, args.depth),
                           args.repeats)
        results["levels"][str(c)] = {"engine": engine, "plain": plain, "requests": num}
        for name, m in (("engine", engine), ("plain", plain)):
            print(f"{c:>4} {name:>7} {m['tok_s']:>10.1f} {m['ttft_ms']:>10.2f} "
                  f"{m['tpot_ms']:>10.3f}")
    print(json.dumps(results))
    return results
