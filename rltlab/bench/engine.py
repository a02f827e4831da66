"""Engine speed on the issue-#4 workloads, every mode side by side in one run.

    python -m rltlab.bench.engine --preset ouro-1.4b --workload W1 W2 W3 W4 [--out FILE]

Workloads (greedy, ignore_eos, random prompts; fixed depth R unless stated):
  W1  c=1, 128-token prompt, 128 outputs
  W2  c=32 closed loop (32 in flight until 128 finished), 512 in / 128 out
  W3  c=128 closed loop (until 256 finished), 1024 in / 128 out
  W4  W3 replaying exit depths drawn from DEPTH_DISTRIBUTION (mean 2.8 rounds; trace policy)
  W5  shared-prompt groups: 64 prompts x n=8, 512 in / up to 256 out (stop-token ended),
      temperature 1, logprobs=0, 128 sequences in flight, against the same 512 samples sent as
      independent requests in the same run (rltlab.bench.group_workload)
  W6  decode-heavy: c=128 closed loop (until 256 finished), 128 in / 512 out
  W7  W6 replaying exit depths like W4
Modes: plain (the model's cached loop, batch 1: W1 only), gather (the engine's plain-torch path),
eager (static decode path: Triton attention and, for <= 16 rows, the small-batch GEMV kernels;
no graphs), graph (+ CUDA graphs), compile (+ torch.compile of the per-layer functions of
buckets > 1), graph-rounds (graph, but one engine step per round instead of whole fixed-depth
tokens, rltlab.engine.token_step), graph-ragged (graph, but mixed depths as whole tokens deepest
first instead of round windows, rltlab.engine.round_window), graph-one-token (graph, but one
whole token per host round trip at one depth instead of token windows,
rltlab.engine.token_window), graph-gather-prefill (graph, but
prefill chunks through the gather path instead of rltlab.engine.fused_prefill), graph-no-pdl
(graph, but one-row rounds without programmatic dependent launch, rltlab.kernels.pdl),
graph-unfused-rope (graph, but one-row rounds run RoPE + K/V write as a kernel of its own
after the q/k/v GEMV instead of in its epilogue, rltlab.kernels.rope_kv_linear),
graph-mixed-prefill (graph, but decode rows run one round in each prefill step instead of
waiting for the prefills: ExecutionConfig.prefill_first), graph-cublas / compile-cublas
(graph / compile with cuBLAS for every bucket).

Per workload and mode: closed-loop output tok/s, TTFT and TPOT (medians), and a decode-phase
figure: c requests admitted together, timed from the moment all have their first token until
the last finishes (no prefill inside). W1 also reports the achieved memory traffic per decode
token (weights of every executed round + lm_head + K/V read) in GB/s and as a % of the device
copy bandwidth measured in the same run. W4 reports selected vs executed rounds and its decode
gain over W3 against the ideal R / mean executed rounds. Closed-loop workloads run their loop
once before the reported one (kept as closed_loop_first_pass): one-off graph captures and Triton
specialisations stay out of the figures. Options --weight-update and --bf16-check
add the full-weight update timing and the bf16-vs-fp32 agreement. --prompt-spread S draws
every workload's prompt lengths uniformly from prompt_len x (1 - S) .. (1 + S) instead of one
length (real prompts differ; the fused prefill pays per distinct length in eager steps).
W5 runs one untimed pass of its grouped and of its independent loop too, then --w5-rounds N
rounds of both in alternating order: group_speedup is the rounds' median (with their mean and
SE); the loops reported are the last round's. ideal_group_gain is the independent run's time
floor over the grouped run's (the prefill saved plus the shared K/V reads saved, at the run's
matmul rate and copy bandwidth), group_pct_of_ideal the share of those savings reached. graph-no-shared-prefix (graph, but every decode
row reads its group's shared prompt itself, kernels/shared_prefix.py) is W5's baseline mode.

Ceilings (rltlab.bench.ceilings): the run measures a large matmul (TFLOP/s, model dtype) and a
large device copy (GB/s, read + write) first; every workload and mode then reports
`ceiling_tok_s` / `pct_of_ceiling` (prefill FLOPs at the matmul rate + decode weight and K/V
bytes at the copy bandwidth, from the run's own outputs; with shared-prefix attention a group's
shared prompt blocks count once per decode step), a prefill-only run (max_tokens 1)
with `prefill_pct_of_matmul`, and each depth pair (W4/W3, W7/W6) `e2e_gain`,
`ideal_e2e_gain` and `pct_of_ideal_e2e`. Last line: JSON.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time

import torch

from rltlab.model.presets import longest_prompt, random_prompts
from rltlab.bench.models import add_kv_argument, add_model_arguments, build_model, positive_scale
from rltlab.bench import ceilings, engine_checks, group_workload
from rltlab.bench.ceilings import ModelCosts, work_of
from rltlab.engine import LLM, SamplingParams
from rltlab.model.generate import generate_plain
from rltlab.common.environment import git_commit
from rltlab.common.profiling import phase_profile

WORKLOADS = {
    "W1": dict(concurrency=1, requests=1, prompt_len=128, max_tokens=128),
    "W2": dict(concurrency=32, requests=128, prompt_len=512, max_tokens=128),
    "W3": dict(concurrency=128, requests=256, prompt_len=1024, max_tokens=128),
    "W4": dict(concurrency=128, requests=256, prompt_len=1024, max_tokens=128, replay=True),
    "W5": dict(concurrency=128, requests=64, n=8, prompt_len=512, max_tokens=256),
    "W6": dict(concurrency=128, requests=256, prompt_len=128, max_tokens=512),
    "W7": dict(concurrency=128, requests=256, prompt_len=128, max_tokens=512, replay=True),
}
DEPTH_PAIRS = {"W4/W3": ("W3", "W4"), "W7/W6": ("W6", "W7")}   # cheap / fixed-depth baseline
DEPTH_DISTRIBUTION = {1: 0.05, 2: 0.30, 3: 0.45, 4: 0.20}   # mean 2.8 rounds
MODES = {
    "gather": dict(decode_path="gather"),
    "eager": dict(decode_path="static", cuda_graphs=False),
    "graph": dict(decode_path="static", cuda_graphs=True),
    "compile": dict(decode_path="static", cuda_graphs=True, compile=True),
    # Baselines: one engine step per round instead of whole fixed-depth tokens; cuBLAS instead of
    # the one-row Triton GEMV (graph-cublas with graph-rounds = the engine before both).
    "graph-rounds": dict(decode_path="static", cuda_graphs=True, fused_tokens=False),
    # Baseline: mixed depths as whole tokens deepest first (no round windows, round_window.py).
    "graph-ragged": dict(decode_path="static", cuda_graphs=True, round_window=0),
    # Baseline: one depth, one whole token per host round trip (no token windows).
    "graph-one-token": dict(decode_path="static", cuda_graphs=True, token_window=0),
    # Baseline: prefill chunks through the plain-torch gather path (rltlab.engine.fused_prefill).
    "graph-gather-prefill": dict(decode_path="static", cuda_graphs=True, fused_prefill=False),
    # Baseline: decode rows run one round in each prefill step (ExecutionConfig.prefill_first).
    "graph-mixed-prefill": dict(decode_path="static", cuda_graphs=True, prefill_first=False),
    # Baseline: whole prompts' attention through FlashAttention-2 only (fused_prefill.py).
    "graph-flash-prefill": dict(decode_path="static", cuda_graphs=True, cudnn_prefill_after=None),
    # Candidate (opt-in): eager prefill steps' whole prompts padded within length buckets, one
    # attention launch per bucket and layer instead of one per distinct length.
    "graph-padded-prefill": dict(decode_path="static", cuda_graphs=True,
                                 pad_prefill_attention=True),
    # Baseline: every prefill step eager, none replayed as a bucketed CUDA graph
    # (rltlab.engine.prefill_graphs).
    "graph-no-prefill-graphs": dict(decode_path="static", cuda_graphs=True,
                                    prefill_graph_tokens=0),
    # Baseline: every decode row reads its prompt's K/V itself, grouped samples too
    # (kernels/shared_prefix.py).
    "graph-no-shared-prefix": dict(decode_path="static", cuda_graphs=True,
                                   shared_prefix_attention=False),
    # Baseline: one window per engine step, read back before the next is launched (window_io).
    "graph-no-chain": dict(decode_path="static", cuda_graphs=True, window_chain=1),
    # Baseline: one-row rounds' kernels launched without programmatic dependent launch.
    "graph-no-pdl": dict(decode_path="static", cuda_graphs=True, pdl=False),
    # Baseline: one-row rounds run the q/k/v GEMV, then RoPE + K/V write as its own kernel.
    "graph-unfused-rope": dict(decode_path="static", cuda_graphs=True, fused_qkv_rope=False),
    # L2 prefetch of the next GEMV's weights in one-row rounds, up to N MiB per kernel (the
    # default 4); baseline: none.
    **{f"graph-l2-{mib}": dict(decode_path="static", cuda_graphs=True, l2_prefetch_mb=mib)
       for mib in (1, 2, 3, 4, 6, 8, 16)},
    "graph-no-l2-prefetch": dict(decode_path="static", cuda_graphs=True, l2_prefetch_mb=0),
    # Round windows of 8 and 32 round steps instead of 16 (mixed depths: W4, W7).
    "graph-rw8": dict(decode_path="static", cuda_graphs=True, round_window=8),
    "graph-rw32": dict(decode_path="static", cuda_graphs=True, round_window=32),
    "graph-cublas": dict(decode_path="static", cuda_graphs=True, small_batch_kernels=False),
    "compile-cublas": dict(decode_path="static", cuda_graphs=True, compile=True,
                           small_batch_kernels=False),
}


def replay_depths(num_rounds: int, length: int, seed: int) -> list[int]:
    """[R] + decode depths drawn i.i.d. from DEPTH_DISTRIBUTION (R = 4 rounds)."""
    if num_rounds != 4:
        raise ValueError("DEPTH_DISTRIBUTION is for R = 4 rounds")
    depths = torch.tensor(list(DEPTH_DISTRIBUTION))
    probs = torch.tensor(list(DEPTH_DISTRIBUTION.values()))
    gen = torch.Generator().manual_seed(seed)
    return [num_rounds] + depths[torch.multinomial(probs, length - 1, True, generator=gen)].tolist()


def scaled(spec: dict, scale: float) -> dict:
    """--scale applied to lengths and counts (not to n or replay; at least n in flight)."""
    out = {k: v if k in ("replay", "n", "prompt_spread")
           else max(2 if k == "max_tokens" else 1, int(v * scale)) for k, v in spec.items()}
    if "n" in out:
        out["concurrency"] = max(out["concurrency"], out["n"])
    return out


def with_spread(spec: dict, spread: float) -> dict:
    """--prompt-spread: the workload's prompts of lengths around its prompt_len (random_prompts)."""
    return dict(spec, prompt_spread=spread) if spread else spec


