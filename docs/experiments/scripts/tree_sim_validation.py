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

The twenty-fourth session's call 2 (docs/experiments/data/2026-12-05-s24-h200.json, another
machine start, the heads shipped since b78d723) then tests the fitted model on every lookup
rule, with and without first drafts, on 32 x 32, 16 x 128 and 128 x 32. Each set of heads is
read from the commit that shipped it, so that the script means the same after the next.

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
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import TreeProposer
from rltlab.model.checkpoint import load_model

DATA = "docs/experiments/data/2026-12-04-s21-h200.json"
DATA_S24 = "docs/experiments/data/2026-12-05-s24-h200.json"
SHIPPED = "artifacts/ouro-tiny/draft_heads/lookahead_h4"
# the commits holding each set of heads: before the twenty-first session's, its heads_v2, and
# the twenty-fourth session's heads_v3
HEADS_AT = {"old": "fb18e5a", "new": "6f9b872", "v3": "b78d723"}
FIT = ("4", "bench_32x32", "engine chain K=4 +lookup10 heads=heads_v2 M=1 compiled gemv<=64",
       "engine chain K=4 +lookup10 adaptive heads=heads_v2 M=1 compiled gemv<=64")
RULES = {" adaptive": "hits", " agree": "agree"}


def heads_at(commit: str, directory: Path) -> Path:
    for name in ("heads.safetensors", "lookahead.json"):
        blob = subprocess.run(["git", "show", f"{commit}:{SHIPPED}/{name}"], check=True,
                              capture_output=True).stdout
        (directory / name).write_bytes(blob)
    return directory


def proposer_of(heads, config: str) -> TreeProposer:
    """The TreeProposer a bench row's name describes (chain K = 4)."""
    lookup = int(config.split("+lookup")[1].split()[0])
    rule = next((rule for tag, rule in RULES.items() if tag in config), False)
    return TreeProposer(heads, [(0,) * j for j in range(1, 5)], lookup=lookup,
                        adaptive_lookup=rule, first_drafts=" first " in config)


def _weights(per_request) -> tuple[float, float]:
    """(sum of 1 - w, sum of w) over the programs, w = (rows - 5) / 11: a config's time is
    a * program_at_5 + b * program_at_16 (CostModel.program_ms)."""
    w = [(it.rows - 5) / 11 for its in per_request for it in its]
    return len(w) - sum(w), sum(w)


def main() -> dict:
    torch.set_num_threads(2)
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    data = json.loads(Path(DATA).read_text())
    heads = {}
    for key, commit in HEADS_AT.items():
        with tempfile.TemporaryDirectory() as tmp:
            heads[key] = lookahead.load(heads_at(commit, Path(tmp)), model)[0]
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
            proposer = proposer_of(heads[which], row["config"])
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
    out["s24"] = _s24_rows(model, tok, model_dir, heads["v3"], at_5, at_16)
    print(f"fitted: program_at_5 {at_5:.3f} ms, program_at_16 {at_16:.3f} ms")
    for e in out["rows"]:
        print(f"call {e['call']} {e['workload']:>6} {e['config'][13:-22]:>38}"
              f"{' (fitted)' * e['fitted']}: tau {e['tau_h200']:.3f} / {e['tau_replayed']:.3f}, "
              f"vs target {e['vs_target_h200']:.3f} / model {e['vs_target_model']:.3f}, vs other "
              f"heads {e['vs_other_heads_h200']:.3f} / model {e['vs_other_heads_model']:.3f}")
    for e in out["s24"]:
        print(f"s24 call 2 {e['workload']:>6} {e['config'][13:-22]:>38}: tau "
              f"{e['tau_h200']:.3f} / {e['tau_replayed']:.3f}, vs target "
              f"{e['vs_target_h200']:.3f} / model {e['vs_target_model']:.3f} "
              f"({e['vs_target_model'] / e['vs_target_h200'] - 1:+.1%}), refit "
              f"{e['vs_target_refit']:.3f} ({e['vs_target_refit'] / e['vs_target_h200'] - 1:+.1%})"
              f"{' (fitted)' * e['fitted']}")
    refit = out["s24"][0]["refit"]
    print(f"refit on s24 call 2: program_at_5 {refit['program_at_5']:.3f} ms, program_at_16 "
          f"{refit['program_at_16']:.3f} ms")
    print(json.dumps(out))
    return out


def _s24_rows(model, tok, model_dir, heads, at_5: float, at_16: float) -> list[dict]:
    """The twenty-fourth session's call 2 (another machine start, heads_v3) beside the model
    fitted above, target_token from each workload's own target-only row."""
    rows = []
    for bench, result in json.loads(Path(DATA_S24).read_text())["calls"]["2"]["results"].items():
        prompts, max_tokens = result["prompts"], result["max_tokens"]
        rollouts = tree_sim.record(model, heads, eval_prompts(tok, model_dir, prompts),
                                   max_tokens, model.config.eos_token_id)
        target = next(r for r in result["rows"] if r["config"] == "target only")
        decoded = sum(x.end - 1 for x in rollouts)
        token = (statistics.median(target["seconds_all"]) * 1000 -
                 len(rollouts) * tree_sim.CostModel.prompt_step) / decoded
        cost = tree_sim.CostModel(program_at_5=at_5, program_at_16=at_16, target_token=token)
        for row in result["rows"]:
            if row.get("tau") is None:
                continue
            per_request = [tree_sim.replay(r, proposer_of(heads, row["config"]), max_tokens)
                           for r in rollouts]
            replayed = tree_sim.summary(per_request, rollouts, cost)
            rows.append({"workload": bench.split("_")[1], "config": row["config"],
                         "target_token_ms": token, "tau_h200": row["tau"],
                         "tau_replayed": replayed["tau"],
                         "vs_target_h200": row["paired_speedup"],
                         "vs_target_model": replayed["model_ratio"],
                         "measured_ms": statistics.median(row["seconds_all"]) * 1000,
                         "per_request": per_request, "rollouts": rollouts, "cost": cost})
    return _refit(rows, ("engine chain K=4 +lookup10 M=1 compiled gemv<=64",
                         "engine chain K=4 +lookup10 agree M=1 compiled gemv<=64"))


def _refit(rows: list[dict], names) -> list[dict]:
    """The program costs fitted again, to two of these 32 x 32 rows (this machine start's),
    and every row's model ratio with them ("vs_target_refit")."""
    fit = [next(r for r in rows if r["workload"] == "32" and r["config"] == n) for n in names]
    system = torch.tensor([_weights(r["per_request"]) for r in fit], dtype=torch.float64)
    rhs = torch.tensor([r["measured_ms"] - len(r["rollouts"]) * tree_sim.CostModel.prompt_step
                        for r in fit], dtype=torch.float64)
    at_5, at_16 = torch.linalg.solve(system, rhs).tolist()
    for r in rows:
        cost = tree_sim.CostModel(program_at_5=at_5, program_at_16=at_16,
                                  target_token=r["cost"].target_token)
        r.update(vs_target_refit=tree_sim.summary(r.pop("per_request"), r.pop("rollouts"),
                                                  cost)["model_ratio"],
                 refit={"program_at_5": at_5, "program_at_16": at_16}, fitted=r in fit)
        del r["cost"]
    return rows


if __name__ == "__main__":
    main()
