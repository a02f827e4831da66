"""Run directories and papermill execution of the workbench notebooks.

A run is a directory ``artifacts/runs/<YYYY-MM-DD>-<name>[-N]`` holding:

    run.json          status (running / finished / failed / interrupted), notebook, timestamps,
                      attempts (one per execution)
    parameters.json   the effective notebook parameters (RUN_DIR included)
    <notebook>.ipynb  the executed notebook (outputs included)
    metrics.json      written by the notebook's last cell (headline numbers)
    *.png / *.svg     plots the notebook saved
    iter_k/ ...       whatever the notebook checkpoints (the loop notebook: one dir per iteration)
    .rltlab-run.lock  the lock an execution holds (rltlab.workbench.run_files)

Passing an existing run directory re-executes the notebook with the same RUN_DIR (the stored
parameters are the base, new ones override them); notebooks that checkpoint their progress in
RUN_DIR (the loop notebook) skip what is already done, so a killed run resumes. Only a new or
empty directory or a run directory of the same notebook is accepted, and one execution at a
time holds it (run_files.check_run_dir, run_files.run_dir_lock).

Parameter values given as strings (from the CLI) are coerced to the type of the default in the
notebook's ``parameters`` cell and checked against its bounds (rltlab.workbench.notebook_params).
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from rltlab.common.atomic import read_json, write_json_atomic
from rltlab.common.json_files import JSONFileError
from rltlab.common.paths import ARTIFACTS_DIR, REPO_ROOT
from rltlab.workbench.notebook_params import (check_bounds, check_inputs, coerce_parameters,
                                              notebook_parameters, resume_check)
from rltlab.workbench.run_files import (LOCK_FILE, METRICS_FILE, PARAMS_FILE, RUN_FILE,
                                        RunDirBusy, RunRefused, check_run_dir, clear_run_dir,
                                        file_stamp, notebook_of, read_metrics, read_parameters,
                                        read_run_record, run_dir_lock, run_is_alive)

__all__ = ["LOCK_FILE", "METRICS_FILE", "NOTEBOOKS_DIR", "PARAMS_FILE", "RUN_FILE", "RunDirBusy",
           "RunRefused", "coerce_parameters", "execute_notebook", "headline_metrics",
           "list_runs", "new_run_dir", "notebook_parameters", "read_json", "resolve_notebook",
           "run_artifacts", "runs_root", "short_error", "write_json_atomic"]

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
ERROR_CHARS = 2000      # run.json keeps this much of an error message: its head and its tail


# ----------------------------------------------------------------------------- small helpers

def runs_root() -> Path:
    """artifacts/runs, or $RLTLAB_RUNS_DIR when set."""
    override = os.environ.get("RLTLAB_RUNS_DIR")
    return Path(override) if override else ARTIFACTS_DIR / "runs"


def new_run_dir(name: str, root: str | os.PathLike | None = None,
                date: _dt.date | None = None) -> Path:
    """Create and return a fresh ``<root>/<YYYY-MM-DD>-<name>[-N]`` (N = 2, 3, ... on clashes)."""
    clean = _NAME_RE.sub("-", name).strip("-.") or "run"
    root = Path(root) if root is not None else runs_root()
    root.mkdir(parents=True, exist_ok=True)
    stem = f"{(date or _dt.date.today()).isoformat()}-{clean}"
    for n in range(1, 10_000):
        candidate = root / (stem if n == 1 else f"{stem}-{n}")
        try:
            candidate.mkdir()  # atomic: two concurrent callers never get the same directory
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"too many runs named {stem} in {root}")


# ----------------------------------------------------------------------------- notebooks

def resolve_notebook(spec: str | os.PathLike) -> Path:
    """A notebook path, or a short name: ``10`` / ``10_rollout_update_evaluate`` -> notebooks/..."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    text = str(spec)
    candidates = sorted(NOTEBOOKS_DIR.glob("*.ipynb")) if NOTEBOOKS_DIR.is_dir() else []
    stem = text[:-6] if text.endswith(".ipynb") else text
    exact = [p for p in candidates if p.stem == stem]
    if exact:
        return exact[0]
    if stem.isdigit():
        numbered = [p for p in candidates if p.stem.split("_", 1)[0].lstrip("0") == stem.lstrip("0")
                    and p.stem.split("_", 1)[0].isdigit()]
        if len(numbered) == 1:
            return numbered[0]
    prefixed = [p for p in candidates if p.stem.startswith(stem)]
    if len(prefixed) == 1:
        return prefixed[0]
    names = ", ".join(p.stem for p in candidates) or "(none)"
    why = "is ambiguous" if len(prefixed) > 1 else "matches no notebook"
    raise FileNotFoundError(f"notebook {text!r} {why}; pass a path or one of: {names}")