def workload_prompts(spec: dict, vocab: int) -> list[list[int]]:
    return random_prompts(spec["requests"], spec["prompt_len"], vocab, seed=7,
                       spread=spec.get("prompt_spread", 0.0))


def add_spread_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompt-spread", type=float, default=0.0,
                    help="prompt lengths drawn uniformly from prompt_len x (1 -/+ this), mean "
                    "prompt_len (0, the default: every prompt prompt_len tokens)")


def check_spread(ap: argparse.ArgumentParser, spread: float) -> None:
    if not 0 <= spread < 1:
        ap.error(f"--prompt-spread must be in [0, 1), got {spread}")


def workload_params(spec: dict, num_rounds: int, num: int, vocab: int
                    ) -> list[SamplingParams]:
    if spec.get("n"):
        return group_workload.group_params(spec, vocab, num)
    common = dict(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    if not spec.get("replay"):
        return [SamplingParams(exit_policy="fixed", **common)] * num
    return [SamplingParams(exit_policy="trace", exit_policy_args={
        "depths": replay_depths(num_rounds, spec["max_tokens"], seed=i)}, **common)
        for i in range(num)]


def decode_phase(llm: LLM, prompts, params, costs: ModelCosts) -> dict:
    """All requests admitted at once; tok/s over the steps after every one has its first token,
    counting only the tokens those steps make."""
    engine, done = llm.llm_engine, []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"d{i}", prompt, sp)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        done += engine.step()
    engine_checks.sync()
    # rows whose prefill ended early may have decoded beside the later prefills: those tokens
    # were made before the timing starts and are not counted
    made_before = sum(s.num_output_tokens for r in engine.requests.values() for s in r.seqs) \
        + sum(len(o.token_ids) for o in done)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        done += engine.step()
    engine_checks.sync()
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in done) - made_before
    selected = [d for o in done for d in o.exit_depths[1:]]
    executed = [d for o in done for d in o.executed_depths[1:]]
    return {"decode_tok_s": round(tokens / wall, 2), "decode_tokens": tokens,
            "mean_selected_rounds": round(sum(selected) / len(selected), 3),
            "mean_executed_rounds": round(sum(executed) / len(executed), 3),
            "work": work_of(costs, sorted(done, key=lambda o: int(o.request_id[1:])))}


