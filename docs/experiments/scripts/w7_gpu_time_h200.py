"""Issue 17 (W7/W6): where W7's decode phase spends its GPU time, per round, against W6's, from
CUDA events (no profiler: it slowed the host enough to idle the GPU half the time in the fifth
session's profile).

    python docs/experiments/scripts/w7_gpu_time_h200.py

One engine (bench.engine's `graph` mode), W6 and W7 decode phases (128 rows, 128-token prompts,
512 greedy tokens each; W7 at replayed depths) in the order `--sequence` gives (default W6 W7
W6 W7), and closed loops where it says `loop:W6` / `loop:W7` (bench.engine's harness: 256
requests, 128 in flight), measured the same way. Call 3 of the
seventh session ran it at 2520981 and call 1 of the eighth at 66406cd with a `W7-eager` arm,
for greedy step graphs (one captured graph per round step, exits included; reverted both times:
docs/benchmarks/2026-12-02-s7-h200.md, 2026-12-03-s8-h200.md). Events are
recorded on the stream around every window (round windows for W7, token windows for W6) and
around every captured graph inside it (W7: one round per replay; W6: one whole 4-round token),
and around every prefill step (ModelRunner.execute: outside the graphs, one round per step), so
per decode phase or closed loop:
  * wall: host time of the phase (bench.engine.decode_phase's figure) or loop;
  * windows: GPU time inside windows; prefill: inside prefill steps; idle = wall - windows -
    prefill (host turns between them, and the first tokens' sampling after a prefill);
  * round_steps / row_steps: the round windows' steps, and their rows (padding rows included)
    times steps;
  * graphs: GPU time of the round / token graphs; exit = windows - graphs (LM head, sampling,
    embeddings, LAST_EXITED copies, index copies and the gaps between them);
  * per full step (all 128 rows): the graph's time per round, W7's round against W6's token / 4;
  * blocks: the lowest and highest KV block id the phase's rows hold.
Last line: JSON.
"""
import argparse
import json
import statistics
import time

import torch

from rltlab.bench import engine as bench
from rltlab.bench import engine_checks
from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts


class HostEvent:
    """A host clock in place of a CUDA event, for smoke runs on the CPU (whose ops are synchronous)."""

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return 1e3 * (end.at - self.at)


