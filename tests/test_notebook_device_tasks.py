"""Issue 59 for notebooks 01-04: DEVICE / DTYPE parameters checked before a notebook starts,
task sets (the embedded problems or a GSM8K JSONL, split by hash), traces sized before they are
collected (and refused when the disk cannot hold them), the collection's throughput against the
same rollouts without traces, engines sized for their workload, cost figures."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltlab.common.paths import REPO_ROOT
from rltlab.workbench import runs

NOTEBOOKS = REPO_ROOT / "notebooks"
GSM8K = REPO_ROOT / "tests" / "data" / "gsm8k_mini.jsonl"
OURO_14B = REPO_ROOT / "tests" / "ouro-1.4b" / "config.json"
DEVICE_NOTEBOOKS = ["01_collect_traces", "02_train_exit_predictor", "03_train_draft_heads",
                    "04_evaluate"]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "rltlab.workbench.cli", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


# ----------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("name", DEVICE_NOTEBOOKS)
def test_every_notebook_has_device_and_dtype_parameters(name):
    params = runs.notebook_parameters(NOTEBOOKS / f"{name}.ipynb")
    assert params["DEVICE"]["default"] == "auto" and params["DTYPE"]["default"] == "auto"
    assert params["DTYPE"]["choices"] == ["auto", "float32", "bfloat16", "float16"]
    assert "THREADS" in params
    import nbformat
    cells = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4).cells
    source = "".join(c.source for c in cells if c.cell_type == "code")
    assert "W.load_model(MODEL_DIR, device=DEVICE, dtype=DTYPE, threads=THREADS)" in source


@pytest.mark.slow
def test_bad_device_is_one_error_line_before_the_notebook_starts(tmp_path):
    res = _cli("run", "04_evaluate", "-p", "DEVICE", "tpu", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == ("error: parameter DEVICE='tpu': DEVICE must be "
                                            "'auto', 'cpu', 'cuda' or 'cuda:N'")
    assert not (tmp_path / "r").exists()          # refused before anything was written
    if not torch.cuda.is_available():              # a GPU the machine lacks: refused too
        res = _cli("run", "01", "-p", "DEVICE", "cuda:0", "--run-dir", str(tmp_path / "r"))
        assert res.returncode == 2 and "CUDA is not available" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_choice_parameters_are_checked(tmp_path):
    nb = NOTEBOOKS / "01_collect_traces.ipynb"
    for name, value in (("DTYPE", "fp64"), ("TASKS", "mmlu"), ("HIDDEN_DTYPE", "int8")):
        with pytest.raises(ValueError, match=f"parameter {name}='{value}': {name} must be one of"):
            runs.coerce_parameters(nb, {name: value})
    for device in ("mps", "meta", "cuda:x"):   # torch devices the notebooks do not run on
        with pytest.raises(ValueError, match="DEVICE must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            runs.coerce_parameters(nb, {"DEVICE": device})
    ok = runs.coerce_parameters(nb, {"DEVICE": "cpu", "DTYPE": "bfloat16", "TASKS": "gsm8k"})
    assert ok == {"DEVICE": "cpu", "DTYPE": "bfloat16", "TASKS": "gsm8k"}
    # a resumed run's stored DEVICE is checked too (the run was made on another machine)
    if not torch.cuda.is_available():
        from rltlab.workbench.notebook_params import check_bounds
        with pytest.raises(ValueError, match=r"DEVICE='cuda' \(from P\): device"):
            check_bounds(runs.notebook_parameters(nb), {"DEVICE": "cuda"}, source="P")


# ----------------------------------------------------------------------------- task sets

def test_gsm8k_splits_are_disjoint_by_hash_and_refuse_too_many():
    from rltlab.eval.gsm8k import gsm8k_problems, gsm8k_split_of, load_gsm8k_jsonl

    train, held = gsm8k_problems(GSM8K, "train"), gsm8k_problems(GSM8K, "heldout")
    questions = [r["question"] for r in load_gsm8k_jsonl(GSM8K)]
    assert len(train) >= 4 and len(held) >= 4 and len(train) + len(held) == len(questions)
    assert not {p["question"] for p in train} & {p["question"] for p in held}
    assert all(gsm8k_split_of(p["question"]) == "heldout" and p["kind"] == "gsm8k" for p in held)
    with pytest.raises(ValueError, match="holds .* 'heldout' split .* asked for"):
        gsm8k_problems(GSM8K, "heldout", len(held) + 1)


def test_task_prompts_use_the_gsm8k_cot_prompt_and_stop_strings():
    from rltlab.eval.gsm8k import GSM8K_STOP, gsm8k_cot_prompt
    from rltlab.eval.problems import (check_task_set, encode, task_eval_problems,
                                      task_rollout_prompts, task_stop)
    from rltlab.model.checkpoint import load_tokenizer
    from rltlab.common.paths import embedded_model_dir

    tok = load_tokenizer(embedded_model_dir())
    prompts, problems = task_rollout_prompts(tok, "gsm8k", 3, 0, gsm8k_path=GSM8K,
                                             num_fewshot=2)
    assert prompts[0] == encode(tok, gsm8k_cot_prompt(problems[0]["question"], 2))
    assert task_stop("gsm8k") == list(GSM8K_STOP) and task_stop("embedded") == []
    held = task_eval_problems(None, "gsm8k", 2, gsm8k_path=GSM8K)
    assert not {p["question"] for p in held} & {p["question"] for p in problems}
    emb_prompts, emb = task_rollout_prompts(tok, "embedded", 4, 0)
    assert {p["kind"] for p in emb} == {"hops", "arith"} and emb_prompts[0][0] == 0
    with pytest.raises(ValueError, match="needs GSM8K_PATH"):
        check_task_set("gsm8k", None)
    with pytest.raises(ValueError, match="no such file"):
        check_task_set("gsm8k", "/nonexistent.jsonl")


def test_embedded_task_files_come_from_the_embedded_artifact(tmp_path):
    """A checkpoint without eval/ files (a stand-in, a real Ouro) gets the embedded ones."""
    from rltlab.common.paths import embedded_model_dir
    from rltlab.eval.problems import eval_problems, heldout_text_rows, task_file
    from rltlab.model.checkpoint import load_tokenizer

    other = tmp_path / "standin"
    other.mkdir()
    emb = embedded_model_dir()
    assert task_file(other, "heldout_text.txt") == emb / "eval" / "heldout_text.txt"
    tok = load_tokenizer(emb)
    assert torch.equal(heldout_text_rows(tok, other, 32, 3), heldout_text_rows(tok, emb, 32, 3))
    assert eval_problems(other, 6) == eval_problems(emb, 6)
    (other / "eval").mkdir()
    (other / "eval" / "heldout_text.txt").write_text("x = 1\n" * 200)
    assert task_file(other, "heldout_text.txt") == other / "eval" / "heldout_text.txt"


@pytest.mark.slow
def test_gsm8k_notebooks_run_end_to_end_on_the_embedded_model(tmp_path):
    """TASKS gsm8k: 01 traces a rollout of the training split, 04 evaluates the held-out split
    (few-shot prompt, stop strings, strict-match), both with DEVICE cpu."""
    from rltlab.eval.gsm8k import gsm8k_problems
    from rltlab.traces import read_manifest

    common = {"DEVICE": "cpu", "TASKS": "gsm8k", "GSM8K_PATH": str(GSM8K),
              "GSM8K_FEWSHOT": 1, "THREADS": 1}
    run01 = runs.execute_notebook(NOTEBOOKS / "01_collect_traces.ipynb", {
        **common, "NUM_PROMPTS": 3, "MAX_TOKENS": 6, "OVERHEAD_PROMPTS": 2},
        run_dir=tmp_path / "collect", progress=False)
    m = json.loads((run01 / "metrics.json").read_text())
    assert m["tasks"] == "gsm8k" and m["device"] == "cpu"
    assert m["environment"]["model_device"] == "cpu" and m["environment"]["peak_gpu_mem_gib"] is None
    assert 0 < m["headline"]["traced_tokens"] <= 3 * 5
    key = json.loads((run01 / "traces" / "collection.json").read_text())["key"]
    assert key["settings"]["stop"] == ["Q:", "</s>", "<|im_end|>"]
    assert m["overhead"]["prompts"] == 2 and m["overhead"]["same_tokens"] is True
    assert read_manifest(m["trace_dir"])["hidden_dtype"] == "bfloat16"

    run04 = runs.execute_notebook(NOTEBOOKS / "04_evaluate.ipynb", {
        **common, "NUM_PROBLEMS": 3, "MAX_TOKENS": 6, "DEPTHS": [4], "THRESHOLDS": [0.5],
        "TEXT_ROWS": 0, "GSM8K_LIMIT": 1, "GSM8K_MAX_TOKENS": 4},
        run_dir=tmp_path / "eval", progress=False)
    m = json.loads((run04 / "metrics.json").read_text())
    assert m["tasks"] == "gsm8k" and m["headline"]["problems"] == 3 and m["batch"] == 3
    pol = {r["key"]: r for r in m["policies"]}
    assert set(pol) == {"fixed depth=4", "q_exit t=0.5"}
    for row in pol.values():
        assert row["device"] == "cpu" and row["tokens_per_s"] > 0 and row["batch"] == 3
        assert row["quality"] in (0.0, 100 / 3, 200 / 3, 100.0)
    assert {s["key"] for s in m["speed"]} == set(pol)
    assert any(Path(p).name == "speed_vs_depth.png" for p in m["plots"])
    assert m["gsm8k"]["n"] == 1
    held = [p["question"] for p in gsm8k_problems(GSM8K, "heldout", 3)]
    assert m["headline"]["problems"] == len(held)

    # 03 distils its draft head from 01's traces (TRACE_DIR), with its cost figures
    run03 = runs.execute_notebook(NOTEBOOKS / "03_train_draft_heads.ipynb", {
        "DEVICE": "cpu", "TRACE_DIR": str(run01 / "traces"), "TRAIN_ROWS": 4, "HELDOUT_ROWS": 2,
        "SEQ_LEN": 64, "STEPS": 3, "NUM_PROMPTS": 1, "MAX_TOKENS": 4, "K": 2, "THREADS": 1},
        run_dir=tmp_path / "heads", progress=False)
    m3 = json.loads((run03 / "metrics.json").read_text())
    cost = m3["component"]
    assert cost["trace_dir"] == str(run01 / "traces") and cost["hidden_size"] == 384
    assert cost["vocab_size"] == 1024 and cost["peak_mem_gib"] is None
    assert cost["parameters"] == 384 + 2 * 384 * 768     # norm, up, down of the residual MLP
    assert 0 < cost["train_tokens"] < 15 and m3["train_log"][0]["step"] == 0
    assert m3["headline"]["identical_at_t0"] is True


# ----------------------------------------------------------------------------- traces

@pytest.fixture(scope="module")
def tiny_llm():
    from rltlab.engine import LLM
    from tiny_models import tiny_engine_model
    torch.set_num_threads(1)
    return LLM(tiny_engine_model(0))


def _params(**kw):
    from rltlab.engine import SamplingParams
    base = dict(temperature=0.0, max_tokens=6, exit_threshold=0.3, min_loops=1,
                ignore_eos=True, seed=7)
    return SamplingParams(**{**base, **kw})


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_a_collection_that_would_fill_the_disk_is_refused_before_writing(tiny_llm, tmp_path,
                                                                        monkeypatch):
    import shutil

    from rltlab.traces import NotEnoughDiskSpace
    from rltlab.traces.size import DISK_RESERVE_BYTES
    from rltlab.workbench import collect_traces_once

    real = shutil.disk_usage
    free = DISK_RESERVE_BYTES + 10_000          # 10 kB above what is kept free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    trace_dir = tmp_path / "run" / "traces"
    with pytest.raises(NotEnoughDiskSpace) as err:   # 3 x 9 tokens x (4 x 32 x 2 + 204) bytes
        collect_traces_once(tiny_llm, PROMPTS, trace_dir, threshold=0.5, max_tokens=10,
                            hidden_dtype="bfloat16")
    text = str(err.value)
    assert "refused before collecting" in text and "shutil.disk_usage" in text
    assert "27 tokens x 4 rounds x 32 hidden x 2 bytes (bfloat16)" in text
    assert f"has {free / 2 ** 30:.3f} GiB free" in text
    assert not trace_dir.exists() and not list((tmp_path / "run").glob(".traces.tmp-*"))
    monkeypatch.setattr(shutil, "disk_usage", real)   # what fits is collected
    manifest, _ = collect_traces_once(tiny_llm, PROMPTS, trace_dir, threshold=0.5,
                                      max_tokens=10, hidden_dtype="bfloat16")
    assert 0 < manifest["num_tokens"] <= 27


def test_the_size_estimate_matches_what_is_written(tiny_llm, tmp_path):
    from rltlab.traces import TraceWriter, collect_traces, trace_bytes, written_bytes

    _, manifest = collect_traces(tiny_llm, PROMPTS, _params(), tmp_path / "a", teacher=True,
                                 hidden_dtype="bfloat16", shard_tokens=5)
    plan = trace_bytes(manifest["num_tokens"], num_rounds=4, hidden_dim=32,
                       hidden_dtype="bfloat16", shard_tokens=5)
    assert plan["shards"] == len(manifest["shards"])
    assert abs(plan["bytes"] / written_bytes(tmp_path / "a") - 1) < 0.10
    # at Ouro-1.4B's shape (R = 4, hidden 2,048, bfloat16), records written by a TraceWriter
    n, R, D = 300, 4, 2048
    writer = TraceWriter(tmp_path / "b", num_rounds=R, hidden_dim=D, dtype="bfloat16",
                         shard_tokens=128)
    rec = {k: torch.rand(R) for k in ("gate_logit", "hazard", "cdf", "top1_prob", "margin",
                                      "entropy", "logprob_ref", "kl_ref")}
    rec.update(hidden=torch.randn(R, D), round_mask=torch.ones(R, dtype=torch.bool),
               top1_id=torch.zeros(R, dtype=torch.int32), executed=R, selected=2, ref_round=R,
               ref_token=5, token=5, position=9, output_index=1, prompt_id=0, sample_index=0,
               weight_version=0, seed=1)
    writer.add([rec] * n)
    writer.close()
    plan = trace_bytes(n, num_rounds=R, hidden_dim=D, hidden_dtype="bfloat16",
                       shard_tokens=128)
    assert plan["hidden_bytes"] == n * R * D * 2
    assert abs(plan["bytes"] / written_bytes(tmp_path / "b") - 1) < 0.01


def test_collection_overhead_compares_the_same_rollouts(tiny_llm, tmp_path):
    from rltlab.traces import collection_overhead

    rep = collection_overhead(tiny_llm, PROMPTS, _params(max_tokens=5), tmp_path / "ovh",
                              teacher=True, hidden_dtype="bfloat16")
    # teacher mode: the plain run is fixed depth R, the same tokens as the traced rollout
    assert rep["same_tokens"] is True and rep["teacher"] is True
    assert rep["output_tokens"] == rep["traced_output_tokens"] == 15
    assert rep["throughput_ratio"] == pytest.approx(rep["plain_s"] / rep["traced_s"])
    assert rep["plain_tokens_per_s"] == pytest.approx(15 / rep["plain_s"])
    assert rep["device"] == "cpu" and "fixed depth 4" in rep["baseline"]
    assert not (tmp_path / "ovh").exists()


def test_batched_round_statistics_equal_the_per_token_ones():
    from rltlab.traces.stats import stats_from_logprobs, stats_from_logprobs_batch

    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(5, 4, 50, generator=gen), -1)
    gates = torch.randn(5, 4, generator=gen)
    batch = stats_from_logprobs_batch(logp, gates)
    for i in range(5):
        one = stats_from_logprobs(logp[i], gates[i])
        for k, v in one.items():   # (vectorised sigmoid / exp may differ in the last ulp)
            torch.testing.assert_close(batch[k][i], v, rtol=1e-6, atol=1e-7, msg=k)


# ----------------------------------------------------------------------------- sizing

def test_engines_are_sized_for_their_workload():
    from rltlab.eval.engines import kv_block_bytes, kv_blocks, sized_llm
    from rltlab.model.config import OuroConfig
    from tiny_models import tiny_engine_model

    cfg = OuroConfig.from_dict(json.loads(OURO_14B.read_text()))
    per_block = kv_block_bytes(cfg, 16, 2)
    assert per_block == 24 * 2 * 4 * 16 * 16 * 128 * 2        # 12 MiB at Ouro-1.4B, bf16
    assert kv_blocks(cfg, elem_size=2, max_num_seqs=64, max_len=100) == 64 * 8
    capped = kv_blocks(cfg, elem_size=2, max_num_seqs=64, max_len=100,
                       free_bytes=6 * 2 ** 30)                 # 2 GiB beyond the headroom
    assert capped == (2 * 2 ** 30) // per_block
    with pytest.raises(ValueError, match=r"one sequence of 100 tokens needs 0\.09 GiB, "
                                         r"4\.00 GiB are free"):
        kv_blocks(cfg, elem_size=2, max_num_seqs=64, max_len=100, free_bytes=4 * 2 ** 30)
    llm = sized_llm(tiny_engine_model(0), max_num_seqs=3, max_len=40)
    assert llm.llm_engine.block_manager.num_blocks == 3 * 4
    assert llm.generate([[1, 2, 3]] * 5, _params(max_tokens=30))[4].outputs[0].token_ids


def test_measured_costs_and_parameter_counts():
    from rltlab import workbench as W

    with W.Measured("cpu") as cost:
        torch.ones(10).sum()
    summary = cost.summary()
    assert summary["peak_mem_gib"] is None and summary["seconds"] >= 0
    lin = torch.nn.Linear(4, 3)
    assert W.parameter_count(lin) == 15 == W.parameter_count([lin.weight, lin.bias, lin.weight])
