"""Every workbench notebook runs end to end through papermill with tiny parameters, on a tiny
random model (with a small trained tokenizer) built here; plus kill-and-resume of the loop."""
import json
import math
from pathlib import Path

import pytest
import torch

from rltlab.workbench import runs

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tiny_models import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _run(name, params, run_dir):
    return runs.execute_notebook(NOTEBOOKS / f"{name}.ipynb", params, run_dir=run_dir,
                                 progress=False)


def _metrics(run_dir):
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def _hist_mean(hist: dict, tokens: int) -> float:
    """Mean round of a depth histogram {round: count} holding `tokens` tokens."""
    assert sum(hist.values()) == tokens
    return sum(int(d) * c for d, c in hist.items()) / tokens


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
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name
                # short cells of library calls; the parameters cell is a list, one per line
                assert i == 1 or len(cell.source.splitlines()) < 25, path.name
        params = runs.notebook_parameters(path)
        assert "RUN_DIR" in params and "MODEL_DIR" in params
        assert all(name.isupper() for name in params)


@pytest.mark.slow
def test_collect_traces_notebook(tiny_model_dir, tmp_path):
    from rltlab.traces import TraceDataset, verify_traces
    run_dir = _run("01_collect_traces", {
        "MODEL_DIR": str(tiny_model_dir), "NUM_PROMPTS": 4, "MAX_TOKENS": 8,
        "SHARD_TOKENS": 10, "THREADS": 1}, tmp_path / "collect")
    m = _metrics(run_dir)
    head = m["headline"]
    assert head["traced_tokens"] == 4 * 7 and head["shards"] == 3   # 8 tokens, first excluded
    assert head["mean_executed"] == 4.0
    assert head["mean_selected"] == pytest.approx(_hist_mean(m["depth_hist"]["selected"], 28))
    assert head["overhead_x"] == pytest.approx(m["overhead"]["traced_s"] / m["overhead"]["plain_s"])
    assert [r["round"] for r in m["per_round"]] == [1, 2, 3, 4]
    assert all(v is not None for r in m["per_round"] for v in r.values())
    assert m["per_round"][-1]["agree_with_ref"] == 1.0 and m["per_round"][-1]["kl_ref"] < 1e-6
    assert verify_traces(m["trace_dir"])["num_tokens"] == 28
    assert len(list(TraceDataset(m["trace_dir"], fields=["token"]))) == 28
    _plots_exist(m)


@pytest.mark.slow
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
    for row in pol.values():   # mean rounds and EM from the histogram and the 4 problems
        n_tokens = row["decode_tokens"]
        assert row["mean_rounds"] == pytest.approx(_hist_mean(row["executed_hist"], n_tokens))
        assert row["quality"] / 100 * 4 == pytest.approx(round(row["quality"] / 100 * 4))
    assert all(r["quality"] is not None and r["weight_version"] == 0 for r in m["policies"])
    assert {p["setting"] for p in m["paired"]} == {"fixed depth=1", "q_exit t=0.5"}
    assert all(p["vs"] == "fixed depth=4" and p["n"] == 4 for p in m["paired"])
    assert [t["setting"] for t in m["text"]] == ["depth=1", "depth=2", "depth=3", "depth=4",
                                                "t=0.5"]
    assert all(t["ppl"] == pytest.approx(math.exp(t["loss"])) for t in m["text"])
    assert m["gsm8k"]["n"] == 2 and m["gsm8k"]["protocol"]["num_fewshot"] == 3
    assert m["headline"]["full_depth_quality"] is not None
    _plots_exist(m)


