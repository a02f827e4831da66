"""Decode-throughput gain of a replayed exit-depth pattern over fixed depth R, in one run.

    python -m rltlab.bench.depth_gain --preset ouro-1.4b --concurrency 64 --pattern 3

The engine runs the same closed-loop workload (C requests in flight, prompt --prompt-len,
--max-tokens new tokens, ignore_eos) twice from one process and one model: once at fixed depth R
(baseline) and once replaying --pattern (comma-separated exit rounds; request j replays it
cyclically from offset j * len(pattern) // requests, so a long pattern is covered and rows at
mixed depths decode side by side, as in generation; e.g. the replay pattern that
rltlab.exit_predictor.pareto writes for an N+2 operating point). Reports tok/s and TPOT for
both, the gain, and the ideal gain R / mean executed rounds over the replayed decode tokens.
Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm.auto import tqdm

from rltlab.model.presets import random_prompts
from rltlab.bench.models import add_model_arguments, build_model
from rltlab.bench.throughput import bench_engine, median_run
from rltlab.engine import LLM, SamplingParams
from rltlab.common.environment import git_commit


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.depth_gain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pattern", default="3", help="exit rounds to replay, e.g. 3 or 2,3,3,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed passes of the workload per policy before the timed ones")
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--round-steps", action="store_true",
                    help="one engine step per round (fused_tokens=False) for both runs")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.warmup < 0 or args.repeats < 1:
        raise SystemExit(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup}, "
                         f"{args.repeats}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    try:
        pattern = [int(x) for x in args.pattern.split(",")]
    except ValueError:
        ap.error(f"--pattern must be comma-separated exit rounds, e.g. 2,3,3,4; got "
                 f"{args.pattern!r}")
    model = build_model(args)
    rounds = model.config.num_rounds
    if not all(1 <= d <= rounds for d in pattern):
        raise SystemExit(f"--pattern rounds must lie in [1, {rounds}], got {pattern}")
    common = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = random_prompts(max(2 * args.concurrency, 4), args.prompt_len,
                          model.config.vocab_size, seed=args.concurrency)
    offsets = [j * len(pattern) // len(prompts) for j in range(len(prompts))]
    traces = [[rounds] + [pattern[(start + i) % len(pattern)] for i in range(args.max_tokens - 1)]
              for start in offsets]
    # A constant pattern is fixed depth d, else the trace policy replays each request's depths;
    # both take the engine's whole-token steps (engine/token_step.py) unless --round-steps.
    replay = ([SamplingParams(exit_policy="fixed", exit_policy_args={"depth": pattern[0]},
                              **common)] * len(prompts) if len(set(pattern)) == 1 else
              [SamplingParams(exit_policy="trace", exit_policy_args={"depths": t}, **common)
               for t in traces])
    policies = {"fixed_R": SamplingParams(exit_policy="fixed", **common), "replay": replay}
    llm = LLM(model, max_num_seqs=args.concurrency,
              max_model_len=args.prompt_len + args.max_tokens,
              max_num_batched_tokens=max(2048, args.prompt_len), kv_cache_memory_gib=args.kv_gib,
              fused_tokens=not args.round_steps)
    results = {"commit": git_commit(), "argv": sys.argv[1:], "device": args.device, "dtype": args.dtype, "model": args.model or
               f"random:{args.preset}", "concurrency": args.concurrency,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "pattern": pattern,
               "replay_policy": replay[0].exit_policy, "round_steps": args.round_steps,
               "warmup": args.warmup, "repeats": args.repeats}
    if torch.device(args.device).type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    for name, params in policies.items():
        with tqdm(total=args.warmup + args.repeats, desc=name, unit="run") as bar:
            def run_once():
                result = bench_engine(llm, prompts, params, args.concurrency)
                bar.update()            # after bench_engine has taken its own time
                return result
            # One untimed pass of the very workload: a fresh process captures the graphs of
            # every batch size and grows its allocator here, not inside the first timed run (a
            # two-prompt warm-up left one baseline run at 3x its steady time per token).
            for _ in range(args.warmup):
                run_once()
            results[name] = median_run(run_once, args.repeats)
        print(f"{name:>8}: {results[name]['tok_s']:.1f} tok/s, "
              f"TPOT {results[name]['tpot_ms']:.2f} ms")
    decode_depths = [d for t in traces for d in t[1:]]
    mean_decode = sum(decode_depths) / max(len(decode_depths), 1)
    results["mean_executed_rounds"] = mean_decode
    results["ideal_gain"] = rounds / mean_decode
    results["tok_s_gain"] = results["replay"]["tok_s"] / results["fixed_R"]["tok_s"]
    results["tpot_gain"] = results["fixed_R"]["tpot_ms"] / results["replay"]["tpot_ms"]
    print(f"gain {results['tok_s_gain']:.3f}x tok/s, {results['tpot_gain']:.3f}x TPOT "
          f"(ideal {results['ideal_gain']:.3f}x at {mean_decode:.2f} rounds)")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
