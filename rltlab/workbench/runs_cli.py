"""`rltlab run NOTEBOOK [-p key value ...]` and `rltlab runs` (list runs with headline metrics).

Both subcommands live here; cli.py registers this module under both names, and the subparser's
name (its prog's last word, and args.command at run time) picks which arguments and which action.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rltlab.workbench import runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    if parser.prog.split()[-1] == "runs":
        parser.add_argument("--root", default=None,
                            help="runs directory (default artifacts/runs or $RLTLAB_RUNS_DIR)")
        parser.add_argument("--all-metrics", action="store_true",
                            help="print every headline metric instead of the first few")
        return
    parser.add_argument("notebook", metavar="NOTEBOOK",
                        help="a notebook path or a short name (10, 10_rollout_update_evaluate)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                        metavar=("KEY", "VALUE"),
                        help="set a notebook parameter (repeatable); the value is converted to "
                             "the type of the default in the notebook's parameters cell")
    parser.add_argument("--run-dir", default=None,
                        help="run directory; an existing one is resumed with the same RUN_DIR")
    parser.add_argument("--start-over", action="store_true",
                        help="with an existing --run-dir: delete what earlier executions left "
                             "in it (finished iterations, traces, metrics; run.json's history "
                             "stays) and run with the notebook's defaults plus -p values")
    parser.add_argument("--name", default=None,
                        help="run name (default: the notebook's name)")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list-parameters", action="store_true",
                        help="print the notebook's parameters and exit")
    parser.add_argument("--num-processes", type=int, default=1, metavar="N",
                        help="data-parallel ranks for the notebook's trace collection and "
                             "evaluation (accelerate launch; one GPU per rank); see "
                             "docs/scale_out.md")


def main(args: argparse.Namespace) -> int:
    if args.command == "runs":
        return _list(args)
    try:
        notebook = runs.resolve_notebook(args.notebook)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    known = runs.notebook_parameters(notebook)
    if args.list_parameters:
        for name, spec in known.items():
            help_text = f"  # {spec['help']}" if spec["help"] else ""
            if name == "RUN_DIR":
                help_text += " (-p RUN_DIR D is the same as --run-dir D)"
            print(f"{name} = {spec['default']!r}  ({spec['type']}){help_text}")
        return 0
    params = dict(args.parameter)
    try:
        run_dir = _run_dir_of(args.run_dir, params, known)
        params = runs.coerce_parameters(notebook, params)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.num_processes < 1:
        print(f"error: --num-processes must be >= 1, got {args.num_processes}", file=sys.stderr)
        return 2
    # the kernel inherits the environment; rltlab.workbench.scale.num_processes() reads it
    from rltlab.workbench.scale import NUM_PROCESSES_ENV   # imports torch: only here
    os.environ[NUM_PROCESSES_ENV] = str(args.num_processes)
    if args.start_over and run_dir is None:
        print("error: --start-over needs the run directory to start over: --run-dir DIR",
              file=sys.stderr)
        return 2
    try:
        runs.check_run_inputs(notebook, params, run_dir, args.start_over)
    except runs.RunRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if run_dir is None:
        run_dir = runs.new_run_dir(args.name or notebook.stem)
    print(f"run dir: {run_dir}", flush=True)
    # SIGTERM is recorded like Ctrl-C (status interrupted, the kernel killed)
    previous_handler = signal.signal(signal.SIGTERM, _interrupt)
    failed = None
    try:
        runs.execute_notebook(notebook, params, run_dir=run_dir, kernel_name=args.kernel,
                              progress=not args.no_progress, start_over=args.start_over)
    except runs.RunRefused as err:      # nothing was changed
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; the run's finished work is kept in {run_dir} (status in "
              f"run.json: interrupted). Resume: rltlab run {args.notebook} --run-dir "
              f"{run_dir}", file=sys.stderr)
        return 130
    except Exception as err:  # the executed notebook (with the failing cell) is still written
        failed = err
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    run_dir = Path(run_dir)
    plots = runs.run_artifacts(run_dir)
    if plots:
        print("plots:")
        for path in plots:
            print(f"  {path}")
    if failed is None:   # after a failure metrics.json, if any, is an earlier attempt's
        try:
            metrics = runs.headline_metrics(runs.read_metrics(run_dir))
        except ValueError as err:
            print(f"warning: {err}", file=sys.stderr)
            metrics = {}
        if metrics:
            print("metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
    print(f"run dir: {run_dir}")
    if failed is not None:
        print(f"error: notebook failed: {runs.short_error(failed)}", file=sys.stderr)
        print(f"see {run_dir / notebook.name}", file=sys.stderr)
        return 1
    return 0


def _run_dir_of(option: str | None, params: dict[str, str], known: dict) -> str | None:
    """The run directory: --run-dir, or `-p RUN_DIR D` (taken out of params: the notebook gets
    RUN_DIR from the run directory itself). "None" / "null" / "" mean none (a new one). Both
    given must name the same directory."""
    if "RUN_DIR" not in params or "RUN_DIR" not in known:
        return option       # a notebook without RUN_DIR: coerce_parameters names it unknown
    given = params.pop("RUN_DIR")
    if given.strip() in ("", "None", "null"):
        return option
    if option is not None and (Path(option).expanduser().resolve()
                               != Path(given).expanduser().resolve()):
        raise ValueError(f"-p RUN_DIR {given} and --run-dir {option} differ: give the run "
                         "directory once (--run-dir D, or -p RUN_DIR D)")
    return option if option is not None else given


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _last_line(text: str, width: int = 80) -> str:
    """An error's last non-empty line (where the exception is named), its end kept."""
    line = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return line if len(line) <= width else "..." + line[-(width - 3):]


def _list(args: argparse.Namespace) -> int:
    entries = runs.list_runs(args.root)
    if not entries:
        print(f"no runs under {args.root or runs.runs_root()}")
        return 0
    rows = []
    for entry in entries:
        metrics = entry["metrics"]
        items = list(metrics.items()) if args.all_metrics else list(metrics.items())[:4]
        seconds = entry["seconds"]
        headline = ", ".join(f"{k}={_fmt(v)}" for k, v in items) or "-"
        if entry["problem"]:
            headline = entry["problem"]
        else:
            if entry["metrics_stale"]:    # the last attempt did not write them
                headline = f"(stale: from an earlier attempt) {headline}"
            if entry["error"]:            # why it failed first: "-" says nothing
                headline = f"error: {_last_line(entry['error'])}" + (
                    "" if headline == "-" else f"; {headline}")
        rows.append([entry["name"], entry["notebook"] or "-", entry["status"],
                     f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-", headline])
    header = ["RUN", "NOTEBOOK", "STATUS", "SECONDS", "HEADLINE METRICS"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header) - 1)]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    return 0