@pytest.mark.slow
def test_loop_notebook_crash_and_resume(tiny_model_dir, tmp_path):
    from papermill.exceptions import PapermillExecutionError
    from rltlab.loop import GATE_BIAS, GATE_WEIGHT, load_gate
    run_dir = tmp_path / "loop"
    params = {"MODEL_DIR": str(tiny_model_dir), "ITERATIONS": 2, "ROLLOUT_PROMPTS": 3,
              "MAX_TOKENS": 8, "EVAL_PROBLEMS": 3, "THRESHOLDS": [0.3, 1.0], "GATE_STEPS": 10,
              "PREDICTOR_EPOCHS": 2, "DRAFT_STEPS": 3, "DRAFT_PROMPTS": 2, "DRAFT_K": 2,
              "THREADS": 1, "CRASH_AT_ITERATION": 1}
    with pytest.raises(PapermillExecutionError, match="simulated crash in iteration 1"):
        _run("10_rollout_update_evaluate", params, run_dir)
    assert (run_dir / "iter_0" / "result.json").is_file()
    assert not (run_dir / "iter_1").exists()
    assert not list(run_dir.glob(".iter_*"))     # the crashed iteration left nothing behind
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    it0 = run_dir / "iter_0"
    kept = ["result.json", "gate.safetensors", "exit_predictor/n1/predictor.safetensors",
            "exit_predictor/n1/manifest.json", "draft_head/draft_component.json"]
    first = (it0 / "result.json").read_text()
    mtimes = {f: (it0 / f).stat().st_mtime_ns for f in kept}

    # A resume with other THRESHOLDS is refused before anything is written (it once failed
    # inside the notebook, after parameters.json took the refused value and the executed
    # notebook was overwritten, so a plain resume afterwards failed the same way)
    files = {f: (run_dir / f).read_bytes() for f in
             ("parameters.json", "run.json", "10_rollout_update_evaluate.ipynb")}
    with pytest.raises(ValueError, match=r"THRESHOLDS: \[0.3, 1.0\] in iteration\(s\) 0") as err:
        _run("10_rollout_update_evaluate", {"THRESHOLDS": [0.5, 1.0]}, run_dir)
    assert type(err.value).__name__ == "RunRefused"
    assert {f: (run_dir / f).read_bytes() for f in files} == files

    # Resume with more iterations: iteration 0 is loaded, 1 and 2 are computed. Their
    # candidates are replaced by a bad gate (every token exits at round 1): validation must
    # reject them and push the current gate again unchanged (GATE_KEEP_WORSE False).
    _run("10_rollout_update_evaluate", {"ITERATIONS": 3, "CRASH_AT_ITERATION": -1,
                                        "INJECT_CANDIDATE": "exit_round1"}, run_dir)
    assert (it0 / "result.json").read_text() == first
    assert {f: (it0 / f).stat().st_mtime_ns for f in kept} == mtimes
    m = _metrics(run_dir)
    assert m["resumed_from"] == 1 and m["headline"]["iterations"] == 3
    assert m["headline"]["final_weight_version"] == 3
    its = m["iterations"]
    assert [i["rollout_weight_versions"] for i in its] == [[0], [1], [2]]
    assert [i["trace_weight_versions"] for i in its] == [[0], [1], [2]]
    assert [i["new_weight_version"] for i in its] == [1, 2, 3]
    assert [i["rollout_kinds"] for i in its] == [{"hops": 3, "arith": 0}] * 3  # share 0.9
    gates = [load_gate(run_dir / f"iter_{k}" / "gate.safetensors") for k in range(3)]
    assert set(gates[2]) == {GATE_WEIGHT, GATE_BIAS}
    for k, it in enumerate(its):
        # validation split of the rollout prompts, early stopping on the validation BCE
        assert it["gate_val_loss_before"] is not None and it["gate_best_step"] >= 1
        if it["gate_accepted"]:
            assert it["gate_validation_passed"] and not it["gate_reasons"]
            assert it["gate_val_loss_after"] <= it["gate_val_loss_before"]
        else:
            assert it["gate_reasons"] and it["gate_val_loss_after"] > it["gate_val_loss_before"]
            assert (run_dir / f"iter_{k}" / "gate_rejected.safetensors").is_file()
    assert [i["gate_injected"] for i in its] == [None, "exit_round1", "exit_round1"]
    assert [i["gate_accepted"] for i in its[1:]] == [False, False]
    assert all(any("BCE higher" in r for r in i["gate_reasons"]) for i in its[1:])
    for k in (1, 2):    # the rejected candidate is the injected one; the gate is unchanged
        bad = load_gate(run_dir / f"iter_{k}" / "gate_rejected.safetensors")
        assert bool((bad[GATE_BIAS] == 30.0).all()) and not bool(bad[GATE_WEIGHT].any())
        for name in gates[k]:
            torch.testing.assert_close(gates[k][name], gates[k - 1][name], rtol=0, atol=0)

    # held-out verdict: same problems before/after, paired comparison, non-inferiority margin
    from rltlab.loop import UNCHANGED
    gc = m["gate_curve"]
    assert gc["eval_problems"] == 3 and gc["heldout_overlap_with_rollouts"] == 0
    assert gc["final_vs_v0"]["before_version"] == 0 and gc["final_vs_v0"]["after_version"] == 3
    assert len(gc["per_iteration"]) == 3 and gc["per_iteration"][2]["after_version"] == 3
    assert gc["per_iteration_verdicts"][1:] == [UNCHANGED, UNCHANGED]
    assert gc["gates_accepted"] == [its[0]["gate_accepted"], False, False]
    assert m["headline"]["gate_verdict"] == gc["verdict"] == (
        gc["per_iteration_verdicts"][0] if its[0]["gate_accepted"] else UNCHANGED)
    margin = m["headline"]["gate_margin_pp"]
    for cmp in [gc["final_vs_v0"]] + gc["per_iteration"]:
        assert cmp["points"] and cmp["overlap"][0] <= cmp["overlap"][1] <= 4.0
        for pt in cmp["points"]:
            assert pt["diff_pp"] == pytest.approx(pt["after"] - pt["before"], abs=1e-6)
    if its[0]["gate_accepted"]:
        lower = min(p["diff_pp"] - 2 * p["se_pp"] for p in gc["final_vs_v0"]["points"])
        assert m["headline"]["gate_worst_lower_bound_pp"] == pytest.approx(lower)
        assert (gc["verdict"] == "no worse") == (lower >= -margin)
    _check_headline_computed(run_dir, m, tiny_model_dir, draft_prompts=2, draft_k=2)

    for k, it in enumerate(its):
        hashes = json.loads((run_dir / f"iter_{k}" / "result.json").read_text())[
            "trace_model_hashes"]
        # N+2 predictor: trained on version k's traces, stamped with version k's model hash
        ep = it["exit_predictor"]
        assert ep["weight_version"] == k and ep["model_hash"] == hashes[str(k)]
        man = json.loads((run_dir / f"iter_{k}" / ep["checkpoint"] / "manifest.json").read_text())
        assert man["base_model_hash"] == hashes[str(k)]
        assert man["training_data"]["weight_version"] == k
        assert man["training_data"]["trace_dir"] == str(run_dir / f"iter_{k}" / "traces")
        # quality and mean rounds follow from the calibrated row's per-problem scores and
        # depth histogram (result.json); decision after round 1: every exit at N + 2 = 3 or R
        cal = next(r for r in json.loads((run_dir / f"iter_{k}" / "result.json").read_text())[
            "exit_predictor"]["rows"] if r["calibrated"])
        assert len(cal["scores"]) == 3
        assert ep["quality"] == pytest.approx(100 * sum(cal["scores"]) / 3)
        assert {int(d) for d, c in cal["executed_hist"].items() if c} <= {3, 4}
        assert ep["mean_rounds"] == pytest.approx(_hist_mean(cal["executed_hist"],
                                                             cal["decode_tokens"]))
        # draft head: distilled on the same traces, lossless at T=0
        dh = it["draft_head"]
        meta = json.loads((run_dir / f"iter_{k}" / dh["component"] /
                           "draft_component.json").read_text())
        assert meta["weight_version"] == k == dh["weight_version"]
        assert meta["base_model_hash"] == hashes[str(k)] == dh["model_hash"]
        assert dh["identical_at_t0"] is True
        # the reference decoder drafts K = 2 every step: tau = 1 + K * acceptance
        assert dh["tau"] == pytest.approx(1 + 2 * dh["acceptance"])
        assert dh["tau_shallow"] == pytest.approx(1 + 2 * dh["acceptance_shallow"])
        agreement = json.loads((run_dir / f"iter_{k}" / "result.json").read_text())[
            "draft_head"]["heldout_agreement"]["trained"]
        agreed = dh["heldout_agree"] * agreement["tokens"]    # a count of held-out tokens
        assert agreement["tokens"] > 0 and agreed == pytest.approx(round(agreed))
    assert len({it["exit_predictor"]["model_hash"] for it in its}) == \
        (2 if its[0]["gate_accepted"] else 1)                  # only an accepted gate changes it
    # Stage II inputs are the gate's inputs: the pushed version-1 gate on the traced h_r of
    # iteration 1 (version 1; on-policy traces, every round) reproduces their gate logits
    from rltlab.traces import load_traces
    tr = load_traces(run_dir / "iter_1" / "traces", fields=["hidden", "gate_logit"])
    logits = (tr["hidden"] @ gates[0][GATE_WEIGHT].T).squeeze(-1) + gates[0][GATE_BIAS]
    torch.testing.assert_close(logits, tr["gate_logit"], atol=1e-5, rtol=1e-5)
    _check_deployment(run_dir, m, its)
    assert json.loads((run_dir / "iter_0" / "result.json").read_text())["started"] == \
        its[0]["started"]
    assert its[1]["started"] >= its[0]["started"]
    curves = m["curves"]
    q = [c for c in curves if "q_exit" in c["policy"]]
    assert sorted({c["weight_version"] for c in q}) == [0, 1, 2, 3] and len(q) == 4 * 2
    fixed = [c for c in curves if c["policy"] == "v0 fixed"]     # DEPTHS, version 0 only
    assert [c["depth"] for c in fixed] == [1, 2, 3]
    assert [c["mean_rounds"] for c in fixed] == [1.0, 2.0, 3.0]
    assert all(c["quality"] is not None and c["mean_rounds"] is not None for c in curves)
    full = [c for c in q if c["threshold"] == 1.0]
    assert all(c["mean_rounds"] == 4.0 for c in full)   # threshold 1.0 = full depth
    # generated, not copied: version 0 and the accepted update's sweep below full depth; the
    # rejected updates (same gate pushed again) copy the previous sweep
    carried = {c["weight_version"]: c.get("carried_from_version") for c in q
               if c["threshold"] < 1.0}
    assert carried[0] is None and carried[2] == carried[3] == (1 if its[0]["gate_accepted"]
                                                               else 0)
    assert all(c.get("carried_from_version") == 0 for c in full[1:])
    assert [c["weight_version"] for c in curves if "n_plus_2" in c["policy"]
            and "deployed" not in c["policy"]] == [0, 1, 2]
    assert [c["weight_version"] for c in curves if "deployed n_plus_2" in c["policy"]] == [1, 2]
    # speed vs depth: every row's tok/s relative to version 0's full-depth row, same run
    ref = next(c for c in q if c["weight_version"] == 0 and c["threshold"] == 1.0)
    speed = {(r["policy"], r["setting"]): r for r in m["speedups"]}
    assert len(speed) == len(curves)
    for c in curves:
        r = speed[(c["policy"], c["setting"])]
        assert c["tokens_per_s"] > 0 and r["mean_rounds"] == c["mean_rounds"]
        assert r["speedup"] == pytest.approx(c["tokens_per_s"] / ref["tokens_per_s"])
    assert speed[(ref["policy"], ref["setting"])]["speedup"] == 1.0
    _plots_exist(m)
    assert any(p.endswith("speedup_vs_depth.png") for p in m["plots"])


