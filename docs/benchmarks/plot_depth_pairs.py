"""Issue 17's depth pairs across sessions: each paired round's share of the ideal end-to-end
savings (W7/W6: 128/512 decode-heavy; W4/W3: 1K/128), with each run's mean and standard error,
from the committed JSON under docs/benchmarks/data/. One H200 per run (machines differ between
runs), Ouro-1.4B shape with random weights, bf16; every run is the engine's default settings
of its day, except the arms marked "eager prefill" (the twelfth session's baseline arm).

    python docs/benchmarks/plot_depth_pairs.py [--out docs/benchmarks/depth_pairs_history.png]

Last line: JSON (per run: file, rounds, mean, SE).
"""
import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

DATA = Path(__file__).parent / "data"
PAIRED_W7 = ("paired_w7_w6", "pairs", "W7/W6", "graph")   # rltlab.bench.paired's JSON
PAIRED_W4 = ("paired_w4_w3", "pairs", "W4/W3", "graph")
# (pair, label, file, the keys down to the dict holding the per-round pct_of_ideal_e2e)
RUNS = [
    ("W7/W6", "s4", "2026-12-02-s4-paired-h200.json", ("W7_W6", "pairs", "W7/W6", "graph")),
    ("W7/W6", "s5", "2026-12-02-s5-call3-h200.json", PAIRED_W7),
    ("W7/W6", "s6", "2026-12-02-s6-call9-h200.json", PAIRED_W7),
    ("W7/W6", "s7", "2026-12-02-s7-call3-h200.json", PAIRED_W7),
    ("W7/W6", "s8 c1", "2026-12-03-s8-call1-h200.json", PAIRED_W7),
    ("W7/W6", "s8 c3", "2026-12-03-s8-call3-h200.json", PAIRED_W7),
    ("W7/W6", "s10", "2026-12-03-s10-call1-h200.json", PAIRED_W7),
    ("W7/W6", "s11 c1", "2026-12-03-s11-call1-h200.json", ("w7_admission", "arms", "W7@1")),
    ("W7/W6", "s11 c4", "2026-12-03-s11-call4-h200.json", ("w7_cudnn", "arms", "W7")),
    ("W7/W6", "s12 c1\neager prefill", "2026-12-03-s12-call1-h200.json", ("w7_arms", "arms", "W7")),
    ("W7/W6", "s12 c1\nprefill graphs", "2026-12-03-s12-call1-h200.json",
     ("w7_arms", "arms", "W7+graphs=4096")),
    ("W7/W6", "s12 c3\nprefill graphs", "2026-12-03-s12-call3-h200.json",
     PAIRED_W7),
    ("W4/W3", "s4", "2026-12-02-s4-paired-h200.json", ("W4_W3", "pairs", "W4/W3", "graph")),
    ("W4/W3", "s12 c2\nprefill graphs", "2026-12-03-s12-call2-h200.json",
     PAIRED_W4),
]


def rounds_of(file: str, keys: tuple[str, ...]) -> list[float]:
    node = json.loads((DATA / file).read_text())
    for key in keys:
        node = node[key]
    return node["pct_of_ideal_e2e"]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "depth_pairs_history.png"))
    args = ap.parse_args()
    table = []
    for pair, label, file, keys in RUNS:
        pcts = rounds_of(file, keys)
        table.append({"pair": pair, "run": label.replace("\n", " "), "file": file,
                      "rounds": len(pcts), "mean": round(statistics.mean(pcts), 1),
                      "se": round(statistics.stdev(pcts) / len(pcts) ** 0.5, 1), "pcts": pcts})
    sns.set_theme(style="whitegrid")
    pairs = sorted({row["pair"] for row in table}, reverse=True)
    fig, axes = plt.subplots(1, len(pairs), figsize=(14, 4.8), sharey=True,
                             gridspec_kw={"width_ratios": [sum(r["pair"] == p for r in table)
                                                           for p in pairs]})
    for ax, pair in zip(axes, pairs):
        rows = [(row, label) for row, (p, label, _, _) in zip(table, RUNS) if p == pair]
        for x, (row, label) in enumerate(rows):
            ax.scatter([x] * len(row["pcts"]), row["pcts"], s=14, alpha=0.45, color="tab:blue")
            ax.errorbar(x, row["mean"], yerr=row["se"], fmt="o", color="black", capsize=4)
        ax.axhline(80, color="tab:red", ls="--", lw=1, label="issue 17's bar: 80%")
        ax.set_xticks(range(len(rows)), [label for _, label in rows], fontsize=8)
        ax.set_title({"W7/W6": "W7/W6 (128/512, decode-heavy)", "W4/W3": "W4/W3 (1K/128)"}[pair])
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("% of the ideal e2e depth savings\n(dots: paired rounds; mean ± SE)")
    fig.suptitle("Depth savings that survive the closed loop, by session: one H200 per run, "
                 "Ouro-1.4B shape (random weights, bf16)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    out = {"plot": args.out, "runs": [{k: v for k, v in row.items() if k != "pcts"}
                                       for row in table]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
