"""The trace directory's manifest: its constants, reading and checking it (every field a reader
or an appending writer uses, so a truncated or odd manifest raises TraceCorruptError naming the
file and the field), and the lock a writer holds on it (storage.TraceWriter)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any, Sequence

from rltlab.common.json_fields import field, read_json_object

FORMAT = "rltlab-traces"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


class TraceCorruptError(RuntimeError):
    """A shard is missing, truncated, or does not match its manifest checksum; or the manifest
    itself is unreadable or lacks a field."""


class TraceDirectoryLocked(RuntimeError):
    """Another TraceWriter (this process or another) is writing the same manifest."""


def lock_manifest(directory: Path, manifest_name: str):
    """An exclusive, non-blocking flock on <directory>/.<manifest_name>.lock, held by the returned
    open file until it is closed (or the process ends: the OS drops the lock, so a killed
    writer never leaves a stale lock behind). The file records the holder's pid."""
    path = directory / f".{manifest_name}.lock"
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise TraceDirectoryLocked(
            f"{directory} is being written by another trace writer ({manifest_name} is locked "
            f"by {path}, holder: {holder}); wait for it to close or use another directory"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: not a trace directory")
    return read_manifest_file(root / MANIFEST)


def read_manifest_file(path: Path) -> dict[str, Any]:
    """A manifest file's content, checked (TraceCorruptError naming the file and field)."""
    try:
        manifest = read_json_object(path)
    except ValueError as err:
        raise TraceCorruptError(str(err)) from err
    _check_manifest(manifest, path)
    return manifest


def _check_manifest(manifest: dict[str, Any], path: Path) -> None:
    if manifest.get("format") != FORMAT:
        raise TraceCorruptError(f"{path}: format {manifest.get('format')!r}, "
                                f"expected {FORMAT!r}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise TraceCorruptError(f"{path}: schema version "
                                f"{manifest.get('schema_version')} is not {SCHEMA_VERSION}")
    try:
        _check_manifest_fields(manifest, path)
    except ValueError as err:
        raise TraceCorruptError(str(err)) from err


def _check_manifest_fields(manifest: dict[str, Any], path: Path) -> None:
    """Every field a reader or an appending writer uses, with its type."""
    field(manifest, "num_rounds", path, "count")
    field(manifest, "hidden_dim", path, "count")
    if field(manifest, "hidden_dtype", path, "str") not in HIDDEN_DTYPES:
        raise ValueError(f"{path}: field 'hidden_dtype' must be one of {list(HIDDEN_DTYPES)}, "
                         f"got {manifest['hidden_dtype']!r}")
    if not all(isinstance(f, str) for f in field(manifest, "fields", path, "list")):
        raise ValueError(f"{path}: field 'fields' must be a list of field names")
    field(manifest, "num_tokens", path, "count")
    field(manifest, "info", path, "object")
    entries = [("shards", i, entry) for i, entry in enumerate(field(manifest, "shards", path,
                                                                       "list"))]
    projection = field(manifest, "projection", path, "object?")
    if projection is not None:
        entries.append(("projection", None, projection))
        for key in ("in_dim", "out_dim"):
            field(projection, key, path, "count", where="projection.")
    for name, i, entry in entries:
        where = f"{name}[{i}]." if i is not None else f"{name}."
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: field '{where[:-1]}' must be a JSON object, got "
                             f"{entry!r:.80}")
        field(entry, "file", path, "str", where=where)
        field(entry, "bytes", path, "count", where=where)
        field(entry, "sha256", path, "str", where=where)
        if name == "shards":
            field(entry, "num_tokens", path, "count", where=where)


def check_fields(fields: Sequence[str] | None, manifest: dict[str, Any]) -> None:
    if isinstance(fields, str):   # "hidden" would read as the fields h, i, d, ...
        raise ValueError(f"fields must be a list of field names, got the string {fields!r}")
    unknown = [f for f in fields or () if f not in manifest["fields"]]
    if unknown:
        raise ValueError(f"unknown trace fields {unknown}; available: {manifest['fields']}")
