"""`rltlab rounds`: per-round held-out quality of a checkpoint (default: the embedded model).

Each round r is evaluated at fixed depth r: text and unseen-code loss from the round-r logits,
word-problem and k-hop exact match from greedy generation that exits every token at round r,
and the oracle exit depth of every answer token (rltlab.pretrain.evaluate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rltlab.common.device import device_problem
from rltlab.common.paths import embedded_model_dir
from rltlab.pretrain.evaluate import evaluate_checkpoint, format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory with eval/ files (default: embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON too")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="also save the per-round figure as DIR/rounds.png and .svg")


def main(args: argparse.Namespace) -> int:
    """-> 0, or 2 after one "error: ..." line where the device or the checkpoint is unusable
    (nothing is evaluated then)."""
    problem = device_problem(args.device)
    if problem is None:
        path = args.model or embedded_model_dir()
        try:
            metrics = evaluate_checkpoint(path, device=args.device, progress=True)
        except FileNotFoundError as err:   # no checkpoint there, or one missing its files
            problem = str(err)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(format_table(metrics))
    for name, dist in metrics["gate_exit_distribution"].items():
        print(f"exit-gate p(r), {name}:".ljust(24), [round(p, 3) for p in dist])
    if args.plot:
        print("figure:", ", ".join(map(str, plot_rounds(metrics, args.plot))))
    if args.json:
        print(json.dumps(metrics))
    return 0


def plot_rounds(metrics: dict, out_dir: str | os.PathLike, stem: str = "rounds") -> list[Path]:
    """Per-round held-out figures of a checkpoint (rltlab.pretrain.evaluate's metrics): loss per
    round (text, unseen code, ...), exact match per round (word problems, k-hop), and k-hop
    exact match per round for each k."""
    import pandas as pd
    import seaborn as sns

    from rltlab.common.figures import plt, save_figure
    rounds = pd.DataFrame(metrics["rounds"])
    losses = [c for c in ("text_loss", "code_loss", "arith_loss", "hops_loss") if c in rounds]
    ems = [c for c in ("arith_exact_match", "hops_exact_match") if c in rounds]
    panels = 2 + ("hops_by_k" in metrics)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    long = rounds.melt(id_vars="round", value_vars=losses, var_name="set", value_name="loss")
    sns.lineplot(long, x="round", y="loss", hue="set", marker="o", ax=axes[0])
    axes[0].set(yscale="log", ylabel="nats/token (log)", title="held-out loss at fixed depth")
    long = rounds.melt(id_vars="round", value_vars=ems, var_name="task", value_name="em")
    long["em"] *= 100
    sns.lineplot(long, x="round", y="em", hue="task", marker="o", ax=axes[1])
    axes[1].set(ylabel="exact match (%)", ylim=(0, 100), title="greedy exact match")
    if "hops_by_k" in metrics:
        grid = pd.DataFrame({int(k): v["exact_match"] for k, v in metrics["hops_by_k"].items()},
                            index=[r["round"] for r in metrics["rounds"]]) * 100
        sns.heatmap(grid, annot=True, fmt=".0f", cmap="viridis", vmin=0, vmax=100, ax=axes[2],
                    cbar_kws={"label": "exact match (%)"})
        axes[2].set(xlabel="k (hops)", ylabel="round", title="k-hop exact match by k")
    for ax in axes[:2]:
        ax.set_xticks(rounds["round"])
    return save_figure(fig, out_dir, stem)
