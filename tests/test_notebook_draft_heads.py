"""Notebook 03 (draft heads) runs end to end through papermill with tiny parameters."""
import json

import pytest

from rltlab.workbench import runs
from rltlab.common.paths import REPO_ROOT


@pytest.mark.parametrize("kind", ["residual_mlp", "lora_lm_head"])
@pytest.mark.slow
def test_draft_heads_notebook(kind, tmp_path):
    params = {"KIND": kind, "TRAIN_ROWS": 8, "HELDOUT_ROWS": 4, "SEQ_LEN": 96, "STEPS": 3,
              "NUM_PROMPTS": 2, "MAX_TOKENS": 6, "K": 2, "THREADS": 1}
    run_dir = runs.execute_notebook(REPO_ROOT / "notebooks" / "03_train_draft_heads.ipynb",
                                    params, run_dir=tmp_path / "run", progress=False)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    head = metrics["headline"]
    assert head["identical_at_t0"] is True          # lossless at T=0 on every prompt
    # the reference decoder drafts K every step: tau (tokens per verification step) is
    # 1 + K * acceptance
    assert head["tau"] == pytest.approx(1 + params["K"] * head["acceptance"])
    for row in metrics["speed"][1:]:
        assert row["tau"] == pytest.approx(1 + params["K"] * row["acceptance"])
        assert row["speedup_vs_target"] == pytest.approx(row["tok_s"]
                                                         / metrics["speed"][0]["tok_s"])
    # held-out agreement: a fraction of the HELDOUT_ROWS x SEQ_LEN tokens (one batch)
    agreed = head["heldout_agree"] * params["HELDOUT_ROWS"] * params["SEQ_LEN"]
    assert agreed == pytest.approx(round(agreed), abs=1e-3)
    assert (run_dir / "draft_component").is_dir()
    # cost figures at the model's hidden size and vocabulary (the embedded model: 384, 1024)
    comp = metrics["component"]
    assert comp["hidden_size"] == 384 and comp["vocab_size"] == 1024
    assert comp["parameters"] == {"residual_mlp": 384 + 2 * 384 * 768,
                                  "lora_lm_head": 16 * 384 + 1024 * 16}[kind]
    assert comp["peak_mem_gib"] is None and comp["seconds"] > 0 and metrics["device"] == "cpu"
    assert head["component_parameters"] == comp["parameters"]
