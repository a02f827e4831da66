"""`rltlab rounds`: per-round held-out quality of a checkpoint (default: the embedded model).

Each round r is evaluated at fixed depth r: text loss from the round-r logits, and arithmetic
exact match from greedy generation that exits every token at round r.
"""
from __future__ import annotations

import argparse
import json

from rltlab.common.paths import embedded_model_dir
from rltlab.pretrain.evaluate import evaluate_checkpoint, format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory with eval/ files (default: embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON too")


def main(args: argparse.Namespace) -> int:
    path = args.model or embedded_model_dir()
    metrics = evaluate_checkpoint(path, device=args.device, progress=True)
    print(format_table(metrics))
    exit_dist = metrics["gate_exit_distribution"]
    print("exit-gate p(r), text:      ", [round(p, 3) for p in exit_dist["text_exit_distribution"]])
    print("exit-gate p(r), arithmetic:", [round(p, 3) for p in exit_dist["arith_exit_distribution"]])
    if args.json:
        print(json.dumps(metrics))
    return 0
