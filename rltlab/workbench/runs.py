"""Run directories and papermill execution of the workbench notebooks.

A run is a directory ``artifacts/runs/<YYYY-MM-DD>-<name>[-N]`` holding:

    run.json          status (running / finished / failed), notebook, timestamps, attempts
    parameters.json   the effective notebook parameters (RUN_DIR included)
    <notebook>.ipynb  the executed notebook (outputs included)
    metrics.json      written by the notebook's last cell (headline numbers)
    *.png / *.svg     plots the notebook saved
    iter_k/ ...       whatever the notebook checkpoints (the loop notebook: one dir per iteration)

Passing an existing run directory re-executes the notebook with the same RUN_DIR (the stored
parameters are the base, new ones override them); notebooks that checkpoint their progress in
RUN_DIR (the loop notebook) skip what is already done, so a killed run resumes.

Parameter values given as strings (from the CLI) are coerced to the type of the default in the
notebook's ``parameters`` cell; unknown names are rejected with the list of known ones.
"""
from __future__ import annotations

import ast
import datetime as _dt
import io
import json
import os
import re
import socket
import time
import tokenize
from pathlib import Path
from typing import Any

from rltlab.common.atomic import _jsonable, read_json, write_json_atomic, write_text_atomic
from rltlab.common.paths import ARTIFACTS_DIR, REPO_ROOT

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RUN_FILE = "run.json"
PARAMS_FILE = "parameters.json"
METRICS_FILE = "metrics.json"
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


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


