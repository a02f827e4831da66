"""Reading JSON metadata files (manifests, checkpoint metadata) with errors that name the file and
the field: a truncated file, a list where an object belongs, a missing or mistyped field all
raise ValueError("<file>: field 'x' ...") instead of a bare JSONDecodeError, KeyError or
AttributeError from deep inside the reader."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The object a JSON file holds (FileNotFoundError if there is none)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a finite float (not a bool)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


# kind -> (check, description) for `field`
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "count": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "number": (is_number, "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON array"),
}


def field(data: dict[str, Any], key: str, path: str | os.PathLike, kind: str, *,
          where: str = "", optional: bool = False) -> Any:
    """data[key] after checking it is of `kind` (see KINDS; "object?" etc. also allow null).
    where: the enclosing field's name for the message ("shards[3]." -> field 'shards[3].file')."""
    nullable = kind.endswith("?")
    check, description = KINDS[kind.rstrip("?")]
    if key not in data:
        if optional:
            return None
        raise ValueError(f"{path}: field '{where}{key}' is missing")
    value = data[key]
    if (value is None and nullable) or check(value):
        return value
    raise ValueError(f"{path}: field '{where}{key}' must be {description}"
                     f"{' or null' if nullable else ''}, got {value!r:.80}")
