"""The ``parameters`` cell of a workbench notebook: names, defaults, types, help and bounds.

Every top-level ``NAME = <literal>  # help`` line of the cell is a parameter. A help comment may
end with bounds in brackets, which every value must meet (each element of a list), and which
may begin with "non-empty" for a list that an empty value would break:

    NUM_PROMPTS = 64  # training-split arithmetic prompts [>= 1]
    THRESHOLDS = [0.3, 0.5, 1.0]  # Q-exit threshold sweep [non-empty, >= 0, <= 1]

Values given as strings (from the CLI) are converted to the type of the default; unknown names
are rejected with the list of known ones; a value out of bounds is rejected naming the
parameter and the bound; NaN and +-inf are rejected for every parameter (none takes them). None
is accepted for a bounded parameter only when its default is None.

A help comment may instead end with the values a string parameter takes, which every value must
be one of:

    TASKS = "embedded"  # problem set [one of: embedded, gsm8k]

A parameter named DEVICE must name a device this machine runs on ("auto": CUDA where there is
one, else the CPU; "cpu", "cuda", "cuda:N"): `-p DEVICE tpu` is refused in one line before the
notebook starts (rltlab.common.device.resolve_device).
"""
from __future__ import annotations

import ast
import io
import math
import operator
import os
import re
import tokenize
from pathlib import Path
from typing import Any

_BOUNDS_RE = re.compile(r"\s*\[\s*(non-empty\s*(?:,|(?=\])))?"
                        r"((?:\s*[<>]=?\s*-?[0-9.eE+-]+\s*,?)*)\]\s*$")
_BOUND_RE = re.compile(r"([<>]=?)\s*(-?[0-9.eE+-]+)")
_CHOICES_RE = re.compile(r"\s*\[one of:\s*([^\]]+)\]\s*$")
DEVICE_PARAMETER = "DEVICE"
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_TRUE, _FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}


