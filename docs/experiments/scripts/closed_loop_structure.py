"""Issue 17: the step structure of a closed loop, on the CPU (tiny preset, fp32).

Runs a workload of rltlab.bench.engine (its concurrency, request count and output length, at a
given prompt length) through the bench's closed loop and counts the engine steps: round windows
(how many rows each ran, for how many round steps) and ordinary round steps (how many carried
decode rows beside prefill chunks). CPU timings mean nothing here; the structure (how many steps
mix decode rows with prefill chunks, how full the windows are) carries over to the GPU.

    python docs/experiments/scripts/closed_loop_structure.py W4 1024 [graph-mixed-prefill]

Last line: JSON.
"""
import collections
import json
import sys
from types import SimpleNamespace

import torch

from rltlab.bench.__main__ import bench_engine, build_model, prompts_for
from rltlab.bench.engine import MODES, WORKLOADS, workload_params
from rltlab.engine import LLM


def main(name: str, prompt_len: int, mode: str) -> dict:
    torch.set_num_threads(1)
    model = build_model(SimpleNamespace(model=None, preset="tiny", device="cpu",
                                        dtype="float32"))
    spec = {**WORKLOADS[name], "prompt_len": prompt_len}
    c = spec["concurrency"]
    prompts = prompts_for(spec["requests"], prompt_len, model.config.vocab_size, 0)
    params = workload_params(spec, model.config.num_rounds, spec["requests"],
                             model.config.vocab_size)
    llm = LLM(model, max_num_seqs=c, max_model_len=prompt_len + spec["max_tokens"],
              max_num_batched_tokens=max(16384, prompt_len + c),
              prefill_chunk=max(512, prompt_len), kv_cache_memory_gib=2.0, **MODES[mode])
    engine = llm.llm_engine
    windows, round_steps = [], []   # (rows, round steps) / (decode rows, prefill rows)
    if engine._round_window is not None:
        window_step = engine._round_window.step

        def count_window(plan):
            windows.append((len(plan.seqs), plan.num_steps))
            return window_step(plan)
        engine._round_window.step = count_window
    execute = engine.runner.execute

    def count_round_step(seqs):
        prefill = sum(1 for s in seqs if s.span.exit_rounds is not None)
        round_steps.append((len(seqs) - prefill, prefill))
        return execute(seqs)
    engine.runner.execute = count_round_step
    bench_engine(llm, prompts, params, c)
    rows_hist = collections.Counter(16 * (rows // 16) for rows, _ in windows)
    return {
        "workload": name, "prompt_len": prompt_len, "mode": mode,
        "windows": len(windows), "window_round_steps": sum(s for _, s in windows),
        "window_row_rounds": sum(r * s for r, s in windows),
        "window_rows_histogram": dict(sorted(rows_hist.items())),
        "round_steps": len(round_steps),
        "round_steps_mixing_decode_and_prefill": sum(1 for d, p in round_steps if d and p),
        "decode_row_rounds_in_round_steps": sum(d for d, _ in round_steps),
    }


if __name__ == "__main__":
    result = main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "graph")
    print(json.dumps(result))
