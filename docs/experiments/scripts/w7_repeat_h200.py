"""Issue 17: does W7 slow down over repeated closed loops on one engine? In the paired W7/W6
run of 2026-12-02-s4 (call 3) W7's loops fell 10,361 -> 10,189 -> 10,136 -> 9,819 tok/s while
W6's held at ~7,790 until the last. Here W7 alone: one engine (graph mode), a warm-up, then
`--loops` closed loops, each with the GPU's temperature, clocks and power read by nvidia-smi
after it. Last line: JSON.

    python docs/experiments/scripts/w7_repeat_h200.py --loops 6
"""
import json
import subprocess
import sys
from types import SimpleNamespace

from rltlab.bench import engine_checks
from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, make_llm, warm_up, workload_params

QUERY = "temperature.gpu,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"


def gpu_state() -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable: {err!r}"


def main(loops: int) -> dict:
    model = build_model(SimpleNamespace(model=None, preset="ouro-1.4b", device="cuda",
                                        dtype="bfloat16"))
    spec = WORKLOADS["W7"]
    prompts = prompts_for(spec["requests"], spec["prompt_len"], model.config.vocab_size, seed=7)
    params = workload_params(spec, model.config.num_rounds, spec["requests"],
                             model.config.vocab_size)
    costs, c = ModelCosts.of(model), spec["concurrency"]
    llm = make_llm(model, spec, "graph", 110.0)
    warm_up(llm, prompts, params, c)
    runs = []
    for i in range(loops):
        loop, _ = engine_checks.closed_loop(llm, prompts, params, c, costs)
        runs.append({"tok_s": loop["tok_s"], "wall_s": loop["wall_s"], "gpu": gpu_state()})
        print(f"W7 loop {i}: {loop['tok_s']} tok/s; {QUERY}: {runs[-1]['gpu']}", flush=True)
    return {"workload": "W7", "mode": "graph", "loops": runs}


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--loops") + 1]) if "--loops" in sys.argv else 6
    print(json.dumps(main(n)))
