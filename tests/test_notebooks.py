"""Every workbench notebook runs end to end through papermill with tiny parameters, on a tiny
random model (with a small trained tokenizer) built here; plus kill-and-resume of the loop."""
import json
from pathlib import Path

import pytest
import torch

from rltlab import runs

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rltlab.checkpoint import save_pretrained
    from rltlab.config import OuroConfig
    from rltlab.data import save_tokenizer, train_tokenizer
    from rltlab.model import OuroForCausalLM

    out = tmp_path_factory.mktemp("tiny") / "model"
    tok = train_tokenizer(vocab_size=300, max_bytes=150_000)
    cfg = OuroConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     total_ut_steps=4, max_position_embeddings=1024, bos_token_id=0,
                     eos_token_id=0)
    save_pretrained(OuroForCausalLM(cfg).init_weights(0, std=0.1), out)
    save_tokenizer(tok, out)
    return out


def _run(name, params, run_dir):
    return runs.execute_notebook(NOTEBOOKS / f"{name}.ipynb", params, run_dir=run_dir,
                                 progress=False)


def _metrics(run_dir):
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def _plots_exist(metrics):
    assert metrics["plots"]
    for path in metrics["plots"]:
        assert Path(path).is_file() and Path(path).stat().st_size > 1000


def test_notebooks_are_committed_without_outputs():
    import nbformat
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        assert nb.cells[0].cell_type == "markdown"
        assert "parameters" in nb.cells[1].metadata.get("tags", [])
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name
                assert len(cell.source.splitlines()) < 25, path.name
        params = runs.notebook_parameters(path)
        assert "RUN_DIR" in params and "MODEL_DIR" in params
        assert all(name.isupper() for name in params)


def test_collect_traces_notebook(tiny_model_dir, tmp_path):
    from rltlab.traces import TraceDataset, verify_traces
    run_dir = _run("01_collect_traces", {
        "MODEL_DIR": str(tiny_model_dir), "NUM_PROMPTS": 4, "MAX_TOKENS": 8,
        "SHARD_TOKENS": 10, "THREADS": 1}, tmp_path / "collect")
    m = _metrics(run_dir)
    head = m["headline"]
    assert head["traced_tokens"] == 4 * 7 and head["shards"] == 3   # 8 tokens, first excluded
    assert head["mean_executed"] == 4.0 and 1.0 <= head["mean_selected"] <= 4.0
    assert head["overhead_x"] > 0
    assert [r["round"] for r in m["per_round"]] == [1, 2, 3, 4]
    assert all(v is not None for r in m["per_round"] for v in r.values())
    assert m["per_round"][-1]["agree_with_ref"] == 1.0 and m["per_round"][-1]["kl_ref"] < 1e-6
    assert verify_traces(m["trace_dir"])["num_tokens"] == 28
    assert len(list(TraceDataset(m["trace_dir"], fields=["token"]))) == 28
    _plots_exist(m)


