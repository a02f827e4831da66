"""The `rltlab` console command.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `main(args)`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "pretrain": ("rltlab.pretrain.recipe", "train the embedded default model (Stage I + Stage II)"),
    "rounds": ("rltlab.pretrain.rounds",
               "generate with a model and print per-round depth and quality figures"),
    "run": ("rltlab.workbench.runs_cli",
            "execute a workbench notebook with papermill into a run directory"),
    "runs": ("rltlab.workbench.runs_cli",
             "list notebook runs with their status and headline metrics"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only `command`'s module is imported (fast, and one broken
    subcommand cannot take the others down)."""
    parser = argparse.ArgumentParser(prog="rltlab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
