"""The embedded default model (artifacts/ouro-tiny): shape of the artifact, metrics.json
reproduced on the CPU in fp32 from the saved checkpoint, and deeper rounds mattering."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from rltlab.pretrain import evaluate as E
from rltlab.common.paths import embedded_model_dir

MODEL = embedded_model_dir()
METRICS = json.loads((MODEL / "metrics.json").read_text())


@pytest.fixture(scope="module")
def recomputed():
    s, threads, t0 = METRICS["settings"], torch.get_num_threads(), time.time()
    if os.getloadavg()[0] >= (os.cpu_count() or 1):  # oversubscribed: extra threads only spin
        torch.set_num_threads(1)
    try:
        metrics = E.evaluate_checkpoint(MODEL, device="cpu", seq_len=s["seq_len"],
                                        max_new_tokens=s["max_new_tokens"],
                                        gen_batch_size=s["gen_batch_size"])
    finally:
        torch.set_num_threads(threads)
    metrics["wall_s"] = time.time() - t0
    return metrics


def test_artifact_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "metrics.json", "README.md", E.TEXT_FILE, E.ARITH_FILE):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size <= 16 * 2**20
    from safetensors import safe_open
    with safe_open(MODEL / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((MODEL / "config.json").read_text())
    assert config["total_ut_steps"] == 4 and config["torch_dtype"] == "bfloat16"


def test_tokenizer_loads_and_splits_digits():
    from rltlab.model.checkpoint import load_tokenizer
    tok = load_tokenizer(MODEL)
    ids = E.encode(tok, " 12*7=84. #### 84")
    assert E.decode(tok, ids) == " 12*7=84. #### 84"
    assert all(len(E.decode(tok, [i]).strip()) <= 1 for i in E.encode(tok, "1234567890"))


def test_metrics_reproduce_on_cpu(recomputed):
    assert recomputed["settings"] == METRICS["settings"]
    n = METRICS["settings"]["n_problems"]
    for mine, ref in zip(recomputed["rounds"], METRICS["rounds"], strict=True):
        assert mine["text_loss"] == pytest.approx(ref["text_loss"], abs=0.02)
        assert mine["arith_loss"] == pytest.approx(ref["arith_loss"], abs=0.02)
        assert abs(mine["arith_correct"] - ref["arith_correct"]) <= max(1, n // 100)
    print(f"CPU eval took {recomputed['wall_s']:.1f} s")  # ~30 s on 2 idle cores


@pytest.mark.parametrize("source", ["metrics.json", "recomputed"])
def test_deeper_rounds_matter(source, recomputed):
    rounds = (METRICS if source == "metrics.json" else recomputed)["rounds"]
    first, last = rounds[0], rounds[-1]
    assert last["text_loss"] <= 0.9 * first["text_loss"]
    assert last["arith_loss"] <= 0.9 * first["arith_loss"]
    assert last["arith_exact_match"] >= first["arith_exact_match"] + 0.10


def test_generation_is_deterministic_and_batch_independent():
    from rltlab.model.checkpoint import load_model_and_tokenizer
    from rltlab.model.generate import generate_plain
    model, tok = load_model_and_tokenizer(MODEL, dtype=torch.float32)
    _, problems = E.load_eval_set(MODEL)
    prompts = [[0] + E.encode(tok, p["question"]) for p in problems[:3]]
    together = generate_plain(model, prompts, 12, depth=4, eos_token_id=0).token_ids
    alone = [generate_plain(model, [p], 12, depth=4, eos_token_id=0).token_ids[0]
             for p in prompts]
    assert together == alone