def resume_check(notebook_path: str | os.PathLike):
    """The notebook's own check of a resumed run's parameters, named in its metadata
    (``"rltlab": {"resume_check": "module:function"}``), or None: function(run_dir,
    parameters) raises a ValueError, before `rltlab run` writes anything, where the run
    directory's finished work was made with parameters that cannot resume it."""
    import importlib
    import nbformat

    name = nbformat.read(str(notebook_path), as_version=4).metadata.get(
        "rltlab", {}).get("resume_check")
    if not name:
        return None
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def notebook_parameters(notebook_path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ``parameters`` cell of a notebook: name -> {default, type, help, bounds}.

    Parsed with `ast` (papermill's own inspection trips over '=' inside comments): every
    top-level ``NAME = <literal>`` assignment is a parameter; `type` is the default's type
    name (an annotation wins), `help` the trailing comment, `bounds` the [(op, number)] pairs
    at the end of the help comment and `non_empty` whether they begin with "non-empty",
    `choices` the values of a trailing "[one of: a, b]".
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
        help_text = comments.get(node.lineno, "")
        match = _BOUNDS_RE.search(help_text)
        if match and not (match.group(1) or match.group(2).strip()):
            match = None   # "[]": no bounds
        bounds = [(op, float(num)) for op, num in _BOUND_RE.findall(match.group(2))] \
            if match else []
        choices = _CHOICES_RE.search(help_text)
        params[name] = {"default": default, "type": type_name, "help": help_text,
                        "bounds": bounds, "non_empty": bool(match and match.group(1)),
                        "choices": [c.strip() for c in choices.group(1).split(",") if c.strip()]
                        if choices else []}
    return params


def coerce_parameters(notebook_path: str | os.PathLike, parameters: dict[str, Any]
                      ) -> dict[str, Any]:
    """Check names against the parameters cell, convert string values to the defaults' types
    and check the bounds. "None"/"null" give None for any parameter."""
    known = notebook_parameters(notebook_path)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        names = ", ".join(sorted(known)) or "(the notebook has no parameters cell)"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for "
                         f"{Path(notebook_path).name}; known: {names}")
    out = {}
    for name, value in parameters.items():
        out[name] = _coerce(name, value, known[name]) if isinstance(value, str) else value
    check_bounds(known, out)
    return out


def check_bounds(known: dict[str, dict[str, Any]], values: dict[str, Any],
                 source: str | None = None) -> None:
    """Raise ValueError naming the first parameter whose value breaks its declared bounds or
    choices, or a DEVICE this machine cannot run on (`source`, e.g. a parameters.json, is
    named as where the value came from)."""
    for name, value in values.items():
        spec = known.get(name, {})
        _check_finite(name, value, source)
        _check_choices(name, value, spec, source)
        if name == DEVICE_PARAMETER:
            _check_device(name, value, source)
        if spec.get("non_empty") and isinstance(value, (list, tuple)) and not value:
            origin = f" (from {source})" if source else ""
            raise ValueError(f"parameter {name}={value!r}{origin}: {name} must not be empty")
        bounds = spec.get("bounds")
        if not bounds or (value is None and spec["default"] is None):
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            ok = isinstance(item, (int, float)) and not isinstance(item, bool) and all(
                _OPS[op](item, limit) for op, limit in bounds)
            if not ok:
                rule = ", ".join(f"{op} {limit:g}" for op, limit in bounds)
                what = f"every element of {name}" if items is value else name
                origin = f" (from {source})" if source else ""
                raise ValueError(f"parameter {name}={value!r}{origin}: {what} must be a "
                                 f"number {rule}")


def check_inputs(known: dict[str, dict[str, Any]], values: dict[str, Any],
                 source: str | None = None) -> None:
    """Raise ValueError in one line for inputs a notebook would only find missing after it
    started (its defaults where `values` has no entry): a MODEL_DIR or TRACE_DIR that is not
    a directory, a MODEL_DIR without a checkpoint's files (config.json, tokenizer.json,
    model.safetensors or its index), TASKS "gsm8k" without GSM8K_PATH, a GSM8K_PATH that is
    not a file."""
    value = {name: values.get(name, spec["default"]) for name, spec in known.items()}
    origin = f" (from {source})" if source else ""
    for name in ("MODEL_DIR", "TRACE_DIR"):
        if value.get(name) is not None and not Path(value[name]).expanduser().is_dir():
            raise ValueError(f"parameter {name}={value[name]!r}{origin}: not a directory")
    if value.get("MODEL_DIR") is not None:
        root = Path(value["MODEL_DIR"]).expanduser()
        missing = [f for f in ("config.json", "tokenizer.json") if not (root / f).is_file()]
        if not any((root / f).is_file() for f in ("model.safetensors",
                                                  "model.safetensors.index.json")):
            missing.append("model.safetensors (or model.safetensors.index.json)")
        if missing:
            raise ValueError(f"parameter MODEL_DIR={value['MODEL_DIR']!r}{origin}: not a "
                             f"checkpoint directory, it has no {', '.join(missing)}")
    if value.get("TASKS") == "gsm8k" and not value.get("GSM8K_PATH"):
        raise ValueError(f"parameter TASKS='gsm8k'{origin} needs GSM8K_PATH: a local JSONL of "
                         "question / answer records")
    path = value.get("GSM8K_PATH")
    if path is not None and not Path(path).expanduser().is_file():
        what = "a directory, not a file" if Path(path).expanduser().is_dir() else "no such file"
        raise ValueError(f"parameter GSM8K_PATH={path!r}{origin}: {what}")


def _check_choices(name: str, value: Any, spec: dict[str, Any], source: str | None) -> None:
    choices = spec.get("choices")
    if not choices or (value is None and spec.get("default") is None) or value in choices:
        return
    origin = f" (from {source})" if source else ""
    raise ValueError(f"parameter {name}={value!r}{origin}: {name} must be one of "
                     f"{', '.join(choices)}")


def _check_device(name: str, value: Any, source: str | None) -> None:
    """DEVICE: "auto" (no torch import), or a device this machine runs on."""
    if value == "auto" or value is None:
        return
    origin = f" (from {source})" if source else ""
    # the notebooks run on the CPU or CUDA only (mps and meta passed and failed inside)
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value.strip()):
        raise ValueError(f"parameter {name}={value!r}{origin}: {name} must be 'auto', 'cpu', "
                         "'cuda' or 'cuda:N'")
    from rltlab.common.device import resolve_device   # imports torch: only for a set device

    try:
        resolve_device(value)
    except ValueError as err:
        raise ValueError(f"parameter {name}={value!r}{origin}: {err}") from None


def _check_finite(name: str, value: Any, source: str | None) -> None:
    """No parameter takes NaN or +-inf (a learning rate of inf turned Stage II into NaN, and
    parameters.json can only record it as null): refused for every float, list elements too."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, float) and not math.isfinite(item):
            what = f"every element of {name}" if items is value else name
            origin = f" (from {source})" if source else ""
            raise ValueError(f"parameter {name}={value!r}{origin}: {what} must be finite "
                             "(no parameter takes NaN or infinity)")


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
        why = str(err)
        if why.startswith("malformed node"):   # ast's words for a bare name, e.g. nan
            why = ("not a Python literal: write numbers, quoted strings and [lists] of them "
                   "(a bare name such as nan or inf is not one)")
        raise ValueError(f"parameter {name}={text!r}: cannot convert to {type_name} "
                         f"(default {default!r}): {why}") from None
