"""How well rltlab.bench.tree_sim's replay and cost model match measured H200 figures.

The twenty-first session's calls 3 and 4 (docs/experiments/data/2026-12-04-s21-h200.json) ran
chain K = 4 + lookup, always and adaptive by hits, with the heads before (lookahead_h4 at
fb18e5a) and the shipped ones, paired against target only in one process. For each of those
configs: the H200's tau beside the replayed one, and the measured paired ratio beside the cost
model's, against target only and against the same config with the other heads.

The model's program costs (CostModel.program_at_5 / program_at_16) are fitted here: call 4's
32 x 32 rows with the shipped heads, always (16 rows a program) and adaptive (16 or 5), give
two equations, time - prompt steps = sum of the programs' costs. target_token comes from each
workload's target-only time. The fitted rows match up to the gap between a median of
per-repeat ratios and a ratio of medians; the others test the model.

    python docs/experiments/scripts/tree_sim_validation.py
Last line: JSON.
"""
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from rltlab.bench import tree_sim
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import TreeProposer
from rltlab.model.checkpoint import load_model

DATA = "docs/experiments/data/2026-12-04-s21-h200.json"
OLD_HEADS = "fb18e5a"   # the commit holding the heads before the twenty-first session's
FIT = ("4", "bench_32x32", "engine chain K=4 +lookup10 heads=heads_v2 M=1 compiled gemv<=64",
       "engine chain K=4 +lookup10 adaptive heads=heads_v2 M=1 compiled gemv<=64")


def old_heads(directory: Path) -> Path:
    for name in ("heads.safetensors", "lookahead.json"):
        blob = subprocess.run(["git", "show", f"{OLD_HEADS}:{HEADS}/{name}"], check=True,
                              capture_output=True).stdout
        (directory / name).write_bytes(blob)
    return directory


def _weights(per_request) -> tuple[float, float]:
    """(sum of 1 - w, sum of w) over the programs, w = (rows - 5) / 11: a config's time is
    a * program_at_5 + b * program_at_16 (CostModel.program_ms)."""
    w = [(it.rows - 5) / 11 for its in per_request for it in its]
    return len(w) - sum(w), sum(w)


def main() -> dict:
    torch.set_num_threads(2)
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    data = json.loads(Path(DATA).read_text())
    chain = [(0,) * j for j in range(1, 5)]
    with tempfile.TemporaryDirectory() as tmp:
        heads = {"old": lookahead.load(old_heads(Path(tmp)), model)[0],
                 "new": lookahead.load(HEADS, model)[0]}
    prompt_step = tree_sim.CostModel.prompt_step
    rollouts, runs = {}, []
    for call, bench in (("3", "bench_32x32"), ("4", "bench_32x32"), ("4", "bench_16x128")):
        result = data["calls"][call]["results"][bench]
        prompts, max_tokens = result["prompts"], result["max_tokens"]
        for row in result["rows"]:
            measured = statistics.median(row["seconds_all"]) * 1000
            if row.get("tau") is None:
                if row["config"] == "target only":
                    target = (call, bench, measured)
                continue
            which = "new" if "heads=" in row["config"] else "old"
            key = (which, prompts, max_tokens)
            if key not in rollouts:
                rollouts[key] = tree_sim.record(model, heads[which],
                                                eval_prompts(tok, model_dir, prompts),
                                                max_tokens, model.config.eos_token_id)
            lookup = int(row["config"].split("+lookup")[1].split()[0])
            proposer = TreeProposer(heads[which], chain, lookup=lookup,
                                    adaptive_lookup=" adaptive" in row["config"])
            runs.append({"call": call, "bench": bench, "row": row, "rollouts": rollouts[key],
                         "measured_ms": measured, "target_ms": target[2],
                         "per_request": [tree_sim.replay(r, proposer, max_tokens)
                                         for r in rollouts[key]]})
    # the fit: two configs, two unknowns
    fit = [next(r for r in runs if (r["call"], r["bench"], r["row"]["config"]) ==
                (FIT[0], FIT[1], name)) for name in FIT[2:]]
    system = torch.tensor([_weights(r["per_request"]) for r in fit], dtype=torch.float64)
    rhs = torch.tensor([r["measured_ms"] - len(r["rollouts"]) * prompt_step for r in fit],
                       dtype=torch.float64)
    at_5, at_16 = torch.linalg.solve(system, rhs).tolist()
    out = {"data": DATA, "fitted": {"program_at_5": at_5, "program_at_16": at_16,
                                    "on": list(FIT)}, "target_token": {}, "rows": []}
    for r in runs:
        rolls, decoded = r["rollouts"], sum(x.end - 1 for x in r["rollouts"])
        token = (r["target_ms"] - len(rolls) * prompt_step) / decoded
        out["target_token"][f"call {r['call']} {r['bench'][6:]}"] = token
        cost = tree_sim.CostModel(program_at_5=at_5, program_at_16=at_16, target_token=token)
        replayed = tree_sim.summary(r["per_request"], rolls, cost)
        r["model_ms"] = replayed["model_tree_ms"]
        out["rows"].append({"call": r["call"], "workload": r["bench"][6:],
                            "config": r["row"]["config"], "fitted": r in fit,
                            "tau_h200": r["row"]["tau"], "tau_replayed": replayed["tau"],
                            "vs_target_h200": r["row"]["paired_speedup"],
                            "vs_target_model": replayed["model_ratio"]})
    for r, entry in zip(runs, out["rows"]):   # against the same config with the other heads
        name = r["row"]["config"]
        other_name = name.replace(" heads=heads_v2", "") if "heads=" in name else \
            name.replace(" M=1", " heads=heads_v2 M=1")
        other = next(o for o in runs if (o["call"], o["bench"], o["row"]["config"]) ==
                     (r["call"], r["bench"], other_name))
        entry["vs_other_heads_h200"] = statistics.median(
            t / m for m, t in zip(r["row"]["seconds_all"], other["row"]["seconds_all"]))
        entry["vs_other_heads_model"] = other["model_ms"] / r["model_ms"]
    print(f"fitted: program_at_5 {at_5:.3f} ms, program_at_16 {at_16:.3f} ms")
    for e in out["rows"]:
        print(f"call {e['call']} {e['workload']:>6} {e['config'][13:-22]:>38}"
              f"{' (fitted)' * e['fitted']}: tau {e['tau_h200']:.3f} / {e['tau_replayed']:.3f}, "
              f"vs target {e['vs_target_h200']:.3f} / model {e['vs_target_model']:.3f}, vs other "
              f"heads {e['vs_other_heads_h200']:.3f} / model {e['vs_other_heads_model']:.3f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
