"""Run directories and papermill execution (rltlab.workbench.runs, rltlab runs_cli)."""
import argparse
import json
import shutil
from pathlib import Path

import pytest

from rltlab.workbench import runs
from rltlab.workbench import runs_cli

NOTEBOOK = Path(__file__).parent / "data" / "tiny_notebook.ipynb"


def test_write_json_atomic_replaces_and_cleans(tmp_path):
    path = tmp_path / "sub" / "x.json"
    runs.write_json_atomic(path, {"a": 1, "nan": float("nan"), "p": tmp_path})
    runs.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temp files left
    with pytest.raises(TypeError):
        runs.write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"a": 2}  # a failed write leaves the old file
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_new_run_dir_numbering(tmp_path):
    import datetime as dt
    day = dt.date(2026, 11, 29)
    a = runs.new_run_dir("loop test", root=tmp_path, date=day)
    b = runs.new_run_dir("loop test", root=tmp_path, date=day)
    c = runs.new_run_dir("loop test", root=tmp_path, date=day)
    assert [a.name, b.name, c.name] == ["2026-11-29-loop-test", "2026-11-29-loop-test-2",
                                        "2026-11-29-loop-test-3"]


def test_parameters_and_coercion():
    params = runs.notebook_parameters(NOTEBOOK)
    assert params["STEPS"]["default"] == 3 and params["STEPS"]["type"] == "int"
    assert params["RUN_DIR"]["help"].startswith("run directory")  # '=' in comments is fine
    out = runs.coerce_parameters(NOTEBOOK, {"STEPS": "7", "SCALE": "2", "FAIL": "false",
                                            "LABEL": "None", "RUN_DIR": "/x"})
    assert out == {"STEPS": 7, "SCALE": 2.0, "FAIL": False, "LABEL": "None", "RUN_DIR": "/x"}
    with pytest.raises(ValueError, match="unknown parameter.*NOPE.*known: FAIL, LABEL"):
        runs.coerce_parameters(NOTEBOOK, {"NOPE": "1"})
    with pytest.raises(ValueError, match="STEPS='x'.*int"):
        runs.coerce_parameters(NOTEBOOK, {"STEPS": "x"})


def test_shipped_notebooks_bound_their_numbers_and_explain_bare_names():
    """A number or list of numbers out of range failed deep inside a notebook (04's
    THRESHOLDS [0.5, 2] after loading the model); `nan` gave ast's "malformed node"."""
    free = {"SEED", "CRASH_AT_ITERATION"}   # any int is a seed; -1 turns the crash hook off
    for notebook in sorted(runs.NOTEBOOKS_DIR.glob("*.ipynb")):
        for name, spec in runs.notebook_parameters(notebook).items():
            if spec["type"] in ("int", "float", "list") and name not in free:
                assert spec.get("bounds") or spec.get("choices"), (notebook.stem, name)
    evaluate = runs.resolve_notebook("04")
    with pytest.raises(ValueError, match="THRESHOLDS.*<= 1"):
        runs.coerce_parameters(evaluate, {"THRESHOLDS": "[0.5, 2]"})
    with pytest.raises(ValueError, match="bare name such as nan"):
        runs.coerce_parameters(evaluate, {"THRESHOLDS": "[0.5, nan]"})
    # notebook 02's evaluation needs a text row (TEXT_ROWS 0 passed, then failed inside)
    with pytest.raises(ValueError, match="TEXT_ROWS.*>= 1"):
        runs.coerce_parameters(runs.resolve_notebook("02"), {"TEXT_ROWS": "0"})


