"""Every notebook through `rltlab run` on this machine, with a model at a real shape: wall time
and peak GPU memory per notebook.

    python -m rltlab.bench.pipeline --config path/to/Ouro-1.4B/config.json --out pipeline.json
    python -m rltlab.bench.pipeline --model ~/models/Ouro-1.4B

--config writes a random-weight stand-in of that config first (rltlab.model.standin: its
speed, memory and trace sizes are the real shape's, its quality figures mean nothing); --model
runs a checkpoint directory as it is. Each notebook runs as its own `rltlab run` process (its
own CUDA context, so its own peak memory), with no device flag: DEVICE and DTYPE stay "auto".
Sizes: SIZES below (notebook 10 at 2 iterations, 256 rollout prompts and 100 held-out
problems; the others at the smallest sizes that still exercise every cell), changed with
`--param NOTEBOOK KEY VALUE`. `--jobs N` runs up to N notebooks at once after notebook 10 (their
wall times then overlap: the JSON says so).

Per notebook: notebook, model, device, commit, wall_s, peak_gpu_mem_gib, rc, run_dir and the
run's headline metrics. The last line is the JSON object, also written to --out, which holds the
finished notebooks' rows from the first one on (all_finished stays false until every notebook
has finished with rc 0), so a run stopped midway keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rltlab.common.atomic import write_json_atomic
from rltlab.common.environment import git_commit
from rltlab.workbench import runs

SIZES: dict[str, dict[str, object]] = {
    "10_rollout_update_evaluate": {"ROLLOUT_PROMPTS": 256, "EVAL_PROBLEMS": 100},
    "01_collect_traces": {"NUM_PROMPTS": 128, "MAX_TOKENS": 32},
    "04_evaluate": {"NUM_PROBLEMS": 64, "MAX_TOKENS": 32, "DEPTHS": [1, 4],
                    "THRESHOLDS": [0.5], "TEXT_ROWS": 4, "SEQ_LEN": 128, "BATCH": 16},
    "02_train_exit_predictor": {
        "ARITH_PROMPTS": 64, "TEXT_PROMPTS": 16, "MAX_TOKENS": 24, "TEXT_TOKENS": 16,
        "EPOCHS": 3, "EVAL_PROBLEMS": 32, "TEXT_ROWS": 2, "Q_THRESHOLDS": [0.5],
        "DELAYED_THRESHOLDS": [0.9], "DELTA_EPS": [0.4], "KL_EPS": [0.01],
        "LOOKAHEAD_THRESHOLDS": [0.5], "CONCURRENCY": [16]},
    "03_train_draft_heads": {"TRAIN_ROWS": 32, "HELDOUT_ROWS": 8, "STEPS": 20,
                             "NUM_PROMPTS": 2, "MAX_TOKENS": 16},
}
MAIN_JOB = "10_rollout_update_evaluate"
LOG_TAIL = 2000   # characters of a failed run's output kept in the JSON


def run_notebook(notebook: str, model_dir: Path, params: dict, run_dir: Path,
                 timeout: float | None) -> dict:
    """One `rltlab run` in a subprocess -> its row (module docstring)."""
    cmd = [sys.executable, "-m", "rltlab.workbench.cli", "run", notebook, "--run-dir",
           str(run_dir), "-p", "MODEL_DIR", str(model_dir)]
    for key, value in params.items():
        cmd += ["-p", key, json.dumps(value) if not isinstance(value, str) else value]
    print(f"[pipeline] {notebook}: {' '.join(cmd[3:])}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        rc, log = 124, f"timed out after {timeout} s\n" + str(err.stdout or "")[-LOG_TAIL:]
    wall = time.perf_counter() - start
    metrics = _read_json(run_dir / "metrics.json")
    env = metrics.get("environment") or {}
    row = {"notebook": notebook, "rc": rc, "wall_s": round(wall, 1),
           "device": env.get("model_device"), "dtype": env.get("model_dtype"),
           "peak_gpu_mem_gib": env.get("peak_gpu_mem_gib"), "run_dir": str(run_dir),
           "parameters": params, "headline": metrics.get("headline")}
    if rc != 0:
        row["log_tail"] = log[-LOG_TAIL:]
    peak = row["peak_gpu_mem_gib"]
    memory = "" if peak is None else f", peak GPU memory {peak:.1f} GiB"
    print(f"[pipeline] {notebook}: rc {rc}, {wall:.1f} s, device {row['device']}{memory}",
          flush=True)
    if rc != 0:   # the failure itself, not only in the JSON's log_tail
        print(f"[pipeline] {notebook} failed: {_last_error_line(log)}", flush=True)
    return row


def _last_error_line(log: str) -> str:
    """The last line of a failed run's output that names an error (else its last line)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "Error" in ln or ln.startswith("error:")),
                lines[-1] if lines else "(no output)")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.pipeline",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="CONFIG_JSON",
                        help="write a random-weight stand-in of this config.json and run it")
    source.add_argument("--model", metavar="DIR", help="run this checkpoint directory")
    ap.add_argument("--notebooks", nargs="+", default=list(SIZES), metavar="NB",
                    help="which notebooks, in order, by name or number as `rltlab run` takes "
                         f"them (default: {' '.join(SIZES)})")
    ap.add_argument("--param", nargs=3, action="append", default=[],
                    metavar=("NOTEBOOK", "KEY", "VALUE"),
                    help="override one notebook parameter (repeatable; VALUE as `rltlab run -p`, "
                         "checked against the notebook before anything runs)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="notebooks run at once after notebook 10 (default 1)")
    ap.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="seconds each notebook may run")
    ap.add_argument("--work-dir", default=None, metavar="DIR",
                    help="where the stand-in and the run directories go (default: a new "
                         "temporary directory)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    keys = {nb: _notebook_key(nb) for nb in {*args.notebooks, *(nb for nb, _, _ in args.param)}}
    unknown = sorted(nb for nb, key in keys.items() if key is None)
    if unknown:
        ap.error(f"unknown notebook(s) {unknown}; choose from {list(SIZES)}")
    args.notebooks = [keys[nb] for nb in args.notebooks]
    overrides: dict[str, dict[str, str]] = {}
    for nb, key, value in args.param:
        overrides.setdefault(keys[nb], {})[key] = value
    stray = sorted(set(overrides) - set(args.notebooks))
    if stray:
        ap.error(f"--param for {', '.join(stray)}, which --notebooks does not run")
    try:   # the notebook's own checks, before anything runs; the JSON records typed values
        args.overrides = {nb: runs.coerce_parameters(runs.resolve_notebook(nb), values)
                          for nb, values in overrides.items()}
    except ValueError as err:
        ap.error(str(err))
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.timeout is not None and not args.timeout > 0:
        ap.error(f"--timeout must be > 0, got {args.timeout}")
    if args.config and not Path(args.config).exists():
        ap.error(f"--config {args.config}: no such file")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    return args


def _notebook_key(name: str) -> str | None:
    """A SIZES key from what `rltlab run` accepts (10, 10_rollout_update_evaluate, a path)."""
    try:
        stem = runs.resolve_notebook(name).stem
    except FileNotFoundError:
        return None
    return stem if stem in SIZES else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rltlab-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.config:
        from rltlab.common.device import default_device
        from rltlab.model.standin import write_standin
        model_dir = work / "standin"
        print(f"[pipeline] writing a random-weight stand-in of {args.config} to {model_dir}",
              flush=True)
        write_standin(args.config, model_dir, device=default_device(), force=True)
        model = f"stand-in of {args.config} (random weights)"
    else:
        model_dir, model = Path(args.model), str(Path(args.model).resolve())
    params = {nb: {**SIZES[nb], **args.overrides.get(nb, {})} for nb in args.notebooks}
    commit = git_commit()
    first = [nb for nb in args.notebooks if nb == MAIN_JOB]
    rest = [nb for nb in args.notebooks if nb != MAIN_JOB]
    rows: dict[str, dict] = {}
    lock = threading.Lock()

    def snapshot() -> dict:
        done = [rows[nb] for nb in args.notebooks if nb in rows]
        return {"bench": "pipeline", "commit": commit, "model": model,
                "argv": sys.argv[1:] if argv is None else list(argv),
                "concurrent_notebooks": args.jobs if len(rest) > 1 else 1,
                "all_finished": len(done) == len(args.notebooks)
                and all(r["rc"] == 0 for r in done), "runs": done}

    def one(nb: str) -> None:
        row = run_notebook(nb, model_dir, params[nb], work / "runs" / nb, args.timeout)
        with lock:   # each finished notebook's row reaches --out at once: a run stopped
            rows[nb] = {"model": model, "commit": commit, **row}   # later keeps it
            if args.out:
                write_json_atomic(Path(args.out), snapshot())

    for nb in first:
        one(nb)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, rest))
    result = snapshot()
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_finished"] else 1)
