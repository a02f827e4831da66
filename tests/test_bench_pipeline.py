"""python -m rltlab.bench.pipeline: every notebook through `rltlab run` on a stand-in (or a given
checkpoint), one JSON row per notebook with the keys issue 59's pipeline record names."""
import json
import shutil

import pytest

from rltlab.bench import pipeline
from rltlab.common.paths import embedded_model_dir
from rltlab.model.standin import MARKER

ROW_KEYS = {"notebook", "model", "device", "commit", "wall_s", "peak_gpu_mem_gib"}
SMALL_04 = [("NUM_PROBLEMS", "4"), ("MAX_TOKENS", "8"), ("TEXT_ROWS", "2"), ("SEQ_LEN", "32"),
            ("THREADS", "1"), ("BATCH", "4")]


def _params(notebook, pairs):
    return [arg for key, value in pairs for arg in ("--param", notebook, key, value)]


@pytest.mark.slow
def test_a_standin_runs_through_the_notebook_and_each_run_is_a_row(tmp_path, capsys):
    config = json.loads((embedded_model_dir() / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "pipeline.json"
    result = pipeline.main(["--config", str(tmp_path / "config.json"), "--work-dir",
                            str(tmp_path / "work"), "--notebooks", "04_evaluate",
                            "--out", str(out)] + _params("04_evaluate", SMALL_04))
    assert result["all_finished"]
    (row,) = result["runs"]
    assert ROW_KEYS <= set(row)
    assert row["notebook"] == "04_evaluate" and row["rc"] == 0 and row["wall_s"] > 0
    assert row["device"] == "cpu" and row["peak_gpu_mem_gib"] is None   # DEVICE "auto", no GPU
    assert row["parameters"]["NUM_PROBLEMS"] == 4 and row["parameters"]["DEPTHS"] == [1, 4]
    assert row["headline"]["problems"] == 4
    assert "random weights" in row["model"]
    standin = json.loads((tmp_path / "work" / "standin" / "config.json").read_text())
    assert standin[MARKER]["random_weights"] is True
    assert json.loads(out.read_text()) == result
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_a_failing_notebook_is_a_row_with_its_error(tmp_path, capsys):
    # a checkpoint's files (rltlab run's check passes), an empty config: the notebook fails
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"")
    shutil.copy(embedded_model_dir() / "tokenizer.json", broken / "tokenizer.json")
    result = pipeline.main(["--model", str(broken), "--work-dir", str(tmp_path),
                            "--notebooks", "04", "--param", "04", "NUM_PROBLEMS", "3"])
    (row,) = result["runs"]
    assert not result["all_finished"] and row["rc"] != 0 and row["notebook"] == "04_evaluate"
    assert str(broken) in row["log_tail"]
    assert row["device"] is None and row["headline"] is None
    out = capsys.readouterr().out   # the failure is printed too, with no "None GiB"
    assert f"[pipeline] 04_evaluate failed: ValueError: {broken}/config.json: config has no" in out
    assert "None GiB" not in out


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --config --model is required"),
    (["--model", "MODEL", "--notebooks", "05_nothing"], "unknown notebook(s) ['05_nothing']"),
    (["--model", "MODEL", "--param", "05_nothing", "K", "1"], "unknown notebook(s)"),
    (["--model", "MODEL", "--param", "04", "NUM_PROBLEMS", "-3"], "NUM_PROBLEMS"),
    (["--model", "MODEL", "--param", "04", "NO_SUCH", "1"], "unknown parameter(s) NO_SUCH"),
    (["--model", "MODEL", "--notebooks", "04", "--param", "03", "STEPS", "1"],
     "--param for 03_train_draft_heads, which --notebooks does not run"),
    (["--model", "MODEL", "--jobs", "0"], "--jobs must be >= 1"),
    (["--model", "MODEL", "--timeout", "0"], "--timeout must be > 0"),
    (["--model", "/nonexistent"], "no config.json there"),
    (["--config", "/nonexistent/config.json"], "no such file"),
])
def test_bad_arguments_are_one_error_line(argv, message, capsys):
    argv = [str(embedded_model_dir()) if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_each_finished_notebook_reaches_the_json_before_the_run_ends(tmp_path, monkeypatch):
    """A run stopped after notebook 10 (a device time limit, a crash) keeps notebook 10's row
    in --out, marked not all finished."""
    out = tmp_path / "pipeline.json"

    def fake_run(notebook, model_dir, params, run_dir, timeout):
        if notebook != pipeline.MAIN_JOB:
            assert json.loads(out.read_text())["runs"][0]["notebook"] == pipeline.MAIN_JOB
            raise KeyboardInterrupt   # the run is stopped here
        return {"notebook": notebook, "rc": 0, "wall_s": 1.0, "device": "cuda",
                "peak_gpu_mem_gib": 2.0}

    monkeypatch.setattr(pipeline, "run_notebook", fake_run)
    with pytest.raises(KeyboardInterrupt):
        pipeline.main(["--model", str(embedded_model_dir()), "--work-dir", str(tmp_path),
                       "--notebooks", pipeline.MAIN_JOB, "04_evaluate", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["all_finished"] is False
    assert [r["notebook"] for r in saved["runs"]] == [pipeline.MAIN_JOB]
    assert ROW_KEYS <= set(saved["runs"][0])
