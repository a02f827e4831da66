"""A user's first closed loop against the second, with and without LLM.warm_up().

    python -m rltlab.bench.first_loop --preset ouro-1.4b --device cuda --workload W3 W4

Per workload (rltlab.bench.engine's W1-W7) two engines on the same model, one after the other:
  - warmed: LLM(...), llm.warm_up(concurrency=c, prompt_len=the workload's prompt lengths,
    group_size=its samples per prompt: W5's 8), then two closed loops of the workload;
  - cold: LLM(...), then the same two closed loops (what a user without warm_up() gets).
It reports each loop's wall time, `first_over_second` (1.0 = no one-off cost left in the first
loop; the goal is <= 1.05 with the warm-up), the CUDA graphs each loop still captured (and
their host seconds: what the warm-up missed) and the warm-up's own time. No untimed first pass:
that is the point. Last line: JSON.
"""
from __future__ import annotations

import argparse
import gc
import json

from rltlab.bench import engine_checks
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, make_llm, scaled, workload_params, workload_prompts
from rltlab.bench.models import add_kv_argument, add_model_arguments, build_model, positive_scale
from rltlab.common.environment import git_commit
from rltlab.engine.static_decode import graphs_captured

GOAL = 1.05


def two_loops(llm, prompts, params, concurrency: int, costs: ModelCosts) -> dict:
    """Both loops' wall times, and the CUDA graphs each still captured (with the host seconds
    those captures took): what a warm-up missed."""
    walls, captures = [], []
    for _ in range(2):
        with graphs_captured() as captured:
            figures, _ = engine_checks.closed_loop(llm, prompts, params, concurrency, costs)
        walls.append(figures["wall_s"])
        captures.append({"graphs": captured["graphs"],
                         "seconds": round(captured["seconds"], 3)})
    return {"first_wall_s": round(walls[0], 3), "second_wall_s": round(walls[1], 3),
            "first_over_second": round(walls[0] / walls[1], 4),
            "first_captures": captures[0], "second_captures": captures[1]}


def run_workload(model, name: str, scale: float, kv_gib: float) -> dict:
    spec = scaled(WORKLOADS[name], scale)
    costs = ModelCosts.of(model)
    prompts = workload_prompts(spec, model.config.vocab_size)
    params = workload_params(spec, model.config.num_rounds, len(prompts),
                             model.config.vocab_size)
    c = spec["concurrency"]
    out = {"spec": spec}
    for label, warm in (("warmed", True), ("cold", False)):
        cuda = next(model.parameters()).device.type == "cuda"
        llm = make_llm(model, spec, "graph" if cuda else "gather",
                       kv_gib)
        try:
            result = {}
            if warm:
                result["warm_up"] = llm.warm_up(concurrency=c,
                                                prompt_len=sorted({len(p) for p in prompts}),
                                                group_size=spec.get("n", 1), progress=True)
            result.update(two_loops(llm, prompts, params, c, costs))
            out[label] = result
        finally:
            del llm
            gc.collect()
            engine_checks.free_device_memory()
    out["goal_met"] = out["warmed"]["first_over_second"] <= GOAL
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.first_loop",
                                 description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--workload", nargs="+", default=["W3"], choices=sorted(WORKLOADS),
                    help="which workloads (default: W3)")
    ap.add_argument("--scale", type=positive_scale, default=1.0,
                    help="scale the workloads' lengths and counts (e.g. 0.05 on a CPU; default 1.0)")
    add_kv_argument(ap)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    model = build_model(args)
    result = {"bench": "first_loop", "device": args.device, "dtype": str(
        next(model.parameters()).dtype).removeprefix("torch."), "preset": args.preset,
        "model": args.model, "commit": git_commit(), "goal_first_over_second": GOAL,
        "workloads": {w: run_workload(model, w, args.scale, args.kv_gib)
                      for w in args.workload}}
    for name, res in result["workloads"].items():
        warmed = res["warmed"]
        print(f"{name}: warmed {warmed['first_over_second']}x (warm-up "
              f"{warmed['warm_up']['seconds']:.1f} s; the first loop still captured "
              f"{warmed['first_captures']['graphs']} graphs in "
              f"{warmed['first_captures']['seconds']:.2f} s), cold "
              f"{res['cold']['first_over_second']}x")
    if args.out:
        from rltlab.common.atomic import write_json_atomic
        write_json_atomic(args.out, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
