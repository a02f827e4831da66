"""Resuming the loop: read the finished iterations' result.json (checked: a damaged file is
named with its field) and refuse parameters or a model that differ from theirs, by name."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from rltlab.common.atomic import _jsonable
from rltlab.common.json_files import JSONFileError, check_field, read_json_file
from rltlab.loop.config import LEGACY_VALUES, RESUMABLE_FIELDS, LoopConfig, ResumeMismatch

RESULT_FILE = "result.json"


def read_result(run_dir: str | os.PathLike, k: int) -> dict[str, Any]:
    """iter_k/result.json, with the fields a resume and the loop's metrics use checked."""
    path = Path(run_dir) / f"iter_{k}" / RESULT_FILE
    res = read_json_file(path)
    if check_field(res, path, "iteration", int, required=True) != k:
        raise JSONFileError(path, f"is {res['iteration']}, expected {k} (the directory's "
                                  "number)", "iteration")
    if check_field(res, path, "new_weight_version", int, required=True) != k + 1:
        raise JSONFileError(path, f"is {res['new_weight_version']}, expected {k + 1}",
                            "new_weight_version")
    for name in ("config", "gate_training"):
        check_field(res, path, name, dict, required=True)
    for name in ("rollout_weight_versions", "trace_weight_versions"):
        check_field(res, path, name, list, required=True)
    check_field(res, path, "trace_tokens", int, required=True)
    check_field(res, path, "started", str, required=True)
    check_field(res, path, "seconds", float, required=True)
    for name in ("before", "after"):
        ev = check_field(res, path, name, dict, required=True)
        check_field(ev, path, "version", int, required=True, parent=name)
        check_field(ev, path, "scores", dict, required=True, parent=name)
        rows = check_field(ev, path, "rows", list, required=True, parent=name)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise JSONFileError(path, "is not an object", f"{name}.rows[{i}]")
    return res


def check_resume(run_dir: str | os.PathLike, cfg: LoopConfig, results: Sequence[dict[str, Any]],
                 model=None) -> None:
    """Refuse to resume finished iterations with other parameters (all but RESUMABLE_FIELDS)
    or, when `model` is given, another model (iteration 0's traces record its hash)."""
    if not results:
        return
    now = json.loads(json.dumps(_jsonable(asdict(cfg))))
    defaults = json.loads(json.dumps(_jsonable(asdict(LoopConfig()))))
    differ: dict[str, tuple[Any, list[int]]] = {}
    for res in results:
        old = res["config"]
        for name, value in now.items():
            if name in RESUMABLE_FIELDS:
                continue
            # a field added since: what the iteration ran with before it existed
            before = old.get(name, LEGACY_VALUES.get(name, defaults[name]))
            if before != value:
                differ.setdefault(name, (before, []))[1].append(res["iteration"])
    lines = [f"{name.upper()}: {before!r} in iteration(s) {_span(its)}, {now[name]!r} now"
             for name, (before, its) in differ.items()]
    recorded = results[0].get("trace_model_hashes", {}).get("0")
    if model is not None and recorded:
        from rltlab.model.checkpoint import model_hash

        current = model_hash(model)
        if current != recorded:
            lines.append(f"MODEL_DIR: the model (hash {current}) is not the one iteration 0 "
                         f"rolled out with (hash {recorded})")
    if lines:
        raise ResumeMismatch(
            f"{len(results)} finished iteration(s) in this run directory were made with other "
            "parameters:\n  " + "\n  ".join(lines) + "\nResume with their values, use a new "
            f"run directory, or discard them: rltlab run 10 --run-dir {run_dir} --start-over")


def check_run_parameters(run_dir: str | os.PathLike, parameters: dict[str, Any]) -> None:
    """Notebook 10's resume check for `rltlab run`, before anything in run_dir is written:
    the notebook's parameters by name (every one, defaults filled in) against the finished
    iterations' configs, as setup() checks them (check_resume; the model is checked there).
    Raises ResumeMismatch (or JSONFileError for a damaged result.json)."""
    done, k = [], 0
    while (Path(run_dir) / f"iter_{k}" / RESULT_FILE).is_file():
        done.append(read_result(run_dir, k))
        k += 1
    check_resume(run_dir, LoopConfig.from_parameters(parameters), done)


def _span(its: list[int]) -> str:
    return ", ".join(map(str, its))
