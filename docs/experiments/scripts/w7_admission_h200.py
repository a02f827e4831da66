"""Issue 17 (W7/W6): W7 closed loops under engine settings that change how its prefills run.

In a W6 closed loop every row of a wave finishes in the same step, so the next 128 prompts are
admitted, and prefilled, together. W7's rows draw their depths, so they finish over ~90 round
steps and the loop admits its second wave in several batches (7 with `round_window_admit` 1, the
default: 32 prefill steps of 4 rounds each in the eleventh session's call 2, against W6's 8),
each a run of prefill-only steps with all decode rows held. Would admitting only once k slots
are free (fewer, larger batches) pay for the slots left empty meanwhile? (It did not: 0.86x.)
Those small prefill steps are host-bound (prefill_step_cost_h200.py: ~9 ms for one prompt, and
cuDNN attention's ~0.4 ms of host time per layer once a shape recurs): `cudnn=0|off` arms
(cuDNN for every recurring multi-prompt shape at once / never) measure what cuDNN costs them,
`graphs=N` arms what bucketed prefill graphs (rltlab.engine.prefill_graphs) save, and
`whole=0|1` arms whole-prompt steps (rltlab.engine.prompt_step: a step of fresh prompts runs
their 4 rounds at once; EngineConfig.whole_prompt_steps, on by default since 2026-12-04).
The call-1 JSON also holds a host-side step count that assumed windows end at every finish
(58 admission events); the engine's windows do not (round_window.py), so it was dropped.

One engine (bench.engine's `graph` mode), its settings changed between loops, so every arm is
measured back to back on the same engine and moment:

  1. warm-up, one closed loop per arm, and the decode phases of W6 and W7 (fresh engine);
  2. `--rounds` rounds of one closed loop per arm (W6 at the defaults, and each `--arms` W7),
     the order rotating by round;
  3. the decode phases again (what the loops left behind) and W6's prefill-only loop.

Per arm and round: tok/s, the e2e gain over the round's W6 loop and its share of the ideal
savings (ceilings.depth_pair, the formula of rltlab.bench.paired); per W7 arm, the paired ratio
of its tok/s to the first W7 arm's in the same round. Last line: JSON.

    python docs/experiments/scripts/w7_admission_h200.py --arms W7 W7+admit=8 W7+admit=32
    python docs/experiments/scripts/w7_admission_h200.py --arms W7 W7+cudnn=0 W7+cudnn=off
    python docs/experiments/scripts/w7_admission_h200.py --arms W7 W7+graphs=4096
    python docs/experiments/scripts/w7_admission_h200.py --arms W7+graphs=4096 \
        W7+graphs=4096+whole=0
"""
import argparse
import gc
import json
import statistics

from tqdm import tqdm

from rltlab.bench import ceilings, engine_checks
from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, decode_phase, make_llm, scaled, warm_up, workload_params
from rltlab.engine.prefill_graphs import PrefillGraphs
from rltlab.engine.prompt_step import WholePrompts


# EngineConfig's round_window_admit, cudnn_prefill_after, prefill_graph_tokens and
# whole_prompt_steps
DEFAULTS = {"admit": 1, "cudnn": 16, "graphs": 0, "whole": 1}