def test_resolve_notebook_short_names(tmp_path, monkeypatch):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    for stem in ("01_collect_traces", "04_evaluate", "10_rollout_update_evaluate"):
        shutil.copy(NOTEBOOK, nbdir / f"{stem}.ipynb")
    monkeypatch.setattr(runs, "NOTEBOOKS_DIR", nbdir)
    assert runs.resolve_notebook("10").name == "10_rollout_update_evaluate.ipynb"
    assert runs.resolve_notebook("1").name == "01_collect_traces.ipynb"
    assert runs.resolve_notebook("04_evaluate").name == "04_evaluate.ipynb"
    assert runs.resolve_notebook("10_rollout_update_evaluate.ipynb").stem.startswith("10")
    with pytest.raises(FileNotFoundError, match="matches no notebook"):
        runs.resolve_notebook("99")


def test_execute_list_and_resume(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path))
    caplog.set_level("INFO", logger="papermill")
    run_dir = runs.execute_notebook(NOTEBOOK, {"STEPS": "4", "LABEL": "hello"},
                                    name="tiny", progress=False)
    # papermill's own reader cannot parse help comments with bounds ("[>= 0]"); its warnings
    # are dropped, its other messages are not
    assert not [r for r in caplog.records if "Unable to parse line" in r.getMessage()
                or "Passed unknown parameter" in r.getMessage()]
    assert any("Input Notebook" in r.getMessage() for r in caplog.records)
    assert run_dir.parent == tmp_path and run_dir.name.endswith("-tiny")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics == {"steps": 4, "total": 9.0, "label": "hello", "types": ["int", "float"]}
    params = json.loads((run_dir / "parameters.json").read_text())
    assert params == {"STEPS": 4, "LABEL": "hello", "RUN_DIR": str(run_dir)}
    assert (run_dir / NOTEBOOK.name).is_file()  # the executed notebook

    listed = runs.list_runs()
    assert len(listed) == 1
    assert listed[0]["status"] == "finished" and listed[0]["notebook"] == "tiny_notebook"
    assert listed[0]["metrics"] == {"steps": 4, "total": 9.0}

    # Resume into the same run dir: stored parameters are the base, new ones override.
    # A failing run is recorded as failed, and the error propagates.
    with pytest.raises(Exception, match="asked to fail"):
        runs.execute_notebook(NOTEBOOK, {"FAIL": True}, run_dir=run_dir, progress=False)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and len(record["attempts"]) == 2
    assert runs.list_runs()[0]["status"] == "failed"
    assert json.loads((run_dir / "parameters.json").read_text())["STEPS"] == 4

    with pytest.raises(ValueError, match="unknown parameter"):
        runs.execute_notebook(NOTEBOOK, {"ITERATIONS": 2}, run_dir=run_dir, progress=False)


def test_cli_run_and_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path))
    parser = argparse.ArgumentParser(prog="rltlab")
    sub = parser.add_subparsers(dest="command")
    runs_cli.add_arguments(sub.add_parser("run"))
    runs_cli.add_arguments(sub.add_parser("runs"))

    args = parser.parse_args(["run", str(NOTEBOOK), "-p", "BOGUS", "1"])
    assert runs_cli.main(args) == 2
    assert "unknown parameter(s) BOGUS" in capsys.readouterr().err

    args = parser.parse_args(["run", str(NOTEBOOK), "-p", "STEPS", "2", "--name", "cli",
                              "--no-progress"])
    assert runs_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "run dir:" in out and "steps=2" in out
    assert runs_cli.main(parser.parse_args(["runs"])) == 0
    table = capsys.readouterr().out
    assert "-cli" in table and "finished" in table and "steps=2" in table


def test_the_workbench_silences_tqdms_missing_widgets_warning():
    """Every cell with a progress bar printed tqdm's "IProgress not found" warning under
    papermill (no ipywidgets); the text bars it falls back to are what the notebooks want. In a
    fresh interpreter, as a notebook kernel imports the workbench (pytest resets filters)."""
    import subprocess
    import sys

    code = ("import warnings, rltlab.workbench\n"
            "warnings.warn('IProgress not found. Please update jupyter and ipywidgets.')\n"
            "warnings.warn('another warning')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0
    assert "another warning" in done.stderr and "IProgress" not in done.stderr