def make_llm(model, spec: dict, mode: str, kv_gib: float) -> LLM:
    """The engine a workload runs on in one mode."""
    prompt = longest_prompt(spec["prompt_len"], spec.get("prompt_spread", 0.0))
    return LLM(model, max_num_seqs=spec["concurrency"],
               max_model_len=prompt + spec["max_tokens"],
               # Big prefill steps: the gather path's per-step launch cost is paid per 16K
               # tokens instead of per 4K (prefill is compute-bound either way).
               max_num_batched_tokens=max(16384, prompt + spec["concurrency"]),
               prefill_chunk=max(512, prompt), kv_cache_memory_gib=kv_gib,
               **MODES[mode])


def warm_up(llm: LLM, prompts, params, concurrency: int) -> None:
    """Capture / compile / autotune outside the timings: a few requests, then every batch
    bucket the measured runs will use."""
    warm = min(concurrency, 4)
    llm.generate(prompts[:warm], params[:warm])
    if concurrency > warm:
        llm.generate(prompts[:concurrency], [SamplingParams(**{**vars(p), "max_tokens": 2})
                                             for p in params[:concurrency]])


def run_mode(model, spec: dict, mode: str, prompts, params, kv_gib: float,
             costs: ModelCosts, profile: bool = False) -> dict:
    llm = make_llm(model, spec, mode, kv_gib)
    c = spec["concurrency"]
    try:
        if spec.get("n"):
            return group_workload.run(llm, spec, prompts, params, costs, spec["rounds"],
                                      profile)
        warm_up(llm, prompts, params, c)
        first_pass = None
        if spec["requests"] > 1:
            # One closed loop before the reported one: its draining tail and staggered admissions
            # reach batch buckets and Triton specialisations nothing above does, whose one-off
            # capture and compile (up to 3.3 s of a 12 s W4 loop) would otherwise
            # land in the decode-phase and closed-loop figures. Its figures are kept apart.
            first_pass, _ = engine_checks.closed_loop(llm, prompts, params, c, costs)
        # A batch-1 decode phase lasts ~1 s: host jitter moves it by ~5-10%, so take the median
        # of three (each value is kept).
        runs = [decode_phase(llm, prompts[:c], params[:c], costs)
                for _ in range(3 if c == 1 else 1)]
        result = {"decode": sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]}
        if len(runs) > 1:
            result["decode"]["runs_tok_s"] = [r["decode_tok_s"] for r in runs]
        if llm.llm_engine.runner.static is not None and c == 1:
            result["round"] = engine_checks.round_profile(llm.llm_engine.runner.static)
        if first_pass is not None:
            result["closed_loop"], _ = engine_checks.closed_loop(llm, prompts, params, c, costs)
            result["closed_loop_first_pass"] = first_pass
        result["prefill"] = engine_checks.prefill_only(llm, prompts, params, c, costs)
        if profile and c > 1:   # after the timed figures: the profiler slows what it watches
            result["decode_profile"] = phase_profile(
                functools.partial(decode_phase, llm, prompts[:c], params[:c], costs))
            result["prefill_profile"] = profile_prefill(llm, prompts, params, c, costs)
        for kind, stats in window_stats(llm).items():
            if stats["windows"]:
                result[kind] = stats
        return result
    finally:
        # The next mode needs the KV cache's memory back. The engine's parts refer to each
        # other, so only a collection frees it, and only once no local here refers to a part.
        del llm
        gc.collect()
        engine_checks.free_device_memory()