def notebook_parameters(notebook_path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ``parameters`` cell of a notebook: name -> {default, type, help}.

    Parsed with `ast` (papermill's own inspection trips over '=' inside comments): every
    top-level ``NAME = <literal>`` assignment is a parameter; `type` is the default's type
    name (an annotation wins), `help` the trailing comment.
    """
    import nbformat

    nb = nbformat.read(str(notebook_path), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "parameters" in
             c.get("metadata", {}).get("tags", [])]
    if not cells:
        return {}
    source = cells[0].source
    comments = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
    except tokenize.TokenError:
        pass
    params: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            name, value, annotation = node.targets[0].id, node.value, None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            name, value, annotation = node.target.id, node.value, ast.unparse(node.annotation)
        else:
            continue
        try:
            default = ast.literal_eval(value)
            literal = True
        except ValueError:
            default, literal = ast.unparse(value), False
        type_name = annotation or (type(default).__name__ if literal else "expr")
        params[name] = {"default": default, "type": type_name,
                        "help": comments.get(node.lineno, "")}
    return params


_TRUE, _FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}


def coerce_parameters(notebook_path: str | os.PathLike, parameters: dict[str, Any]
                      ) -> dict[str, Any]:
    """Check names against the parameters cell and convert string values to the defaults' types.

    Non-string values pass through unchanged. "None"/"null" give None for any parameter.
    """
    known = notebook_parameters(notebook_path)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        names = ", ".join(sorted(known)) or "(the notebook has no parameters cell)"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for "
                         f"{Path(notebook_path).name}; known: {names}")
    out = {}
    for name, value in parameters.items():
        out[name] = _coerce(name, value, known[name]) if isinstance(value, str) else value
    return out


def _coerce(name: str, text: str, spec: dict[str, Any]) -> Any:
    type_name, default = spec["type"], spec["default"]
    if text.strip() in ("None", "null") and type_name != "str":
        return None
    try:
        if type_name in ("bool",):
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected true/false")
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
        if type_name == "str":
            return text
        if type_name in ("list", "tuple", "dict"):
            value = ast.literal_eval(text)
            if type_name == "tuple" and isinstance(value, list):
                value = tuple(value)
            if type(value).__name__ != type_name:
                raise ValueError(f"expected a {type_name} literal")
            return value
        # default None / expression / annotation: a Python literal if it parses, else the string
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    except (ValueError, SyntaxError) as err:
        raise ValueError(f"parameter {name}={text!r}: cannot convert to {type_name} "
                         f"(default {default!r}): {err}") from None


def execute_notebook(notebook_path: str | os.PathLike, parameters: dict[str, Any] | None = None,
                     run_dir: str | os.PathLike | None = None, kernel_name: str = "python3",
                     progress: bool = True, name: str | None = None,
                     timeout: float | None = None) -> Path:
    """Execute a notebook with papermill into a run directory; returns the run directory.

    run_dir None: a new ``runs_root()/<date>-<name or notebook stem>`` is created. An existing
    run_dir is resumed: its stored parameters are the base, `parameters` override them, and the
    notebook sees the same RUN_DIR. The executed notebook is written even when it fails
    (papermill marks the failing cell); the error is re-raised after run.json says "failed".
    """
    import papermill

    notebook_path = resolve_notebook(notebook_path)
    parameters = coerce_parameters(notebook_path, dict(parameters or {}))
    if "RUN_DIR" in parameters and parameters["RUN_DIR"] is not None and run_dir is None:
        run_dir = parameters["RUN_DIR"]
    if run_dir is None:
        run_dir = new_run_dir(name or notebook_path.stem)
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = read_json(run_dir / PARAMS_FILE, {}) or {}
    effective = {**previous, **parameters, "RUN_DIR": str(run_dir)}
    known = notebook_parameters(notebook_path)
    if "RUN_DIR" not in known:
        effective.pop("RUN_DIR")
    effective = {k: v for k, v in effective.items() if k in known}
    write_json_atomic(run_dir / PARAMS_FILE, effective)

    record = read_json(run_dir / RUN_FILE, {}) or {}
    attempts = record.get("attempts", [])
    attempts.append({"started": _now(), "overrides": parameters})
    record.update({"name": run_dir.name, "notebook": str(notebook_path),
                   "notebook_name": notebook_path.stem, "status": "running",
                   "pid": os.getpid(), "host": socket.gethostname(), "attempts": attempts})
    record.setdefault("created", attempts[0]["started"])
    write_json_atomic(run_dir / RUN_FILE, record)

    output = run_dir / notebook_path.name
    start = time.time()
    try:
        papermill.execute_notebook(
            str(notebook_path), str(output), parameters=effective, kernel_name=kernel_name,
            progress_bar=progress, cwd=str(REPO_ROOT), execution_timeout=timeout)
    except BaseException as err:
        record.update({"status": "failed", "finished": _now(), "error": _short_error(err),
                       "seconds": round(time.time() - start, 3)})
        attempts[-1].update(status="failed", finished=record["finished"])
        write_json_atomic(run_dir / RUN_FILE, record)
        raise
    record.update({"status": "finished", "finished": _now(), "error": None,
                   "seconds": round(time.time() - start, 3)})
    attempts[-1].update(status="finished", finished=record["finished"])
    write_json_atomic(run_dir / RUN_FILE, record)
    return run_dir


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _short_error(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 2000 else text[:2000] + " ..."


# ----------------------------------------------------------------------------- listing

_DATE_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)$")


def list_runs(root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every run directory under root (default runs_root()), newest first.

    Each entry: name, date, path, notebook, status, seconds, metrics (the flat numeric
    top-level values of metrics.json, the "headline"). A run whose run.json still says
    "running" but whose process is gone on this host shows as "interrupted".
    """
    root = Path(root) if root is not None else runs_root()
    if not root.is_dir():
        return []
    runs = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        try:
            record = read_json(path / RUN_FILE, {}) or {}
            metrics = read_json(path / METRICS_FILE, {}) or {}
        except (json.JSONDecodeError, OSError):
            record, metrics = {"status": "unreadable"}, {}
        if not record and not metrics:
            continue  # not a notebook run (e.g. a benchmark's output folder)
        match = _DATE_RE.match(path.name)
        status = record.get("status", "unknown" if not metrics else "finished")
        if status == "running" and record.get("host") == socket.gethostname() and \
                not _pid_alive(record.get("pid")):
            status = "interrupted"
        runs.append({
            "name": path.name, "date": match.group(1) if match else None, "path": str(path),
            "notebook": record.get("notebook_name") or Path(record.get("notebook", "")).stem,
            "status": status, "seconds": record.get("seconds"),
            "metrics": headline_metrics(metrics)})
    runs.sort(key=lambda r: (r["date"] or "", r["name"]), reverse=True)
    return runs


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