def test_evaluate_notebook(tiny_model_dir, tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {i} + 1?",
                                       "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                           for i in range(3)))
    run_dir = _run("04_evaluate", {
        "MODEL_DIR": str(tiny_model_dir), "NUM_PROBLEMS": 4, "MAX_TOKENS": 8,
        "DEPTHS": [1, 4], "THRESHOLDS": [0.5], "TEXT_ROWS": 2, "SEQ_LEN": 32,
        "GSM8K_PATH": str(gsm), "GSM8K_LIMIT": 2, "GSM8K_MAX_TOKENS": 6, "THREADS": 1},
        tmp_path / "eval")
    m = _metrics(run_dir)
    pol = {r["key"]: r for r in m["policies"]}
    assert set(pol) == {"fixed depth=1", "fixed depth=4", "q_exit t=0.5"}
    assert pol["fixed depth=1"]["mean_rounds"] == 1.0 and pol["fixed depth=4"]["mean_rounds"] == 4.0
    assert 1.0 <= pol["q_exit t=0.5"]["mean_rounds"] <= 4.0
    assert all(r["quality"] is not None and r["weight_version"] == 0 for r in m["policies"])
    assert {p["setting"] for p in m["paired"]} == {"fixed depth=1", "q_exit t=0.5"}
    assert all(p["vs"] == "fixed depth=4" and p["n"] == 4 for p in m["paired"])
    assert [t["setting"] for t in m["text"]] == ["depth=1", "depth=2", "depth=3", "depth=4",
                                                "t=0.5"]
    assert all(t["loss"] > 0 and t["ppl"] is not None for t in m["text"])
    assert m["gsm8k"]["n"] == 2 and m["gsm8k"]["protocol"]["num_fewshot"] == 3
    assert m["headline"]["full_depth_quality"] is not None
    _plots_exist(m)


def test_loop_notebook_crash_and_resume(tiny_model_dir, tmp_path):
    from papermill.exceptions import PapermillExecutionError
    run_dir = tmp_path / "loop"
    params = {"MODEL_DIR": str(tiny_model_dir), "ITERATIONS": 2, "ROLLOUT_PROMPTS": 3,
              "MAX_TOKENS": 8, "EVAL_PROBLEMS": 3, "THRESHOLDS": [0.3, 1.0], "GATE_STEPS": 10,
              "THREADS": 1, "CRASH_AT_ITERATION": 1}
    with pytest.raises(PapermillExecutionError, match="simulated crash in iteration 1"):
        _run("10_rollout_update_evaluate", params, run_dir)
    assert (run_dir / "iter_0" / "result.json").is_file()
    assert not (run_dir / "iter_1").exists()
    assert not list(run_dir.glob(".iter_*"))     # the crashed iteration left nothing behind
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    first = (run_dir / "iter_0" / "result.json").read_text()
    mtime = (run_dir / "iter_0" / "result.json").stat().st_mtime_ns
    gate_mtime = (run_dir / "iter_0" / "gate.safetensors").stat().st_mtime_ns

    # Resume with more iterations: iteration 0 is loaded, 1 and 2 are computed.
    _run("10_rollout_update_evaluate", {"ITERATIONS": 3, "CRASH_AT_ITERATION": -1}, run_dir)
    assert (run_dir / "iter_0" / "result.json").read_text() == first
    assert (run_dir / "iter_0" / "result.json").stat().st_mtime_ns == mtime
    assert (run_dir / "iter_0" / "gate.safetensors").stat().st_mtime_ns == gate_mtime
    m = _metrics(run_dir)
    assert m["resumed_from"] == 1 and m["headline"]["iterations"] == 3
    assert m["headline"]["final_weight_version"] == 3
    its = m["iterations"]
    assert [i["rollout_weight_versions"] for i in its] == [[0], [1], [2]]
    assert [i["trace_weight_versions"] for i in its] == [[0], [1], [2]]
    assert [i["new_weight_version"] for i in its] == [1, 2, 3]
    assert all(i["gate_loss_after"] < i["gate_loss_before"] for i in its)
    assert json.loads((run_dir / "iter_0" / "result.json").read_text())["started"] == \
        its[0]["started"]
    assert its[1]["started"] > its[0]["started"] or its[1]["started"] >= its[0]["started"]
    curves = m["curves"]
    assert sorted({c["weight_version"] for c in curves}) == [0, 1, 2, 3]
    assert len(curves) == 4 * 2
    assert all(c["quality"] is not None and c["mean_rounds"] is not None for c in curves)
    full = [c for c in curves if c["threshold"] == 1.0]
    assert all(c["mean_rounds"] == 4.0 for c in full)   # threshold 1.0 = full depth
    # the gate at version k+1 is what iteration k trained
    from rltlab.loop import load_gate
    gate = load_gate(run_dir / "iter_2" / "gate.safetensors")
    assert set(gate) == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    _plots_exist(m)


def test_stage2_targets_match_pretrain_stage2_loss():
    """The loop's Stage II on traces = rltlab.pretrain.stage2_loss on the same full-depth
    hidden states (same labels, same BCE)."""
    pretrain = pytest.importorskip("rltlab.pretrain")
    import torch.nn.functional as F
    from rltlab.config import OuroConfig
    from rltlab.loop import stage2_targets
    from rltlab.model import OuroForCausalLM

    cfg = OuroConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, total_ut_steps=4)
    model = OuroForCausalLM(cfg).init_weights(1, std=0.3)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    ref, _, _ = pretrain.stage2_loss(model, ids, 50.0, 0.005)
    with torch.no_grad():
        out = model(ids, all_logits=True)
        ce = torch.stack([F.cross_entropy(lg[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
                          for lg in out.logits], -1)
        logits = out.gate_logits[:, :-1]
    ours = F.binary_cross_entropy_with_logits(logits, 1 - stage2_targets(ce, 50.0, 0.005))
    torch.testing.assert_close(ours, ref.detach(), atol=1e-5, rtol=1e-5)