def _check_deployment(run_dir, m, its):
    """DEPLOY_COMPONENTS (default): iteration k >= 1 rolls out with iteration k-1's N+2
    predictor (on-policy traces: its exit rounds in `selected`, every round present) and
    measures it beside the stock Q-exit and its draft head as the engine's proposer, same run."""
    import numpy as np
    from rltlab.eval.curves import curve_scores_at, pareto_curve
    from rltlab.loop.metrics import curve_points
    from rltlab.traces import load_traces, read_manifest
    assert its[0]["deployed"] is None and its[0]["rollout"]["policy"].startswith("q_exit")
    for k in (1, 2):
        dep, res = its[k]["deployed"], json.loads((run_dir / f"iter_{k}" / "result.json")
                                                  .read_text())
        assert dep["from_iteration"] == k - 1
        assert res["deployed"]["predictor"] == str(run_dir / f"iter_{k - 1}" / its[k - 1][
            "exit_predictor"]["checkpoint"])
        assert res["deployed"]["draft_head"] == str(run_dir / f"iter_{k - 1}" / its[k - 1][
            "draft_head"]["component"])
        policy = res["deployed"]["policy"]
        assert its[k]["rollout"]["policy"] == policy == f"loop_deployed_n_plus_2_iter{k - 1}"
        man = read_manifest(run_dir / f"iter_{k}" / "traces")
        assert man["info"]["on_policy"]["policy"] == policy and man["info"]["teacher"] is True
        tr = load_traces(run_dir / f"iter_{k}" / "traces", fields=["selected", "executed",
                                                                  "round_mask"])
        assert set(tr["selected"].tolist()) <= {3, 4} and bool(tr["round_mask"].all())
        assert its[k]["rollout"]["mean_rounds"] == pytest.approx(
            float(tr["selected"].float().mean()))
        # the deployed N+2 (a row of the curves) and the stock Q-exit it replaced (version 0's
        # row at the rollout threshold, this run), paired at equal rounds with the stock curve
        n2, q = dep["n_plus_2"], dep["stock_q_exit"]
        assert n2["weight_version"] == k and q["threshold"] == 0.5 and q["quality_by_kind"]
        assert q["weight_version"] == k     # THRESHOLDS lacks 0.5: generated beside it
        assert dep["speedup_vs_stock_q_exit"] == pytest.approx(n2["tokens_per_s"] /
                                                               q["tokens_per_s"])
        stock = json.loads((run_dir / "iter_0" / "result.json").read_text())["before"]
        row = res["deployed"]["n_plus_2"]
        bx, bs, _ = pareto_curve(curve_points(stock))
        if row["mean_rounds"] >= bx[0]:
            d = np.asarray(row["scores"]) - curve_scores_at(bx, bs, row["mean_rounds"])
            assert n2["diff_vs_stock_q_exit_pp"] == pytest.approx(100 * d.mean())
        row = next(c for c in m["curves"] if c["policy"] == f"v{k} deployed n_plus_2 (iter "
                                                               f"{k - 1})")
        assert row["quality"] == n2["quality"] and row["mean_rounds"] == n2["mean_rounds"]
        # the draft head served full-depth requests as the engine's proposer: lossless at T=0
        d = dep["draft"]
        assert d["identical"] is True and d["spec_steps"] > 0 and d["tau"] >= 1.0
        assert d["speedup_vs_target"] == pytest.approx(d["tokens_per_s"] /
                                                       d["target_tokens_per_s"])
    across = [its[k]["deployed"]["across_gate_change"] for k in (1, 2)]
    assert across == [its[0]["gate_accepted"], its[1]["gate_accepted"]]
    head, last = m["headline"], its[2]["deployed"]
    assert head["deployed_n_plus_2_quality"] == last["n_plus_2"]["quality"]
    assert head["deployed_n_plus_2_tokens_per_s"] == last["n_plus_2"]["tokens_per_s"]
    assert head["stock_q_exit_tokens_per_s"] == last["stock_q_exit"]["tokens_per_s"]
    assert head["deployed_draft_speedup_vs_target"] == last["draft"]["speedup_vs_target"]
    assert head["speed_device"] == m["speed"]["device"] == "cpu (1 threads)"


