"""Reading JSON files that the user or a crash may have damaged: every error names the file and,
for a wrong value, the field, so "truncated run.json" is not reported as a bare JSONDecodeError
or a KeyError three calls later."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_ABSENT = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true/false",
               list: "a list", dict: "an object", type(None): "null"}


class JSONFileError(ValueError):
    """A JSON file that cannot be used: unreadable, not JSON, or a field of the wrong type."""

    def __init__(self, path: str | os.PathLike, problem: str, field: str | None = None):
        self.path, self.field = Path(path), field
        where = f"{self.path}: field {field!r}" if field else str(self.path)
        super().__init__(f"{where}: {problem}")


def read_json_file(path: str | os.PathLike, default: Any = _ABSENT, expect: type = dict) -> Any:
    """The content of a JSON file whose top level must be `expect` (an object by default).

    A missing file returns `default` (or raises JSONFileError without one); bytes that are not
    UTF-8 JSON, and a top level of another type, raise JSONFileError naming the file.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        if default is _ABSENT:
            raise JSONFileError(path, "missing") from None
        return default
    except UnicodeDecodeError as err:
        raise JSONFileError(path, f"not text (byte {err.start} is not UTF-8)") from None
    except OSError as err:
        raise JSONFileError(path, f"cannot be read: {err.strerror or err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        cut = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        raise JSONFileError(path, f"{'truncated' if cut else 'not valid JSON'} ({err.msg}: "
                                  f"line {err.lineno}, column {err.colno})") from None
    except RecursionError:      # json's decoder recurses once per level of [ / {
        raise JSONFileError(path, "nested too deeply to read (lists or objects inside each "
                                  "other past Python's recursion limit)") from None
    if not isinstance(data, expect):
        raise JSONFileError(path, f"holds {_describe(data)}, expected {_TYPE_NAMES[expect]}")
    return data


def check_field(data: dict[str, Any], path: str | os.PathLike, name: str, *types: type,
                required: bool = False, parent: str | None = None) -> Any:
    """data[name] when it has one of `types` (int excludes bool; a float field takes an int);
    absent gives None unless `required`. Anything else raises JSONFileError naming the file
    and the field (`parent.name` for a field of a nested object)."""
    label = f"{parent}.{name}" if parent else name
    if name not in data:
        if required:
            raise JSONFileError(path, "missing", label)
        return None
    value = data[name]
    if not _is_one_of(value, types):
        wanted = " or ".join(_TYPE_NAMES[t] for t in types)
        raise JSONFileError(path, f"is {_describe(value)}, expected {wanted}", label)
    return value


def _is_one_of(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _describe(value: Any) -> str:
    try:
        text = json.dumps(value)
    except RecursionError:      # a value nested deeply (but within the decoder's reach)
        text = "nested too deeply to show"
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} " \
           f"({text if len(text) <= 40 else text[:37] + '...'})"
