"""The main job on two devices: do a CPU run and a GPU run of notebook 10 (both fp32, the same
seeds) generate the same greedy tokens, and do their quality figures agree?

    rltlab run 10_rollout_update_evaluate --run-dir cpu_run -p DEVICE cpu
    rltlab run 10_rollout_update_evaluate --run-dir gpu_run -p DEVICE cuda -p DTYPE float32
    python -m rltlab.bench.device_parity cpu_run gpu_run --out parity.json

- Greedy tokens: every version-0 evaluation row (the stock model, before any update) carries a
  digest of all its generated tokens (tokens_sha256); the two runs' digests must be equal.
- Quality: every evaluation row both runs hold (each iteration's "before" and "after") is
  compared problem by problem: the paired difference in exact match (pp) and its SE. Rollouts
  sample, and the two devices draw different random streams, so after the first update the
  weights differ; there the rows should agree within 2 paired SE, not exactly.
- The headline figures of both runs side by side.
Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rltlab.common.atomic import write_json_atomic
from rltlab.eval.metrics import paired_difference

Z = 2.0   # "within their paired SE": |difference| <= Z paired SE


def _results(run_dir: Path) -> list[dict]:
    files = sorted(run_dir.glob("iter_*/result.json"), key=lambda p: int(p.parent.name[5:]))
    if not files:
        raise SystemExit(f"{run_dir}: no iter_*/result.json (not a finished notebook-10 run)")
    return [json.loads(f.read_text()) for f in files]


def _evaluations(results: list[dict]) -> dict[str, tuple[dict, list[float]]]:
    """key -> (row, per-problem scores) of every evaluation in the run."""
    found = {}
    for res in results:
        for stage in ("before", "after"):
            ev = res.get(stage) or {}
            for row in ev.get("rows", []):
                if row["key"] in ev.get("scores", {}):
                    found[row["key"]] = (row, ev["scores"][row["key"]])
    return found


def compare(base_dir: Path, other_dir: Path) -> dict:
    base, other = _evaluations(_results(base_dir)), _evaluations(_results(other_dir))
    rows = []
    for key in sorted(set(base) & set(other)):
        (row_a, scores_a), (row_b, scores_b) = base[key], other[key]
        paired = paired_difference(scores_b, scores_a)   # the other run minus the base run
        diff, se = 100 * paired.diff, 100 * paired.se
        same_tokens = (row_a.get("tokens_sha256") is not None
                       and row_a.get("tokens_sha256") == row_b.get("tokens_sha256"))
        rows.append({"key": key, "weight_version": row_a.get("weight_version"),
                     "quality": [row_a["quality"], row_b["quality"]],
                     "diff_pp": diff, "paired_se_pp": se,
                     "agree": diff == 0 or abs(diff) <= Z * se,
                     "same_tokens": same_tokens,
                     "devices": [row_a.get("device"), row_b.get("device")]})
    greedy_v0 = [r for r in rows if r["weight_version"] == 0]
    head_a = json.loads((base_dir / "metrics.json").read_text()).get("headline", {})
    head_b = json.loads((other_dir / "metrics.json").read_text()).get("headline", {})
    return {"bench": "device_parity", "runs": [str(base_dir), str(other_dir)],
            "greedy_v0_rows": len(greedy_v0),
            "greedy_v0_identical_tokens": bool(greedy_v0) and all(r["same_tokens"]
                                                                  for r in greedy_v0),
            "rows_compared": len(rows), "rows_agree": sum(r["agree"] for r in rows),
            "all_agree": all(r["agree"] for r in rows), "rows": rows,
            "headline": {k: [head_a.get(k), head_b.get(k)]
                         for k in sorted(set(head_a) | set(head_b))
                         if isinstance(head_a.get(k), (int, float))
                         or isinstance(head_b.get(k), (int, float))}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.device_parity",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("base_run", help="a notebook-10 run directory (the CPU run)")
    ap.add_argument("other_run", help="the same job on the other device")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    for d in (args.base_run, args.other_run):
        if not (Path(d) / "metrics.json").is_file():
            ap.error(f"{d}: no metrics.json (not a finished run directory)")
    result = compare(Path(args.base_run), Path(args.other_run))
    for r in result["rows"]:
        print(f"{r['key']:<32} {r['quality'][0]:6.1f} {r['quality'][1]:6.1f}  "
              f"diff {r['diff_pp']:+6.2f} +- {r['paired_se_pp']:.2f} pp  "
              f"{'agree' if r['agree'] else 'DIFFER'}"
              + ("  same tokens" if r["same_tokens"] else ""))
    if args.out:
        write_json_atomic(Path(args.out), result)
    print(json.dumps(result, default=lambda x: None if isinstance(x, float) and math.isnan(x)
                     else str(x)))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_agree"] else 1)