@pytest.mark.slow
def test_loop_notebook_neutral_candidate_accepted(tiny_model_dir, tmp_path):
    """A candidate no worse than the current gate (here: the current gate itself) passes
    validation, is pushed, and the held-out verdict is "no worse"; the bad-gate half of this
    check is in test_loop_notebook_crash_and_resume (and on the embedded model in
    tests/test_loop_verdict.py)."""
    from rltlab.loop import GATE_BIAS, GATE_WEIGHT, gate_state_of, load_gate
    from rltlab.model.checkpoint import load_model

    run_dir = _run("10_rollout_update_evaluate", {
        "MODEL_DIR": str(tiny_model_dir), "ITERATIONS": 1, "ROLLOUT_PROMPTS": 4,
        "MAX_TOKENS": 6, "EVAL_PROBLEMS": 3, "THRESHOLDS": [0.3, 1.0], "DEPTHS": [],
        "GATE_STEPS": 10, "INJECT_CANDIDATE": "current", "TRAIN_EXIT_PREDICTOR": False,
        "TRAIN_DRAFT_HEAD": False, "THREADS": 1}, tmp_path / "neutral")
    m = _metrics(run_dir)
    it = m["iterations"][0]
    assert it["gate_injected"] == "current" and it["gate_accepted"] is True
    assert it["gate_validation_passed"] is True and not it["gate_reasons"]
    assert it["gate_val_loss_after"] == it["gate_val_loss_before"]
    v0 = gate_state_of(load_model(tiny_model_dir)[0].model.early_exit_gate)
    pushed = load_gate(run_dir / "iter_0" / "gate.safetensors")
    for name in (GATE_WEIGHT, GATE_BIAS):
        torch.testing.assert_close(pushed[name], v0[name], rtol=0, atol=0)
    assert not (run_dir / "iter_0" / "gate_rejected.safetensors").exists()
    gc = m["gate_curve"]
    assert gc["gates_accepted"] == [True] and gc["verdict"] == "no worse"
    assert m["headline"]["gate_verdict"] == "no worse"
    # accepted: the sweep below full depth is generated again at v1, and equals v0's
    q = {(c["weight_version"], c["setting"]): c for c in m["curves"]}
    assert q[(1, "t=0.3")].get("carried_from_version") is None
    assert q[(1, "t=0.3")]["quality"] == q[(0, "t=0.3")]["quality"]
    assert q[(1, "t=0.3")]["mean_rounds"] == q[(0, "t=0.3")]["mean_rounds"]
    assert all(p["diff_pp"] == 0 for p in gc["final_vs_v0"]["points"])


