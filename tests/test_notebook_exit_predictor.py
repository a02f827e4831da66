"""Notebook 02 (N+2 exit predictor) runs end to end through papermill with tiny parameters."""
import json
import math

from rltlab.workbench import runs
from rltlab.common.paths import REPO_ROOT


def test_exit_predictor_notebook(tmp_path):
    params = {"ARITH_PROMPTS": 12, "TEXT_PROMPTS": 4, "MAX_TOKENS": 12, "TEXT_TOKENS": 8,
              "EPOCHS": 3, "EVAL_PROBLEMS": 6, "TEXT_ROWS": 1, "Q_THRESHOLDS": [0.5],
              "DELAYED_THRESHOLDS": [0.9], "DELTA_EPS": [0.4], "KL_EPS": [0.01],
              "LOOKAHEAD_THRESHOLDS": [0.5], "CONCURRENCY": [], "THREADS": 1}
    run_dir = runs.execute_notebook(REPO_ROOT / "notebooks" / "02_train_exit_predictor.ipynb",
                                    params, run_dir=tmp_path / "run", progress=False)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    policies = {row["policy"] for row in metrics["arithmetic"]}
    assert {"fixed", "oracle"} <= policies and any("n_plus_2" in p for p in policies)
    for row in metrics["arithmetic"]:
        assert 0.0 <= row["quality"] <= 100.0
        assert 1.0 <= row["mean_rounds"] <= 4.0 and not math.isnan(row["mean_rounds"])
    # The N+2 policy can only exit at round 3 or 4 (R = 4, decision after round 1).
    head = metrics["headline"]
    assert 3.0 <= head["mean_rounds"] <= 4.0
    assert metrics["trace_tokens"] > 0