def parse_arm(arm: str) -> dict:
    """'W7+admit=8+cudnn=off' -> {"admit": 8, "cudnn": None, "graphs": 0, "whole": 1}: the
    defaults where the arm names none."""
    head, *items = arm.split("+")
    if head != "W7":
        raise ValueError(f"arm {arm!r}: arms are W7 with settings (W6 always runs)")
    values = dict(DEFAULTS)
    for item in items:
        key, _, value = item.partition("=")
        if key not in values or not (value == "off" and key == "cudnn" or value.isdigit()):
            raise ValueError(f"arm {arm!r}: expected admit=K (K >= 1), cudnn=K|off, "
                             f"graphs=N or whole=0|1, got {item!r}")
        values[key] = None if value == "off" else int(value)
    if values["admit"] < 1 or values["whole"] not in (0, 1):
        raise ValueError(f"arm {arm!r}: admit must be >= 1 and whole 0 or 1")
    return values


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--arms", nargs="+", default=["W7", "W7+admit=8", "W7+admit=32"],
                    help="W7 arms (the first is the reference), each W7 with settings after "
                         "'+': admit=K (round_window_admit), cudnn=K|off (the prefill's "
                         "cudnn_after), graphs=N (prefill_graph_tokens), whole=0|1 "
                         "(whole_prompt_steps); W6 runs at the defaults")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="bench.engine's --scale")
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    try:
        settings = {arm: parse_arm(arm) for arm in args.arms}
    except ValueError as err:
        ap.error(str(err))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    model = build_model(args)
    costs = ModelCosts.of(model)
    specs = {w: scaled(WORKLOADS[w], args.scale) for w in ("W6", "W7")}
    spec, cfg = specs["W6"], model.config
    prompts = prompts_for(spec["requests"], spec["prompt_len"], cfg.vocab_size, seed=7)
    params = {w: workload_params(s, cfg.num_rounds, s["requests"], cfg.vocab_size)
              for w, s in specs.items()}
    c = spec["concurrency"]
    llm = make_llm(model, spec, "graph", kv_gib=110.0 if args.device == "cuda" else 1.0)
    eng = llm.llm_engine
    arms = ["W6"] + args.arms
    settings["W6"] = DEFAULTS

    graphs = {}   # one PrefillGraphs per size, so an arm keeps its captured buckets
    whole_prompts = eng._whole_prompts or WholePrompts(eng)

    def apply(values: dict) -> None:
        eng.config.round_window_admit = values["admit"]
        eng.runner.prefill.cudnn_after = values["cudnn"]
        n = values["graphs"]
        if n and n not in graphs:
            graphs[n] = PrefillGraphs(eng.runner.prefill, n)
        eng.runner.prefill_graphs = graphs.get(n)
        eng._whole_prompts = whole_prompts if values["whole"] else None

    def loop(arm) -> dict:
        apply(settings[arm])
        return engine_checks.closed_loop(llm, prompts, params[arm[:2]], c, costs)[0]

    def decode_phases() -> dict:
        apply(DEFAULTS)
        return {w: decode_phase(llm, prompts[:c], params[w][:c], costs) for w in specs}

    try:
        for w in specs:
            warm_up(llm, prompts, params[w], c)
        for arm in arms:
            loop(arm)
        before = decode_phases()
        rounds = []
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            rounds.append({arm: loop(arm) for arm in order})
            print(r, {k: v["tok_s"] for k, v in rounds[-1].items()}, flush=True)
        after = decode_phases()
        prefill = engine_checks.prefill_only(llm, prompts, params["W6"], c, costs)
    finally:
        del llm, eng
        gc.collect()
        engine_checks.free_device_memory()
    base = arms[0]
    result = {"workloads": "W6 / W7 closed loops, 256 requests 128/512 at c=128, greedy",
              "device": args.device, "dtype": args.dtype, "rounds": args.rounds,
              "arms": {}, "prefill_graphs": {n: dict(g.stats, buckets=sorted(g.buckets))
                                             for n, g in graphs.items()},
              "decode_before": {w: d["decode_tok_s"] for w, d in
                                                              before.items()},
              "decode_after": {w: d["decode_tok_s"] for w, d in after.items()}}
    for arm in arms[1:]:
        pairs = [ceilings.depth_pair({"closed_loop": r[base], "decode": before["W6"],
                                      "prefill": prefill},
                                     {"closed_loop": r[arm], "decode": before["W7"]})
                 for r in rounds]
        pcts = [p["pct_of_ideal_e2e"] for p in pairs]
        vs_first = [r[arm]["tok_s"] / r[arms[1]]["tok_s"] for r in rounds]
        result["arms"][arm] = {
            "tok_s": [r[arm]["tok_s"] for r in rounds],
            "e2e_gain": [p["e2e_gain"] for p in pairs], "pct_of_ideal_e2e": pcts,
            "ideal_e2e_gain": pairs[0]["ideal_e2e_gain"],
            "median_pct_of_ideal_e2e": round(statistics.median(pcts), 1),
            "mean_pct_of_ideal_e2e": round(statistics.mean(pcts), 1),
            "se_pct_of_ideal_e2e": round(statistics.stdev(pcts) / len(pcts) ** 0.5, 1)
            if len(pcts) > 1 else None,
            "paired_vs_first_arm": round(statistics.median(vs_first), 4)}
    result["arms"][base] = {"tok_s": [r[base]["tok_s"] for r in rounds]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