def _check_headline_computed(run_dir, m, model_dir, *, draft_prompts, draft_k):
    """The main job's headline numbers, recomputed here from what the last iteration wrote
    (traces, predictor checkpoint, per-problem scores, draft head): computed by the loop's
    code, not copied from a committed file."""
    import numpy as np
    from rltlab.draft_heads.heads import component_kwargs
    from rltlab.model.speculative import speculative_generate
    from rltlab.engine_patches.loop_draft import load_draft_component
    from rltlab.eval.curves import curve_scores_at, pareto_curve
    from rltlab.eval.problems import encode, eval_problems
    from rltlab.exit_predictor.features import label_spec, make_labels, trace_features
    from rltlab.exit_predictor.model import load_predictor
    from rltlab.exit_predictor.train import load_training_data, predict_logits, split_by_prompt
    from rltlab.loop.metrics import curve_points
    from rltlab.model.checkpoint import load_model

    head = m["headline"]
    k = len(m["iterations"]) - 1
    it_dir = Path(run_dir) / f"iter_{k}"
    res = json.loads((it_dir / "result.json").read_text())
    ep = res["exit_predictor"]
    tr, _ = load_training_data(it_dir / "traces")
    test_m = split_by_prompt(tr["prompt_id"], seed=0)[2]
    labels = make_labels(tr, ep["exit_round"], label_spec("argmax"))[test_m]
    assert head["predictor_label_rate"] == pytest.approx(float(labels.mean()))
    predictor, _ = load_predictor(it_dir / ep["checkpoint"])
    probs = torch.sigmoid(predict_logits(predictor, trace_features(tr, ep["decision_round"]))
                          / ep["temperature"])
    assert head["predictor_fire_rate"] == pytest.approx(
        float((probs[test_m] >= ep["threshold"]).float().mean()))
    # N+2 vs the Q-exit at equal mean rounds: paired, interpolated on the Pareto curve
    row = next(r for r in ep["rows"] if r["calibrated"])
    bx, bs, _ = pareto_curve(curve_points(res["before"]))
    d = np.asarray(row["scores"]) - curve_scores_at(bx, bs, row["mean_rounds"])
    se = d.std(ddof=1) / np.sqrt(len(d))
    assert head["n_plus_2_vs_q_exit_pp"] == pytest.approx(100 * d.mean())
    assert head["n_plus_2_vs_q_exit_z"] == (pytest.approx(d.mean() / se) if se > 0 else None)
    assert head["n_plus_2_mean_rounds"] == row["mean_rounds"]
    # draft head: tau again by speculative decoding with the saved head, same prompts
    model, tokenizer, _ = load_model(model_dir)
    comp = load_draft_component(it_dir / res["draft_head"]["component"], model,
                                check_hash=False)   # the gate does not enter drafting
    prompts = [[0] + encode(tokenizer, p["question"])
               for p in eval_problems(model_dir, draft_prompts, kinds=("arith",))]
    tau = speculative_generate(model, prompts, 32, k=draft_k, eos_token_id=0,
                               **component_kwargs(comp)).totals().tau
    assert head["draft_k"] == draft_k and head["draft_tau"] == pytest.approx(tau)
    assert 1.0 <= head["draft_tau"] <= draft_k + 1