def execute_notebook(notebook_path: str | os.PathLike, parameters: dict[str, Any] | None = None,
                     run_dir: str | os.PathLike | None = None, kernel_name: str = "python3",
                     progress: bool = True, name: str | None = None,
                     timeout: float | None = None, start_over: bool = False) -> Path:
    """Execute a notebook with papermill into a run directory; returns the run directory.

    run_dir None: a new ``runs_root()/<date>-<name or notebook stem>`` is created. An existing
    run_dir is resumed: its stored parameters are the base, `parameters` override them, and the
    notebook sees the same RUN_DIR. start_over: delete what earlier executions left in run_dir
    (run.json's attempts stay) and start from the notebook's defaults plus `parameters`.

    Refused with RunRefused (a ValueError), before anything in run_dir changes: a directory
    that is neither new, empty, nor a run of this notebook; a damaged run.json or
    parameters.json (the message names the file and the field); a parameter out of its
    bounds; and, as RunDirBusy, a run directory another execution holds.

    The executed notebook is written even when it fails (papermill marks the failing cell);
    the error is re-raised after run.json says "failed", or "interrupted" for a
    KeyboardInterrupt (SIGINT). The kernel is killed at once when the execution ends early.
    """
    import papermill

    notebook_path = resolve_notebook(notebook_path)
    parameters = coerce_parameters(notebook_path, dict(parameters or {}))
    if "RUN_DIR" in parameters and parameters["RUN_DIR"] is not None and run_dir is None:
        run_dir = parameters["RUN_DIR"]
    check_run_inputs(notebook_path, parameters, run_dir, start_over)
    if run_dir is not None:
        check_run_dir(Path(run_dir).resolve(), notebook_path.stem)  # before creating anything
    else:
        run_dir = new_run_dir(name or notebook_path.stem)
    run_dir = Path(run_dir).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:      # e.g. no permission: refused before anything is written
        raise RunRefused(f"cannot create run directory {run_dir}: {err.strerror or err}") \
            from None
    with run_dir_lock(run_dir):
        record, effective = _prepare(notebook_path, parameters, run_dir, start_over)
        if start_over:
            clear_run_dir(run_dir)
        write_json_atomic(run_dir / PARAMS_FILE, effective)
        attempt = {"started": _now(), "overrides": parameters,
                   "metrics_before": file_stamp(run_dir / METRICS_FILE)}
        if start_over:
            attempt["start_over"] = True
        attempts = record.get("attempts", [])
        attempts.append(attempt)
        record.update({"name": run_dir.name, "notebook": str(notebook_path),
                       "notebook_name": notebook_path.stem, "status": "running",
                       "pid": os.getpid(), "host": socket.gethostname(), "attempts": attempts,
                       "finished": None, "error": None, "seconds": None})
        record.setdefault("created", attempts[0]["started"])
        write_json_atomic(run_dir / RUN_FILE, record)
        start = time.time()
        try:
            _quiet_papermill_inspection()
            papermill.execute_notebook(
                str(notebook_path), str(run_dir / notebook_path.name), parameters=effective,
                kernel_name=kernel_name, progress_bar=progress, cwd=str(REPO_ROOT),
                execution_timeout=timeout, shutdown_kernel="immediate",
                # ipykernel >= 7 warns on every start that a local kernel's ZMQ traffic is
                # unencrypted (as Jupyter's always was); cells' output and errors still show
                extra_arguments=["--IPKernelApp.log_level=ERROR"])
        except BaseException as err:
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            _record_end(run_dir, record, status, start, short_error(err))
            raise
        _record_end(run_dir, record, "finished", start, None)
    return run_dir


