"""Issue 16's 2.0x claim on 32 x 32, per machine start and pooled over the starts of each GPU
(twenty-sixth session; starts E-G added in the twenty-seventh, H-O in the twenty-eighth,
whose start I ran a reverted engine and is left out; P and Q in the thirtieth, whose runs
also held the device loop's rows; R and S, H200s, in the
thirty-first, whose S ran the engine with the tree's first leaf in place (6d1c025), twice: S
and S'): the paired ratios
of one config against the fastest target-only row, repeat by repeat, read from the committed
raw data of `python -m rltlab.bench.tree_spec --launch-early` runs
(docs/experiments/scripts/s25_call2_h200.sh).

Each repeat's ratio is the fastest of the four target-only rows' seconds in that repeat over
the config's seconds in it, as the bench's vs_faster is. Pooled: the repeats of every start on
one kind of GPU together (a start's own figures are checked against what the bench wrote).
Ratios are never pooled across GPUs: the baselines' gains differ between them.

Also, per start and workload, what the early launch (EngineConfig.launch_behind_prompt) gains
each row: its seconds without over the same repeat's seconds of its " early" row, checked
against the `derived` section of the raw data.

    python docs/experiments/scripts/claim_32_pooled.py
Last line: JSON.
"""
import argparse
import json
import statistics
from pathlib import Path

from rltlab.bench.tree_spec import FASTER

DATA = Path(__file__).resolve().parents[1] / "data"
RUNS = [("2026-12-05-s25-h100.json", "2", "A", "H100"),
        ("2026-12-05-s25-h100.json", "3", "B", "H100"),
        ("2026-12-05-s26.json", "3", "C", "H100"), ("2026-12-05-s26.json", "5", "D", "H200"),
        ("2026-12-05-s27.json", "2", "E", "H100"), ("2026-12-05-s27.json", "3", "F", "H100"),
        ("2026-12-05-s27.json", "4", "G", "H100"), ("2026-12-05-s28.json", "1", "H", "H100"),
        ("2026-12-05-s28.json", "3", "J", "H100"), ("2026-12-05-s28.json", "4", "K", "H100"),
        ("2026-12-05-s28.json", "5", "L", "H200"), ("2026-12-05-s28.json", "6", "M", "H100"),
        ("2026-12-05-s28.json", "7", "N", "H100"), ("2026-12-05-s28.json", "8", "O", "H100"),
        ("2026-12-06-s30.json", "1", "P", "H100", "claim_32_device_loop"),
        ("2026-12-06-s30.json", "2", "Q", "H100", "claim_32_device_loop"),
        ("2026-12-06-s31.json", "2", "R", "H200"), ("2026-12-06-s31.json", "4", "S", "H200"),
        ("2026-12-06-s31.json", "5", "S'", "H200")]
CONFIG = "engine chain K=4 +lookup10 agree first M=1 compiled gemv<=64 early"


def ratios(rows: dict, config: str) -> tuple[list[float], list[float]]:
    """rows by config name -> (vs the fastest target-only row, vs target only), one ratio per
    repeat."""
    if config not in rows:
        raise SystemExit(f"{config!r} is not a row of this run; rows: {sorted(rows)}")
    seconds = rows[config]["seconds_all"]
    fastest = map(min, *(rows[b]["seconds_all"] for b in FASTER))
    target = rows["target only"]["seconds_all"]
    return [f / s for f, s in zip(fastest, seconds)], [t / s for t, s in zip(target, seconds)]


def early_gains(rows: dict) -> dict[str, list[float]]:
    """rows by config name -> per row without the early launch, its seconds / its early
    row's, per repeat."""
    return {name: [a / b for a, b in zip(row["seconds_all"], rows[name + " early"]["seconds_all"])]
            for name, row in rows.items() if name + " early" in rows}


def describe(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4),
            "mean": round(statistics.mean(values), 4),
            "se": round(statistics.stdev(values) / len(values) ** 0.5, 4),
            "min": round(min(values), 4), "repeats": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG)
    args = parser.parse_args()
    report = {"config": args.config, "starts": {}, "pooled": {}, "early_over_without": {}}
    pooled: dict[str, tuple[list[float], list[float]]] = {}
    for file, call, start, gpu, *named in RUNS:   # the workload: claim_32 unless named
        data = json.loads((DATA / file).read_text())
        runs = {workload: {row["config"]: row for row in result["rows"]}
                for workload, result in data["calls"][call]["results"].items()
                if workload.startswith("claim_")}   # the bench's runs, not the profiles
        for workload, rows in runs.items():
            gains = {name: describe(g) for name, g in early_gains(rows).items()}
            recorded = data["derived"][f"call {call} {workload}"]
            assert all(gains[n]["median"] == recorded[n]["median"] for n in recorded), start
            report["early_over_without"][f"{start} {workload}"] = gains
        rows = runs[named[0] if named else "claim_32"]
        fastest, target = ratios(rows, args.config)
        written = rows[args.config]["vs_faster"]
        assert abs(statistics.median(fastest) - written["median"]) < 1e-9, (start, written)
        entry = {"data": f"{file} call {call}", "gpu": gpu,
                 "vs_fastest": describe(fastest), "vs_target": describe(target)}
        report["starts"][start] = entry
        pooled.setdefault(gpu, ([], []))[0].extend(fastest)
        pooled[gpu][1].extend(target)
        print(f"start {start} ({gpu}): vs fastest {entry['vs_fastest']}  "
              f"vs target only {entry['vs_target']}")
    for gpu, (fastest, target) in pooled.items():
        report["pooled"][gpu] = {"vs_fastest": describe(fastest), "vs_target": describe(target)}
        print(f"pooled {gpu}: vs fastest {report['pooled'][gpu]['vs_fastest']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