def test_loop_notebook_bad_device_is_one_line(tmp_path, monkeypatch, capsys):
    """`rltlab run 10 -p DEVICE <a device this machine lacks>` (or a dtype it does not know) is
    one error line before anything runs: no run directory, no kernel."""
    from rltlab.workbench import runs_cli
    from rltlab.workbench.cli import build_parser

    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path))
    nb = str(NOTEBOOKS / "10_rollout_update_evaluate.ipynb")
    cases = [("DEVICE", "tpu", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
             ("DTYPE", "float8", "must be one of")]
    if not torch.cuda.is_available():
        cases.append(("DEVICE", "cuda", "CUDA is not available"))
    for key, value, says in cases:
        argv = ["run", nb, "-p", key, value, "--no-progress"]
        assert runs_cli.main(build_parser("run").parse_args(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and len(err.splitlines()) == 1, err
        assert key in err and says in err and "unknown parameter" not in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_loop_notebook_in_bfloat16(tiny_model_dir, tmp_path):
    """DTYPE bfloat16 (a GPU's "auto"), here on the CPU: the model and the engine run in bf16,
    the gate, the N+2 predictor and the draft head train in fp32 beside it, the deployed
    components run in iteration 1, and the run records where and in what its tok/s was measured."""
    run_dir = _run("10_rollout_update_evaluate", {
        "MODEL_DIR": str(tiny_model_dir), "DEVICE": "cpu", "DTYPE": "bfloat16", "ITERATIONS": 2,
        "ROLLOUT_PROMPTS": 4, "MAX_TOKENS": 6, "EVAL_PROBLEMS": 3, "THRESHOLDS": [0.5, 1.0],
        "DEPTHS": [], "GATE_STEPS": 10, "PREDICTOR_EPOCHS": 2, "DRAFT_STEPS": 3,
        "DRAFT_PROMPTS": 2, "DRAFT_K": 2, "THREADS": 1}, tmp_path / "bf16")
    m = _metrics(run_dir)
    assert m["speed"]["dtype"] == "bfloat16" and m["speed"]["device"].startswith("cpu")
    its = m["iterations"]
    assert its[1]["deployed"]["draft"]["identical"] is True
    assert its[1]["rollout"]["policy"] == "loop_deployed_n_plus_2_iter0"
    assert its[1]["draft_head"]["identical_at_t0"] is True
    res = json.loads((run_dir / "iter_1" / "result.json").read_text())
    assert res["gate_training"]["label"] == "stage2_or_remaining"
    assert m["headline"]["deployed_n_plus_2_tokens_per_s"] > 0
    stock = its[1]["deployed"]["stock_q_exit"]      # version 0's row of this run, reused
    v0 = next(c for c in m["curves"] if c["policy"] == "v0 q_exit" and c["threshold"] == 0.5)
    assert stock["weight_version"] == 0 and stock["tokens_per_s"] == v0["tokens_per_s"]
    assert m["headline"]["stock_q_exit_tokens_per_s"] == v0["tokens_per_s"]
    _plots_exist(m)
