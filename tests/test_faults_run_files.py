"""Fault suite, run files (issue 18, section E): damaged run.json / parameters.json /
iteration results are named and left alone, and non-positive counts are refused before a run
starts. The run-directory faults (section C) are in test_faults_runs.py; docs/reliability.md
lists each fault with its test."""
import json

import pytest

from rltlab.workbench import runs
from test_faults_runs import NOTEBOOKS, TINY, _cli, _snapshot

def test_damaged_run_files_are_named_and_left_alone(tmp_path):
    """E: a truncated or odd run.json / parameters.json raised a bare JSONDecodeError (or an
    AttributeError after parameters.json was rewritten)."""
    good_run = json.dumps({"notebook_name": "tiny_notebook", "status": "finished",
                           "attempts": []})
    cases = [({"run.json": '{"notebook_name": "tiny_notebook", "attem'}, "run.json: truncated"),
             ({"run.json": '{"notebook_name": "tiny_notebook", "attempts": 5}'},
              r"run.json: field 'attempts': is an integer \(5\), expected a list"),
             ({"run.json": good_run, "parameters.json": '{"STEPS": 4,'},
              "parameters.json: truncated"),
             ({"run.json": good_run, "parameters.json": '["STEPS"]'},
              "parameters.json: holds a list"),
             ({"run.json": good_run, "parameters.json": '{"STEPS": -3}'},
              r"STEPS=-3 \(from .*parameters.json\): STEPS must be a number >= 0")]
    for i, (files, message) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        for name, text in files.items():
            (run_dir / name).write_text(text)
        before = _snapshot(run_dir)
        with pytest.raises(ValueError, match=message):
            runs.execute_notebook(TINY, {"LABEL": "x"}, run_dir=run_dir, progress=False)
        assert {k: v for k, v in _snapshot(run_dir).items() if k != runs.LOCK_FILE} == before


def test_damaged_iteration_result_is_named(tmp_path):
    """E: a truncated or odd iter_k/result.json failed deep in the loop without its name."""
    from rltlab.loop import LoopConfig, setup
    from tiny_models import tiny_engine_model

    for text, message in [('{"iteration": 0, "new_weight', "result.json: truncated"),
                          ('{"iteration": 0, "new_weight_version": 1, "after": []}',
                           "result.json: field 'config': missing"),
                          ('[]', "result.json: holds a list"),
                          (json.dumps(_result_fields(after={"version": 1, "rows": {},
                                                            "scores": {}})),
                           r"result.json: field 'after.rows': is an object")]:
        run_dir = tmp_path / "run"
        (run_dir / "iter_0").mkdir(parents=True, exist_ok=True)
        (run_dir / "iter_0" / "result.json").write_text(text)
        before = _snapshot(run_dir)
        with pytest.raises(ValueError, match=message):      # a JSONFileError
            setup(run_dir, tiny_engine_model(), None, LoopConfig())
        assert _snapshot(run_dir) == before        # no loop_config.json written


def _result_fields(**over):
    ev = {"version": 0, "rows": [], "scores": {}}
    return {"iteration": 0, "new_weight_version": 1, "config": {}, "gate_training": {},
            "rollout_weight_versions": [0], "trace_weight_versions": [0], "trace_tokens": 1,
            "started": "now", "seconds": 1.0, "before": ev, "after": {**ev, "version": 1},
            **over}


def test_nonpositive_counts_are_refused(tmp_path, monkeypatch, capsys):
    """E: `rltlab run 01 -p NUM_PROMPTS 0` / `-3` started the notebook."""
    nb01 = NOTEBOOKS / "01_collect_traces.ipynb"
    nb10 = NOTEBOOKS / "10_rollout_update_evaluate.ipynb"
    for value in ("0", "-3"):
        with pytest.raises(ValueError, match=f"NUM_PROMPTS={value}: NUM_PROMPTS must be a "
                                             "number >= 1"):
            runs.coerce_parameters(nb01, {"NUM_PROMPTS": value})
    with pytest.raises(ValueError, match="every element of THRESHOLDS must be a number >= 0, "
                                         "<= 1"):
        runs.coerce_parameters(nb10, {"THRESHOLDS": "[0.5, 2.0]"})
    with pytest.raises(ValueError, match="GATE_VAL_FRACTION"):
        runs.coerce_parameters(nb10, {"GATE_VAL_FRACTION": 1.0})
    with pytest.raises(ValueError, match="MAX_TOKENS=None"):
        runs.coerce_parameters(nb01, {"MAX_TOKENS": "None"})
    assert runs.coerce_parameters(nb01, {"NUM_PROMPTS": "1", "PROJECTION_DIM": "None"}) == {
        "NUM_PROMPTS": 1, "PROJECTION_DIM": None}
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path))
    assert _cli("run", "01", "-p", "NUM_PROMPTS", "-3", "--no-progress") == 2
    assert "NUM_PROMPTS=-3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="NUM_PROMPTS=0"):
        runs.execute_notebook(nb01, {"NUM_PROMPTS": 0}, progress=False)
    assert list(tmp_path.iterdir()) == []          # no run directory was made


@pytest.mark.parametrize("name,value", [("GATE_LR", "inf"), ("GATE_LR", "nan"),
                                        ("GATE_LR", "-inf"), ("GATE_LR", "Infinity"),
                                        ("NONINFERIORITY_MARGIN_PP", "inf"),
                                        ("THRESHOLDS", "[0.5, 1e999]"),
                                        ("ROLLOUT_HOPS_SHARE", "nan")])
def test_non_finite_parameters_are_refused(name, value):
    """E: `rltlab run 10 -p GATE_LR inf` passed its [>= 0] bound: Stage II went NaN and
    parameters.json recorded null (the resume was refused)."""
    nb10 = NOTEBOOKS / "10_rollout_update_evaluate.ipynb"
    with pytest.raises(ValueError, match=f"parameter {name}=.*finite"):
        runs.coerce_parameters(nb10, {name: value})


def test_non_finite_values_are_refused_for_any_numeric_parameter(tmp_path):
    """Unbounded float parameters (tiny_notebook's SCALE) and values given as numbers or read
    back from a parameters.json are refused too."""
    for value in ("inf", "nan", float("inf"), float("nan"), [1.0, float("inf")]):
        with pytest.raises(ValueError, match="SCALE=.*must be finite"):
            runs.coerce_parameters(TINY, {"SCALE": value})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"notebook_name": "tiny_notebook",
                                                  "status": "finished", "attempts": []}))
    (run_dir / "parameters.json").write_text('{"SCALE": Infinity}')
    with pytest.raises(ValueError, match=r"SCALE=inf \(from .*parameters.json\).*finite"):
        runs.execute_notebook(TINY, {"LABEL": "x"}, run_dir=run_dir, progress=False)
