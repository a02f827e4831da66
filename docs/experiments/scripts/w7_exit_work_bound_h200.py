"""Issue 17 (W7/W6): what the round windows' per-step exit work costs W7's decode phase, measured
by taking it away (a bound, not an engine mode: the tokens it then emits are wrong).

    python docs/experiments/scripts/w7_exit_work_bound_h200.py

W7 (128 rows, 128-token prompts, 512 greedy tokens each, ignore_eos, replayed depths) schedules
every round step on the host from the replayed depths alone, so the token values never change
what runs. In each round step of a window the rows that exit get their LM head, the engine's
sampler and a finite check (window_io.sample_rows). Three arms, each a decode phase (all 128
requests admitted at once, tok/s over the steps after every row has its first token; the
measure of bench.engine's `decode`), alternating twice on one engine:
  * engine: sample_rows as it is;
  * lm_head_only: the exiting rows' LM head GEMM alone (its output unused), their pending tokens
    re-emitted: what an exit step would cost with sampling and checks free;
  * no_exit_work: the pending tokens re-emitted, no LM head.
Last line: JSON.
"""
import argparse
import json
import statistics

import torch

from rltlab.bench import engine as bench
from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.engine import round_window

ENGINE_SAMPLE_ROWS = round_window.sample_rows


def re_emit(with_lm_head: bool):
    """A sample_rows stand-in: each exiting row's pending token again, finite, log-prob NaN."""
    def sample_rows(engine, hidden, pending, rows, seqs):
        if with_lm_head:
            engine.runner.model.lm_head(hidden.index_select(0, rows))
        tokens = pending.index_select(0, rows)
        return tokens, torch.ones_like(tokens, dtype=torch.bool), torch.full_like(
            tokens, float("nan"), dtype=torch.float32)
    return sample_rows


ARMS = {"engine": ENGINE_SAMPLE_ROWS, "lm_head_only": re_emit(True),
        "no_exit_work": re_emit(False)}


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="bench.engine's --scale (smoke runs)")
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    model = build_model(args)
    costs = ModelCosts.of(model)
    spec = bench.scaled(bench.WORKLOADS["W7"], args.scale)
    cfg = model.config
    prompts = prompts_for(spec["requests"], spec["prompt_len"], cfg.vocab_size, seed=7)
    params = bench.workload_params(spec, cfg.num_rounds, spec["requests"], cfg.vocab_size)
    c = spec["concurrency"]
    llm = bench.make_llm(model, spec, "graph", kv_gib=110.0 if args.device == "cuda" else 1.0)
    bench.warm_up(llm, prompts, params, c)
    results = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm, fn in ARMS.items():
            round_window.sample_rows = fn
            try:
                got = bench.decode_phase(llm, prompts[:c], params[:c], costs)
            finally:
                round_window.sample_rows = ENGINE_SAMPLE_ROWS
            results[arm].append(got["decode_tok_s"])
            print(f"{arm:14s} W7 decode {got['decode_tok_s']:10.2f} tok/s "
                  f"(mean executed rounds {got['mean_executed_rounds']})", flush=True)
    mean = {arm: statistics.mean(tok_s) for arm, tok_s in results.items()}
    out = {"workload": "W7", "dtype": args.dtype, "decode_tok_s": results,
           "gain_without_sampling": round(mean["lm_head_only"] / mean["engine"], 4),
           "gain_without_exit_work": round(mean["no_exit_work"] / mean["engine"], 4)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