def profile_prefill(llm: LLM, prompts, params, concurrency: int, costs: ModelCosts) -> dict:
    """phase_profile of a prefill-only loop, with each kernel class's TFLOP/s (its FLOPs from
    the loop's own work, over its kernel time): names the weakest of the prefill's kernels."""
    loop = []
    out = phase_profile(lambda: loop.append(engine_checks.prefill_only(
        llm, prompts, params, concurrency, costs)))
    out["tflop_s_by_class"] = ceilings.tflop_s_by_class(
        ceilings.prefill_flops_by_class(costs, loop[0]["work"]), out["kernel_ms_by_class"])
    return out


def window_stats(llm: LLM) -> dict:
    """Round and token windows run, run from a plan made ahead, and chained, over every generate
    of this engine (warm-up included), for each kind the engine has."""
    engine = llm.llm_engine
    return {kind: dict(window.stats)
            for kind, window in (("round_windows", engine._round_window),
                                 ("token_windows", engine._token_window)) if window is not None}


def depth_pairs(workloads: dict) -> dict:
    """Per pair run and mode: e2e_gain, ideal_e2e_gain, pct_of_ideal_e2e (ceilings.depth_pair)."""
    out = {}
    for pair, (base, cheap) in DEPTH_PAIRS.items():
        if base in workloads and cheap in workloads:
            modes = {mode: ceilings.depth_pair(res, workloads[cheap]["modes"].get(mode, {}))
                     for mode, res in workloads[base]["modes"].items()}
            out[pair] = {mode: gain for mode, gain in modes.items() if gain}
    return out