class EventLog:
    """(start, end, (rows, rounds)) event pairs recorded around calls of wrapped methods."""

    def __init__(self, cuda: bool, full_rows: int):
        self.full_rows = full_rows
        self.windows, self.graphs, self.prefills = [], [], []
        self.event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else HostEvent
        self.cuda = cuda

    def wrap(self, obj, name: str, into: list, shape=None):
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start, end = self.event(), self.event()
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            into.append((start, end, shape(*args) if shape else None))
            return out
        setattr(obj, name, timed)

    def summary(self, wall_s: float, prefill_timed: bool) -> dict:
        """prefill_timed: whether the prefill steps fall inside wall_s (closed loops; a decode
        phase's timing starts after them)."""
        if self.cuda:
            torch.cuda.synchronize()
        ms = lambda pairs: sum(s.elapsed_time(e) for s, e, _ in pairs)   # noqa: E731
        windows, graphs, prefills = ms(self.windows), ms(self.graphs), ms(self.prefills)
        full = [(s.elapsed_time(e), shape) for s, e, shape in self.graphs
                if shape[0] == self.full_rows]
        per_round = [t / shape[1] for t, shape in full]
        # round windows' steps (a window's rows, padding included, times its steps)
        round_windows = [shape for _, _, shape in self.windows if shape]
        return {"wall_ms": round(1e3 * wall_s, 1), "windows_ms": round(windows, 1),
                "prefill_ms": round(prefills, 1), "prefill_steps": len(self.prefills),
                "idle_ms": round(1e3 * wall_s - windows - prefill_timed * prefills, 1),
                "graphs_ms": round(graphs, 1),
                "round_steps": sum(steps for _, steps in round_windows),
                "row_steps": sum(rows * steps for rows, steps in round_windows),
                "exit_ms": round(windows - graphs, 1), "windows": len(self.windows),
                "graph_launches": len(self.graphs), "full_launches": len(full),
                "full_round_ms_median": round(statistics.median(per_round), 4) if full else None,
                "full_round_ms_mean": round(statistics.mean(per_round), 4) if full else None}


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--sequence", nargs="+", default=["W6", "W7", "W6", "W7"],
                    help="decode phases (W6, W7) and closed loops (loop:W6, loop:W7) in order")
    ap.add_argument("--scale", type=float, default=1.0, help="bench.engine's --scale")
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    if set(args.sequence) - {"W6", "W7", "loop:W6", "loop:W7"} or \
            not {"W6", "W7"} <= set(args.sequence):
        ap.error("--sequence takes W6, W7, loop:W6 and loop:W7, with at least one W6 and one W7")
    model = build_model(args)
    costs = ModelCosts.of(model)
    cfg = model.config
    specs = {w: bench.scaled(bench.WORKLOADS[w], args.scale) for w in ("W6", "W7")}
    spec = specs["W7"]
    prompts = prompts_for(spec["requests"], spec["prompt_len"], cfg.vocab_size, seed=7)
    params = {w: bench.workload_params(s, cfg.num_rounds, s["requests"], cfg.vocab_size)
              for w, s in specs.items()}
    c = spec["concurrency"]
    llm = bench.make_llm(model, spec, "graph", kv_gib=110.0 if args.device == "cuda" else 1.0)
    eng = llm.llm_engine
    static = eng.runner.static
    for w in specs:
        bench.warm_up(llm, prompts, params[w], c)
        bench.decode_phase(llm, prompts[:c], params[w][:c], costs)   # every bucket once
    results = {w: [] for w in specs}
    for item in args.sequence:
        w = item[len("loop:"):] if item.startswith("loop:") else item
        log = EventLog(args.device == "cuda", c)
        log.wrap(eng._round_window, "_launch", log.windows, lambda plan, _: (len(plan.seqs),
                                                                              plan.num_steps))
        log.wrap(eng._token_window, "_launch", log.windows)
        log.wrap(static, "launch_round", log.graphs, lambda n: (n, 1))
        log.wrap(static, "launch_token", log.graphs, lambda n, depth, hidden: (n, depth))
        log.wrap(eng.runner, "execute", log.prefills, lambda seqs: (len(seqs), 1))
        blocks = []
        log.wrap(eng.block_manager, "allocate", [],
                 lambda seq, *_: blocks.extend(seq.block_table))
        try:
            if item.startswith("loop:"):   # a closed loop: what it leaves behind, and its split
                got, _ = engine_checks.closed_loop(llm, prompts, params[w], c, costs)
                wall_s, row = got["wall_s"], {"tok_s": got["tok_s"]}
            else:
                got = bench.decode_phase(llm, prompts[:c], params[w][:c], costs)
                wall_s = got["decode_tokens"] / got["decode_tok_s"]
                row = {"decode_tok_s": got["decode_tok_s"],
                       "mean_executed_rounds": got["mean_executed_rounds"]}
        finally:
            for obj, name in ((eng._round_window, "_launch"), (eng._token_window, "_launch"),
                              (static, "launch_round"), (static, "launch_token"),
                              (eng.runner, "execute"), (eng.block_manager, "allocate")):
                del obj.__dict__[name]
        row.update(log.summary(wall_s, item.startswith("loop:")),
                   blocks=[min(blocks), max(blocks)] if blocks else None)
        results.setdefault(item, []).append(row)
        print(item, json.dumps(row), flush=True)
    mean = {w: {k: statistics.mean(r[k] for r in results[w]) for k in
                ("full_round_ms_median", "decode_tok_s")} for w in specs}
    out = {"workloads": "W6, W7 decode phases", "dtype": args.dtype, "runs": results,
           "w7_round_over_w6_round": round(mean["W7"]["full_round_ms_median"]
                                           / mean["W6"]["full_round_ms_median"], 4),
           "decode_gain": round(mean["W7"]["decode_tok_s"] / mean["W6"]["decode_tok_s"], 4)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
