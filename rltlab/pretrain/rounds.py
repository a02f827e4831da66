"""`rltlab rounds`: per-round held-out quality of a checkpoint (default: the embedded model).

Each round r is evaluated at fixed depth r: text and unseen-code loss from the round-r logits,
word-problem and k-hop exact match from greedy generation that exits every token at round r,
and the oracle exit depth of every answer token (rltlab.pretrain.evaluate).
"""
from __future__ import annotations

import argparse
import json
import sys

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
        from rltlab.eval.plots import plot_rounds
        print("figure:", ", ".join(map(str, plot_rounds(metrics, args.plot))))
    if args.json:
        print(json.dumps(metrics))
    return 0