def run_plain(model, spec: dict, prompts) -> dict:
    generate_plain(model, prompts[:1], 4)
    sync = engine_checks.sync
    sync()
    t0 = time.perf_counter()
    generate_plain(model, prompts[:1], 1)
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate_plain(model, prompts[:1], spec["max_tokens"])
    sync()
    full = time.perf_counter() - t0
    decode = (spec["max_tokens"] - 1) / (full - first)
    return {"decode": {"decode_tok_s": round(decode, 2), "mean_executed_rounds":
                       float(model.config.num_rounds)}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--workload", nargs="+", default=["W1"], choices=sorted(WORKLOADS),
                    help="which workloads (default: W1)")
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated, from plain,{','.join(MODES)} (default: "
                         "plain,eager,graph,compile on CUDA; plain,eager elsewhere, where the "
                         "graph modes would time the eager path again)")
    ap.add_argument("--scale", type=positive_scale, default=1.0,
                    help="multiply prompt/output lengths and request counts (CPU smoke runs; "
                         "default: 1.0)")
    add_kv_argument(ap)
    add_spread_argument(ap)
    ap.add_argument("--weight-update", action="store_true")
    ap.add_argument("--bf16-check", action="store_true")
    ap.add_argument("--out", help="also write the JSON here after every workload")
    ap.add_argument("--profile", action="store_true",
                    help="closed-loop workloads: also profile one decode phase and one "
                         "prefill-only loop after the timed figures (GPU kernel time by class, "
                         "the device's idle share, the heaviest kernels: decode_profile, "
                         "prefill_profile)")
    ap.add_argument("--w5-rounds", type=int, default=1,
                    help="W5: timed rounds of the grouped and independent loops, alternating "
                         "(group_speedup: their median, with mean and SE)")
    args = ap.parse_args(argv)
    check_spread(ap, args.prompt_spread)
    if args.w5_rounds < 1:
        ap.error(f"--w5-rounds must be at least 1, got {args.w5_rounds}")
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    modes = (args.modes or ("plain,eager,graph,compile" if cuda else "plain,eager")).split(",")
    unknown = set(modes) - set(MODES) - {"plain"}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")
    if args.device == "cpu":
        torch.set_num_threads(1)
    model = build_model(args)
    cfg = model.config
    costs = ModelCosts.of(model)
    results = {"commit": git_commit(), "argv": sys.argv[1:], "device": args.device, "dtype": args.dtype, "model": args.model or
               f"random:{args.preset}", "workloads": {}}
    if torch.device(args.device).type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    results["copy_bandwidth_gb_s"] = ceilings.copy_bandwidth(args.device)
    results["matmul_tflop_s"] = ceilings.matmul_tflop_s(args.device, model.lm_head.weight.dtype)
    for name in args.workload:
        spec = with_spread(scaled(WORKLOADS[name], args.scale), args.prompt_spread)
        if spec.get("n"):
            spec["rounds"] = args.w5_rounds
        prompts = workload_prompts(spec, cfg.vocab_size)
        params = workload_params(spec, cfg.num_rounds, spec["requests"], cfg.vocab_size)
        entry = {"spec": spec, "modes": {}}
        for mode in modes:
            if mode == "plain" and spec["concurrency"] != 1:
                continue
            try:
                entry["modes"][mode] = (run_plain(model, spec, prompts) if mode == "plain" else
                                        run_mode(model, spec, mode, prompts, params, args.kv_gib,
                                                 costs, args.profile))
            except Exception as err:   # keep the other modes' figures; report the failure
                entry["modes"][mode] = {"error": repr(err)[:500]}
            print(f"{name} {mode:>8}: {json.dumps(entry['modes'][mode])}", flush=True)
        engine_checks.summarize(name, entry, model, spec, results.get("copy_bandwidth_gb_s"))
        ceilings.annotate(entry, costs, spec["concurrency"], results["matmul_tflop_s"],
                          results["copy_bandwidth_gb_s"])
        results["workloads"][name] = entry
        engine_checks.save(results, args.out)
    if "W3" in results["workloads"] and "W4" in results["workloads"]:
        results["w4_gain"] = engine_checks.depth_gain(results["workloads"]["W3"],
                                                      results["workloads"]["W4"], cfg.num_rounds)
    results["depth_pairs"] = depth_pairs(results["workloads"])
    if args.weight_update:
        results["weight_update"] = engine_checks.weight_update(model, args.kv_gib)
    if args.bf16_check:
        results["bf16_vs_fp32"] = engine_checks.bf16_paths(model, args)
    engine_checks.print_table(results)
    engine_checks.save(results, args.out)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
