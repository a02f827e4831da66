"""The files of a run directory, checked when read, and the lock that makes one execution own it.

run.json, parameters.json and metrics.json are read with rltlab.common.json_files: a truncated
or odd file raises JSONFileError naming the file and the field. `run_dir_lock` is an OS lock
(fcntl.flock on RUN_DIR/.rltlab-run.lock) held for a whole execution: a second `rltlab run` on
the same directory is refused with RunDirBusy before it changes anything. The OS drops the lock
with its process, even on SIGKILL, so `run_is_alive` tells a live run from a killed one without
trusting a pid (which a zombie or a new process may still carry).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rltlab.common.json_files import JSONFileError, check_field, read_json_file

RUN_FILE = "run.json"
PARAMS_FILE = "parameters.json"
METRICS_FILE = "metrics.json"
LOCK_FILE = ".rltlab-run.lock"
_PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"))

# run.json fields and their JSON types; all optional (older records lack some)
_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,), "notebook": (str,), "notebook_name": (str,), "status": (str,),
    "pid": (int, type(None)), "host": (str, type(None)), "attempts": (list,),
    "created": (str,), "finished": (str, type(None)), "error": (str, type(None)),
    "seconds": (float, type(None))}
_ATTEMPT_FIELDS: dict[str, tuple[type, ...]] = {
    "started": (str,), "status": (str,), "overrides": (dict,), "finished": (str, type(None)),
    "metrics_before": (list, type(None))}


class RunRefused(ValueError):
    """`rltlab run` refused to start; nothing in the run directory was changed."""


class RunDirBusy(RunRefused):
    """Another execution holds the run directory's lock."""


def read_run_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """run.json ({} when absent), every known field type-checked."""
    path = Path(run_dir) / RUN_FILE
    record = read_json_file(path, default={})
    for name, types in _RUN_FIELDS.items():
        check_field(record, path, name, *types)
    for i, attempt in enumerate(record.get("attempts", [])):
        if not isinstance(attempt, dict):
            raise JSONFileError(path, "is not an object", f"attempts[{i}]")
        for name, types in _ATTEMPT_FIELDS.items():
            check_field(attempt, path, name, *types, parent=f"attempts[{i}]")
    return record


def read_parameters(run_dir: str | os.PathLike) -> dict[str, Any]:
    """parameters.json ({} when absent): an object of parameter name -> value."""
    return read_json_file(Path(run_dir) / PARAMS_FILE, default={})


def read_metrics(run_dir: str | os.PathLike) -> dict[str, Any]:
    """metrics.json ({} when absent): an object; its "headline", if any, an object too."""
    path = Path(run_dir) / METRICS_FILE
    metrics = read_json_file(path, default={})
    check_field(metrics, path, "headline", dict, type(None))
    return metrics


def notebook_of(record: dict[str, Any]) -> str | None:
    """The stem of the notebook a run record names."""
    return record.get("notebook_name") or (Path(record["notebook"]).stem
                                           if record.get("notebook") else None)


def check_run_dir(run_dir: Path, notebook_stem: str) -> dict[str, Any]:
    """Refuse a directory `rltlab run` must not write into; returns its run record ({} for a
    new or empty directory). Accepted: no directory yet, an empty one, or a run directory
    (run.json) of the same notebook. Refused: a file, a directory with other content (a model
    directory, a run dir of another notebook), an unreadable run.json, a path that cannot be a
    directory (below a file, under /proc or /sys)."""
    for pseudo in _PSEUDO_FILESYSTEMS:
        if run_dir == pseudo or pseudo in run_dir.parents:
            raise RunRefused(f"run directory {run_dir} is under {pseudo} (a kernel "
                             "pseudo-filesystem, not storage); use another --run-dir")
    for parent in run_dir.parents:      # the nearest existing ancestor must be a directory
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise RunRefused(f"run directory {run_dir} is below a file ({parent}); use "
                                 "another --run-dir")
            break
    if not run_dir.exists():
        return {}
    if not run_dir.is_dir():
        raise RunRefused(f"run directory {run_dir} is a file")
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not entries:
        return {}
    if RUN_FILE not in entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunRefused(f"{run_dir} is not a run directory (no {RUN_FILE}; it holds {shown}): "
                         "`rltlab run` writes only into a new or empty directory or a run "
                         "directory of the same notebook")
    try:
        record = read_run_record(run_dir)
    except JSONFileError as err:
        raise RunRefused(f"{err}; fix or remove it to resume this run directory") from err
    owner = notebook_of(record)
    if owner is None:
        raise RunRefused(f"{run_dir / RUN_FILE}: field 'notebook_name' missing: cannot tell "
                         "which notebook made this run")
    if owner != notebook_stem:
        raise RunRefused(f"{run_dir} is a run of notebook {owner!r}, not {notebook_stem!r}; "
                         "use another --run-dir (or none for a new one)")
    return record


@contextmanager
def run_dir_lock(run_dir: Path, wait_s: float = 2.0) -> Iterator[None]:
    """Hold RUN_DIR's lock. It is retried for `wait_s` (a `rltlab runs` listing probes it for a
    moment), then RunDirBusy says who holds it."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RunDirBusy(_busy_message(run_dir)) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _busy_message(run_dir: Path) -> str:
    try:
        record = read_run_record(run_dir)
    except JSONFileError:
        record = {}
    attempts = record.get("attempts") or [{}]
    holder = ""
    if record.get("status") == "running":
        holder = (f" (pid {record.get('pid')} on {record.get('host')}, started "
                  f"{attempts[-1].get('started')})")
    return (f"run directory {run_dir} is in use by another execution{holder}: it holds "
            f"{run_dir / LOCK_FILE}; wait for it to finish or use another --run-dir")


def run_is_alive(run_dir: Path) -> bool | None:
    """Whether an execution holds RUN_DIR's lock; None when there is no lock file (a run made
    before locking existed)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def file_stamp(path: Path) -> list[int] | None:
    """(inode, mtime_ns, size) of a file, None when absent: a rewrite changes it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_mtime_ns, st.st_size]


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete what earlier executions left in RUN_DIR (not run.json, whose attempts are the
    run's history, nor the lock); returns the names deleted."""
    removed = []
    for path in sorted(run_dir.iterdir()):
        if path.name in (RUN_FILE, LOCK_FILE):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed
