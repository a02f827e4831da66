"""Notebook 02 (N+2 exit predictor) runs end to end through papermill with tiny parameters."""
import json

import pytest

from rltlab.workbench import runs
from rltlab.common.paths import REPO_ROOT


SMALL = {"ARITH_PROMPTS": 12, "TEXT_PROMPTS": 4, "MAX_TOKENS": 12, "TEXT_TOKENS": 8,
         "EPOCHS": 3, "EVAL_PROBLEMS": 6, "TEXT_ROWS": 1, "Q_THRESHOLDS": [0.5],
         "DELAYED_THRESHOLDS": [0.9], "DELTA_EPS": [0.4], "KL_EPS": [0.01],
         "LOOKAHEAD_THRESHOLDS": [0.5], "CONCURRENCY": [], "THREADS": 1}


@pytest.mark.slow
def test_exit_predictor_notebook(tmp_path):
    params = SMALL
    run_dir = runs.execute_notebook(REPO_ROOT / "notebooks" / "02_train_exit_predictor.ipynb",
                                    params, run_dir=tmp_path / "run", progress=False)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    policies = {row["policy"] for row in metrics["arithmetic"]}
    assert {"fixed", "oracle"} <= policies and any("n_plus_2" in p for p in policies)
    n = params["EVAL_PROBLEMS"]
    depth4 = next(r for r in metrics["arithmetic"] if r["key"] == "fixed depth=4")
    for row in metrics["arithmetic"]:
        # EM is a count of the n problems; the paired difference vs depth 4 of 0/1 scores is
        # (wins - losses) / n and equals the difference of the two means
        assert row["quality"] / 100 * n == pytest.approx(round(row["quality"] / 100 * n))
        assert row["diff_pp"] == pytest.approx(100 * (row["wins"] - row["losses"]) / n)
        assert row["diff_pp"] == pytest.approx(row["quality"] - depth4["quality"])
        hist = {int(d): c for d, c in row["executed_hist"].items() if c}
        assert sum(hist.values()) == row["decode_tokens"] > 0
        assert row["mean_rounds"] == pytest.approx(
            sum(d * c for d, c in hist.items()) / row["decode_tokens"])
        if row["policy"] == "fixed":
            assert set(hist) == {int(row["setting"].split("=")[1])}
        if "n_plus_2" in row["policy"]:   # decision after round 1: exit at N + 2 = 3 or R = 4
            assert set(hist) <= {3, 4}
    head, acc = metrics["headline"], metrics["acceptance"]
    cal = next(r for r in metrics["arithmetic"] if r["policy"] == "n_plus_2"
               and r["setting"] == head["setting"])
    assert head["mean_rounds"] == cal["mean_rounds"] and head["quality"] == cal["quality"]
    assert head["rounds_saved_frac"] == pytest.approx((4 - head["mean_rounds"]) / 4)
    # "beats Q-exit" needs a paired margin of 2 SE (rltlab.exit_predictor.report): on a random
    # model every policy scores the same, so it cannot be met
    assert acc["targets"]["beats_q_exit"] is False and head["met"] is False
    assert metrics["trace_tokens"] > 0
    # cost figures at the model's shape: an MLP of in_dim -> 64 -> 1 trained on DEVICE (cpu)
    comp = metrics["component"]
    assert comp["hidden_size"] == 384 and comp["vocab_size"] == 1024
    assert comp["in_dim"] == 384 + 1 + 3        # h_1, g_1, the round's 3 probability stats
    assert comp["parameters"] == head["predictor_parameters"] == comp["in_dim"] * 64 + 64 + 65
    assert comp["train_device"] == "cpu" and comp["peak_mem_gib"] is None
    assert comp["train_seconds"] > 0 and metrics["device"] == "cpu"
    manifest = json.loads((run_dir / "traces" / "manifest.json").read_text())
    assert manifest["hidden_dtype"] == "bfloat16"   # HIDDEN_DTYPE's default


@pytest.mark.slow
def test_exit_predictor_notebook_with_the_downstream_label(tmp_path):
    run_dir = runs.execute_notebook(REPO_ROOT / "notebooks" / "02_train_exit_predictor.ipynb",
                                    {**SMALL, "LABEL": "downstream", "EVAL_PROBLEMS": 2,
                                     "LOOKAHEAD_THRESHOLDS": [], "MEMBERS": 2},
                                    run_dir=tmp_path / "run", progress=False)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    labels = metrics["downstream_labels"]
    assert labels["tokens"] == metrics["trace_tokens"] and labels["rerun_mismatches"] == 0
    assert labels["mode"] == "greedy" and labels["exit_round"] == 3
    assert 0 < labels["downstream_ok_rate"] <= labels["own_ok_rate"] <= 1
    assert metrics["predictor"]["train"]["label_rate"] == pytest.approx(
        labels["downstream_ok_rate"], abs=0.15)   # the train split's share of the same labels
    manifest = json.loads((run_dir / "predictor" / "n1" / "manifest.json").read_text())
    assert manifest["label"]["kind"] == "downstream" and manifest["label"]["mode"] == "greedy"
    assert manifest["model"]["members"] == 2   # MEMBERS reaches the training
