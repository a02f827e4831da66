"""Issue 17 (W7/W6): does admitting W7's second wave in batches keep its depth savings?

In a W6 closed loop every row of a wave finishes in the same step, so the next 128 prompts are
admitted, and prefilled, together. W7's rows draw their depths, so they finish one or a few at a
time over ~90 round steps; with `round_window_admit` 1 (the default) the loop admits them in
about 58 separate events, each a run of prefill-only steps with all decode rows held and the
window chain broken (count: `--count-only`, which needs no device). Batching admissions (admit
once k slots are free) trades those events for slots left empty meanwhile.

One engine (bench.engine's `graph` mode), its admission threshold set between loops, so every
arm is measured back to back on the same engine and moment:

  1. warm-up, one closed loop per arm, and the decode phases of W6 and W7 (fresh engine);
  2. `--rounds` rounds of one closed loop per arm (W6, and W7 at each `--admit` value), the
     order rotating by round;
  3. the decode phases again (what the loops left behind) and W6's prefill-only loop.

Per arm and round: tok/s, the e2e gain over the round's W6 loop and its share of the ideal
savings (ceilings.depth_pair, the formula of rltlab.bench.paired); per W7 arm, the paired ratio
of its tok/s to the admit-1 arm's in the same round. Last line: JSON.

    python docs/experiments/scripts/w7_admission_h200.py --admit 1 8 32 --rounds 5
"""
import argparse
import gc
import json
import statistics

from tqdm import tqdm

from rltlab.bench import ceilings, engine_checks
from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, decode_phase, make_llm, replay_depths, scaled, \
    warm_up, workload_params


def admission_events(admit: int, concurrency: int = 128, requests: int = 256,
                     window: int = 16) -> dict:
    """A step count, not a timing: W7's closed loop with rows needing their replayed rounds,
    admissions at window boundaries once `admit` slots are free (or the queue's rest fits), a
    window ending where a row finishes. -> admission events, round steps, and slot-steps left
    empty while requests waited."""
    need = [sum(replay_depths(4, 512, seed=i)[1:]) for i in range(requests)]
    queue, running, steps, events, empty = list(range(requests)), {}, 0, 0, 0
    while queue or running:
        free = concurrency - len(running)
        if queue and free >= min(admit, len(queue)):
            for _ in range(min(free, len(queue))):
                i = queue.pop(0)
                running[i] = need[i]
            events += 1
        span = min(min(running.values()), window)
        for i in list(running):
            running[i] -= span
            if running[i] == 0:
                del running[i]
        empty += span * (concurrency - len(running)) if queue else 0
        steps += span
    return {"admit": admit, "admission_events": events, "round_steps": steps,
            "empty_slot_steps": empty}


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--admit", type=int, nargs="+", default=[1, 8, 32],
                    help="round_window_admit values for W7's arms (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="bench.engine's --scale")
    ap.add_argument("--count-only", action="store_true", help="print the step counts only")
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    if min(args.admit) < 1 or args.rounds < 1:
        ap.error("--admit values and --rounds must be >= 1")
    counts = [admission_events(a) for a in args.admit]
    if args.count_only:
        out = {"workload": "W7 closed loop (step count, not a timing)", "counts": counts}
        print(json.dumps(out))
        return out
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
    arms = [("W6", args.admit[0])] + [("W7", a) for a in args.admit]
    name = lambda arm: f"{arm[0]}@{arm[1]}"   # noqa: E731

    def loop(arm) -> dict:
        eng.config.round_window_admit = arm[1]
        return engine_checks.closed_loop(llm, prompts, params[arm[0]], c, costs)[0]

    def decode_phases() -> dict:
        eng.config.round_window_admit = args.admit[0]
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
            rounds.append({name(arm): loop(arm) for arm in order})
            print(r, {k: v["tok_s"] for k, v in rounds[-1].items()}, flush=True)
        after = decode_phases()
        eng.config.round_window_admit = args.admit[0]
        prefill = engine_checks.prefill_only(llm, prompts, params["W6"], c, costs)
    finally:
        del llm, eng
        gc.collect()
        engine_checks.free_device_memory()
    base = name(arms[0])
    result = {"workloads": "W6 / W7 closed loops, 256 requests 128/512 at c=128, greedy",
              "device": args.device, "dtype": args.dtype, "rounds": args.rounds,
              "counts": counts, "arms": {}, "decode_before": {w: d["decode_tok_s"] for w, d in
                                                              before.items()},
              "decode_after": {w: d["decode_tok_s"] for w, d in after.items()}}
    for arm in arms[1:]:
        pairs = [ceilings.depth_pair({"closed_loop": r[base], "decode": before["W6"],
                                      "prefill": prefill},
                                     {"closed_loop": r[name(arm)], "decode": before["W7"]})
                 for r in rounds]
        pcts = [p["pct_of_ideal_e2e"] for p in pairs]
        vs_first = [r[name(arm)]["tok_s"] / r[name(arms[1])]["tok_s"] for r in rounds]
        result["arms"][name(arm)] = {
            "tok_s": [r[name(arm)]["tok_s"] for r in rounds],
            "e2e_gain": [p["e2e_gain"] for p in pairs], "pct_of_ideal_e2e": pcts,
            "ideal_e2e_gain": pairs[0]["ideal_e2e_gain"],
            "median_pct_of_ideal_e2e": round(statistics.median(pcts), 1),
            "mean_pct_of_ideal_e2e": round(statistics.mean(pcts), 1),
            "se_pct_of_ideal_e2e": round(statistics.stdev(pcts) / len(pcts) ** 0.5, 1)
            if len(pcts) > 1 else None,
            "paired_vs_first_admit": round(statistics.median(vs_first), 4)}
    result["arms"][base] = {"tok_s": [r[base]["tok_s"] for r in rounds]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
