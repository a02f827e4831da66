"""Depth pairs measured paired: the baseline and the cheap workload of a pair (W4/W3, W7/W6)
alternate closed loops on ONE engine, so every gain compares two loops run back to back.

rltlab.bench.engine runs each workload on an engine of its own, one after the other. Their
closed loops then differ by ~1-2% from one engine (and moment) to the next, and a pair's share of
its ideal savings, 100 (gain - 1) / (ideal - 1), magnifies that about tenfold: the same code
gave W4/W3 70.9% and 80.9% in two such runs.
The two workloads of a pair share every engine setting and differ only in their requests' exit
policy, so here, per mode:

  1. one engine; a warm-up and one closed loop of each workload (captures, specialisations);
  2. `loops` rounds of one baseline loop and one cheap loop, the order alternating by round (a
     drift in time then cancels between rounds);
  3. both workloads' decode phase and the baseline's prefill-only loop, for the ideal gain
     (ceilings.depth_pair, the same formula as rltlab.bench.engine).

Each round's e2e_gain and pct_of_ideal_e2e are reported with their median, mean and standard
error (the paired error: rounds are independent) and range, the baseline's prefill-only loop
as prefill_pct_of_matmul, and every loop's tok/s with its % of its ceiling (ceilings.ceiling,
at the matmul rate and copy bandwidth measured at the start of the run). --prompt-spread S:
prompts of mixed lengths (as rltlab.bench.engine). Last line: JSON.

    python -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \\
        --pair W4/W3 W7/W6 --modes graph --loops 5 --out paired.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

from tqdm import tqdm

from rltlab.bench import ceilings, engine_checks
from rltlab.bench.models import add_kv_argument, add_model_arguments, build_model, positive_scale
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import (DEPTH_PAIRS, MODES, WORKLOADS, add_spread_argument,
                                 check_spread, decode_phase, make_llm, scaled, warm_up,
                                 with_spread, workload_params, workload_prompts)
from rltlab.common.environment import git_commit


def run_pair(model, pair: str, mode: str, loops: int, scale: float, kv_gib: float,
             costs: ModelCosts, rates: tuple[float, float], on_round=None,
             spread: float = 0.0) -> dict:
    """rates: (matmul TFLOP/s, copy GB/s) measured in this run, for each loop's % of its
    ceiling (ceilings.ceiling). on_round(partial): called after every round with the rounds so
    far ({"complete": False, "rounds": ...}), so a run stopped early keeps its loops."""
    base_name, cheap_name = DEPTH_PAIRS[pair]
    specs = {name: with_spread(scaled(WORKLOADS[name], scale), spread)
             for name in (base_name, cheap_name)}
    spec = specs[base_name]   # the pair's workloads differ only in the exit policy (replay)
    cfg = model.config
    prompts = workload_prompts(spec, cfg.vocab_size)
    params = {name: workload_params(specs[name], cfg.num_rounds, spec["requests"],
                                    cfg.vocab_size) for name in specs}
    c = spec["concurrency"]

    def figures(loop: dict) -> dict:
        limit = ceilings.ceiling(costs, loop["work"], c, *rates)["ceiling_tok_s"]
        return {"tok_s": loop["tok_s"], "wall_s": loop["wall_s"],
                "pct_of_ceiling": ceilings.pct(loop["tok_s"], limit)}

    llm = make_llm(model, spec, mode, kv_gib)
    try:
        for name in (base_name, cheap_name):
            warm_up(llm, prompts, params[name], c)
            engine_checks.closed_loop(llm, prompts, params[name], c, costs)
        rounds = []
        for i in tqdm(range(loops), desc=f"{pair} {mode}", unit="round"):
            order = (base_name, cheap_name) if i % 2 == 0 else (cheap_name, base_name)
            loop = {name: engine_checks.closed_loop(llm, prompts, params[name], c, costs)[0]
                    for name in order}
            rounds.append(loop)
            if on_round is not None:
                on_round({"complete": False,
                          "rounds": [{name: figures(r[name]) for name in r} for r in rounds]})
        decode = {name: decode_phase(llm, prompts[:c], params[name][:c], costs)
                  for name in (base_name, cheap_name)}
        prefill = engine_checks.prefill_only(llm, prompts, params[base_name], c, costs)
    finally:
        del llm
        gc.collect()
        engine_checks.free_device_memory()
    pairs = [ceilings.depth_pair({"closed_loop": r[base_name], "decode": decode[base_name],
                                  "prefill": prefill},
                                 {"closed_loop": r[cheap_name], "decode": decode[cheap_name]})
             for r in rounds]
    gains = [p["e2e_gain"] for p in pairs]
    pcts = [p["pct_of_ideal_e2e"] for p in pairs]
    prefill_flops = prefill["work"]["prefill_flops"]

    return {"complete": True, "rounds": [{name: figures(r[name]) for name in r} for r in rounds],
            "e2e_gain": gains, "pct_of_ideal_e2e": pcts,
            "ideal_e2e_gain": pairs[0]["ideal_e2e_gain"],
            "median_e2e_gain": round(statistics.median(gains), 3),
            "median_pct_of_ideal_e2e": round(statistics.median(pcts), 1),
            "mean_pct_of_ideal_e2e": round(statistics.mean(pcts), 1),
            # the paired error: rounds are independent pairs of back-to-back loops
            "se_pct_of_ideal_e2e": (round(statistics.stdev(pcts) / len(pcts) ** 0.5, 1)
                                    if len(pcts) > 1 else None),
            "range_pct_of_ideal_e2e": [min(pcts), max(pcts)],
            # the baseline's prefill-only loop at the matmul rate measured in this run
            "prefill_flops": prefill_flops,
            "prefill_pct_of_matmul": ceilings.pct(prefill_flops / prefill["wall_s"] / 1e12,
                                                  rates[0]),
            "decode_gain": pairs[0]["decode_gain"], "prefill_s": pairs[0]["prefill_s"],
            "decode_s": pairs[0]["decode_s"], "base_rounds": pairs[0]["base_rounds"],
            "cheap_rounds": pairs[0]["cheap_rounds"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.paired", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--pair", nargs="+", default=sorted(DEPTH_PAIRS), choices=sorted(DEPTH_PAIRS))
    ap.add_argument("--modes", default="graph", help=f"comma-separated, from {','.join(MODES)}")
    ap.add_argument("--loops", type=int, default=5, help="rounds of (baseline, cheap) loops")
    ap.add_argument("--scale", type=positive_scale, default=1.0,
                    help="multiply prompt/output lengths and request counts (CPU smoke runs)")
    add_kv_argument(ap)
    add_spread_argument(ap)
    ap.add_argument("--out", help="also write the JSON here after every round (a pair's "
                    "figures marked complete: false until its decode phases are in)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    if args.loops < 1:
        ap.error(f"--loops must be >= 1, got {args.loops}")
    check_spread(ap, args.prompt_spread)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = build_model(args)
    costs = ModelCosts.of(model)
    results = {"commit": git_commit(), "argv": sys.argv[1:], "device": args.device, "dtype": args.dtype,
               "model": args.model or f"random:{args.preset}", "loops": args.loops,
               "prompt_spread": args.prompt_spread,
               "copy_bandwidth_gb_s": ceilings.copy_bandwidth(args.device),
               "matmul_tflop_s": ceilings.matmul_tflop_s(args.device, model.lm_head.weight.dtype),
               "pairs": {}}
    rates = (results["matmul_tflop_s"], results["copy_bandwidth_gb_s"])
    for pair in args.pair:
        for mode in modes:
            def keep(partial, pair=pair, mode=mode):
                results["pairs"].setdefault(pair, {})[mode] = partial
                engine_checks.save(results, args.out)
            res = run_pair(model, pair, mode, args.loops, args.scale, args.kv_gib, costs, rates,
                           on_round=keep, spread=args.prompt_spread)
            keep(res)
            base_pcts = [r[DEPTH_PAIRS[pair][0]]["pct_of_ceiling"] for r in res["rounds"]]
            print(f"{pair} end to end ({mode}, {args.loops} paired rounds): median "
                  f"{res['median_e2e_gain']}x of an ideal {res['ideal_e2e_gain']}x = "
                  f"{res['median_pct_of_ideal_e2e']}% of the ideal savings, mean "
                  f"{res['mean_pct_of_ideal_e2e']} +- {res['se_pct_of_ideal_e2e']} (SE) (rounds: "
                  f"{res['range_pct_of_ideal_e2e'][0]}-{res['range_pct_of_ideal_e2e'][1]}%); "
                  f"prefill at {res['prefill_pct_of_matmul']}% of the matmul rate; "
                  f"{DEPTH_PAIRS[pair][0]} at {base_pcts}% of its ceiling", flush=True)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
