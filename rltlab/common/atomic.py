"""Atomic file writes (a temporary sibling, fsync, then os.replace) and strict JSON I/O.

Readers see the old file or the new one, never a partial write, and a crash leaves at most a
hidden `.NAME.*.tmp` file behind. What lands gets the permissions a plain open() or mkdir()
would give it (tempfile makes its files 0600 and its directories 0700, which would keep run
artifacts and checkpoints from everyone else on a shared machine): default_permissions.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence


def process_umask() -> int:
    """The process umask (reading it means setting it, so it is set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def default_permissions(path: str | os.PathLike) -> None:
    """Give a file 0666 and a directory 0777, less the process umask, as open() and mkdir()
    would have; a directory's whole tree too (safetensors also writes its files 0600)."""
    umask = process_umask()
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def write_bytes_atomic(path: str | os.PathLike, data: bytes | Sequence[bytes | memoryview]
                       ) -> Path:
    """data (or its parts, written in order: no joined copy) to a temporary sibling, fsynced,
    then os.replace'd into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for part in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        default_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    """Write JSON to a temporary sibling, fsync it, then os.replace it into place.

    Readers see either the old file or the new one, never a partial write. Non-JSON values
    (Paths, numpy scalars, tensors of one element) are converted; NaN/Inf become null, so the
    file stays strict JSON.
    """
    text = json.dumps(_jsonable(obj), indent=indent, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """JSON content of path, or `default` when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return default
    return json.loads(path.read_text())


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy arrays/scalars, torch tensors
        return _jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return _jsonable(obj.item())
    raise TypeError(f"cannot write {type(obj).__name__} as JSON: {obj!r}")