class _DropParameterCellWarnings(logging.Filter):
    """papermill re-reads the parameters cell only to warn about unknown names, and its reader
    fails on every line whose help comment holds a bound such as "[>= 1]" (a second '='): it
    warns "Unable to parse line ..." for the line, then "Passed unknown parameter: ..." for
    every name passed. The names and bounds were already checked with `ast`
    (coerce_parameters rejects unknown names), so those warnings say nothing; every other
    papermill message stays."""

    SPURIOUS = ("Unable to parse line", "Passed unknown parameter")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.SPURIOUS)


def _quiet_papermill_inspection() -> None:
    for name in ("papermill", "papermill.translators"):   # execute.py and the cell reader
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropParameterCellWarnings) for f in log.filters):
            log.addFilter(_DropParameterCellWarnings())


def check_run_inputs(notebook_path: Path, parameters: dict[str, Any],
                     run_dir: str | os.PathLike | None, start_over: bool = False) -> None:
    """RunRefused, before anything is created, for inputs the notebook would find missing
    only once it runs (notebook_params.check_inputs): over the notebook's defaults, the
    parameters a resumed run_dir stored (unless start_over) and `parameters`. A damaged
    parameters file is left to the check under the run's lock, which names it."""
    known = notebook_parameters(notebook_path)
    previous = {}
    if run_dir is not None and not start_over and (Path(run_dir) / PARAMS_FILE).is_file():
        try:
            previous = read_parameters(Path(run_dir))
        except JSONFileError:
            pass
    try:
        check_inputs(known, {k: v for k, v in {**previous, **parameters}.items()
                             if k in known})
    except ValueError as err:
        raise RunRefused(str(err)) from None


def _prepare(notebook_path: Path, parameters: dict[str, Any], run_dir: Path,
             start_over: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Under the lock, before any write: the run record (an attempt a killed process left
    "running" closed as interrupted) and the effective parameters, checked."""
    record = check_run_dir(run_dir, notebook_path.stem)   # again: it may have changed
    try:
        previous = {} if start_over else read_parameters(run_dir)
    except JSONFileError as err:
        raise RunRefused(f"{err}; fix or remove it (or start over) to resume") from err
    known = notebook_parameters(notebook_path)
    effective = {k: v for k, v in {**previous, **parameters, "RUN_DIR": str(run_dir)}.items()
                 if k in known}
    try:
        check_bounds(known, {k: v for k, v in previous.items() if k not in parameters},
                     source=str(run_dir / PARAMS_FILE))
        check_inputs(known, effective, source=f"{run_dir / PARAMS_FILE} with the -p values")
        check = None if start_over else resume_check(notebook_path)   # start over: no work
        if check is not None:
            check(run_dir, {**{k: spec["default"] for k, spec in known.items()}, **effective})
    except ValueError as err:
        raise RunRefused(str(err)) from None
    attempts = record.get("attempts", [])
    if record.get("status") == "running" and attempts:   # its process died without a word
        attempts[-1].setdefault("status", "interrupted")
        attempts[-1].setdefault("note", "the process ended without recording (killed)")
    return record, effective


def _record_end(run_dir: Path, record: dict[str, Any], status: str, start: float,
                error: str | None) -> None:
    record.update({"status": status, "finished": _now(), "error": error,
                   "seconds": round(time.time() - start, 3)})
    record["attempts"][-1].update(status=status, finished=record["finished"])
    write_json_atomic(run_dir / RUN_FILE, record)


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def short_error(err: BaseException, limit: int = ERROR_CHARS) -> str:
    """`Type: message`, at most `limit` characters: the head and the tail, where a papermill
    error names the exception, with the middle cut."""
    if isinstance(err, KeyboardInterrupt):
        return f"KeyboardInterrupt: interrupted ({err or 'SIGINT'})"
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) <= limit:
        return text
    head = limit // 4
    cut = f"\n[... {len(text) - limit} characters cut ...]\n"
    return text[:head] + cut + text[-(limit - head):]


# ----------------------------------------------------------------------------- listing

_DATE_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)$")


def list_runs(root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every run directory under root (default runs_root()), newest first.

    Each entry: name, date, path, notebook, status, seconds, metrics (the flat numeric
    top-level values of metrics.json, the "headline"), metrics_stale (True when metrics.json
    predates the last attempt: that attempt did not write it), problem (why a run is
    "unreadable", else None), error (a failed run's recorded error, else None). A run whose run.json still says "running" but whose lock no
    process holds (killed, e.g. SIGKILL) shows as "interrupted". A damaged run.json or
    metrics.json marks that run "unreadable"; the others are listed as usual.
    """
    root = Path(root) if root is not None else runs_root()
    if not root.is_dir():
        return []
    runs = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith("."):
            entry = _describe_run(path)
            if entry is not None:
                runs.append(entry)
    runs.sort(key=lambda r: (r["date"] or "", r["name"]), reverse=True)
    return runs


def _describe_run(path: Path) -> dict[str, Any] | None:
    if not (path / RUN_FILE).exists() and not (path / METRICS_FILE).exists():
        return None  # not a notebook run (e.g. a benchmark's output folder)
    record, metrics, problems = {}, {}, []
    try:
        record = read_run_record(path)
    except JSONFileError as err:
        problems.append(str(err))
    try:
        metrics = read_metrics(path)
    except JSONFileError as err:
        problems.append(str(err))
    status = record.get("status") or ("finished" if metrics else "unknown")
    if status == "running" and not _still_running(path, record):
        status = "interrupted"
    attempts = record.get("attempts") or [{}]
    stamp = attempts[-1].get("metrics_before")
    match = _DATE_RE.match(path.name)
    return {"name": path.name, "date": match.group(1) if match else None, "path": str(path),
            "notebook": notebook_of(record), "status": "unreadable" if problems else status,
            "seconds": record.get("seconds"), "metrics": headline_metrics(metrics),
            "metrics_stale": bool(metrics) and stamp is not None
            and stamp == file_stamp(path / METRICS_FILE),
            "problem": "; ".join(problems) or None,
            "error": record.get("error") if status == "failed" else None}


def _still_running(path: Path, record: dict[str, Any]) -> bool:
    """The lock says it (held only while the process lives); without a lock file (a run made
    before locking), a live pid on this host."""
    alive = run_is_alive(path)
    if alive is not None:
        return alive
    return record.get("host") != socket.gethostname() or _pid_alive(record.get("pid"))


def headline_metrics(metrics: dict[str, Any], limit: int = 6) -> dict[str, Any]:
    """The scalar numbers of a metrics dict; an explicit "headline" dict wins when present."""
    if isinstance(metrics.get("headline"), dict):
        return dict(metrics["headline"])
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
        if len(out) >= limit:
            break
    return out


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_artifacts(run_dir: str | os.PathLike, suffixes: tuple[str, ...] = (".png", ".svg")
                  ) -> list[Path]:
    """Files with the given suffixes under a run directory (plots by default), sorted."""
    run_dir = Path(run_dir)
    return sorted(p for p in run_dir.rglob("*") if p.is_file() and p.suffix in suffixes)
