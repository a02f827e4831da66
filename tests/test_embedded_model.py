"""The embedded default model (artifacts/ouro-tiny): shape of the artifact, metrics.json
reproduced on the CPU in fp32 from the saved checkpoint, deeper rounds mattering (round 4
against round 2 and round 1, relative tolerances), and string prompts getting the bos token."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

from rltlab.common.paths import embedded_model_dir
from rltlab.pretrain import evaluate as E
from rltlab.pretrain import prepare as P

MODEL = embedded_model_dir()
METRICS = json.loads((MODEL / "metrics.json").read_text())
UNSEEN_CODE = Path(__file__).parent / "data" / "unseen_code"


@pytest.fixture(scope="module")
def recomputed():
    s, threads, t0 = METRICS["settings"], torch.get_num_threads(), time.time()
    cores = os.cpu_count() or 1
    share = cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))   # -n N: cores / N
    if os.getloadavg()[0] >= cores or share <= 1:  # oversubscribed: extra threads only spin
        torch.set_num_threads(1)
    elif share < threads:
        torch.set_num_threads(share)
    try:
        metrics = E.evaluate_checkpoint(MODEL, device="cpu", seq_len=s["seq_len"])
    finally:
        torch.set_num_threads(threads)
    metrics["wall_s"] = time.time() - t0
    return metrics


def test_artifact_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "metrics.json", "README.md", "data_manifest.json", P.TEXT_FILE, P.CODE_FILE,
                 P.ARITH_FILE, P.HOPS_FILE):
        assert (MODEL / name).is_file(), name
    total = sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file())
    assert total <= 40 * 10**6, f"model directory {total / 1e6:.1f} MB > 40 MB"
    from safetensors import safe_open
    with safe_open(MODEL / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((MODEL / "config.json").read_text())
    assert config["total_ut_steps"] == 4 and config["torch_dtype"] == "bfloat16"
    assert json.loads((MODEL / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_unseen_code_is_the_test_data_and_its_stated_digest():
    shipped = (MODEL / P.CODE_FILE).read_text(encoding="utf-8")
    assert shipped == P.unseen_code_text(UNSEEN_CODE)
    digest = hashlib.sha256(shipped.encode("utf-8")).hexdigest()
    assert digest in (MODEL / "README.md").read_text(), "the model card states another digest"


def test_tokenizer_adds_bos_and_splits_digits():
    from rltlab.model.checkpoint import load_tokenizer
    tok = load_tokenizer(MODEL)
    ids = E.encode(tok, " 12*7=84. #### 84")
    assert tok.encode(" 12*7=84. #### 84") == [0] + ids
    assert E.decode(tok, ids) == " 12*7=84. #### 84"
    assert all(len(E.decode(tok, [i]).strip()) <= 1 for i in E.encode(tok, "1234567890"))


@pytest.mark.slow
def test_metrics_reproduce_on_cpu(recomputed):
    assert recomputed["settings"] == METRICS["settings"]
    n = METRICS["settings"]["n_problems"]
    for mine, ref in zip(recomputed["rounds"], METRICS["rounds"], strict=True):
        for key in ("text_loss", "code_loss", "arith_loss", "hops_loss"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-3), key
        for task in ("arith", "hops"):
            assert abs(mine[f"{task}_correct"] - ref[f"{task}_correct"]) <= max(1, n[task] // 100)
    print(f"CPU eval took {recomputed['wall_s']:.1f} s")


@pytest.mark.parametrize("source", ["metrics.json", "recomputed"])
@pytest.mark.slow
def test_deeper_rounds_matter(source, recomputed):
    r1, r2, r3, r4 = (METRICS if source == "metrics.json" else recomputed)["rounds"]
    for key in ("text_loss", "code_loss"):     # held-out stdlib text, code from outside training
        assert r4[key] <= 0.85 * r1[key], key
        for deeper, shallower in ((r2, r1), (r3, r2), (r4, r3)):   # every round >= 1% better
            assert deeper[key] <= 0.99 * shallower[key], (key, deeper["round"])
    assert r4["arith_loss"] <= 0.5 * r2["arith_loss"] and r4["arith_loss"] <= 0.1 * r1["arith_loss"]
    em = [r["hops_exact_match"] for r in (r1, r2, r3, r4)]   # the depth-graded task
    assert em == sorted(em) and len(set(em)) == 4, em
    assert em[0] <= 0.5 and em[3] >= 0.75 and em[3] >= em[1] + 0.15 and em[2] <= em[3] - 0.05


@pytest.fixture
def one_thread():
    """Short generations of small batches: under load (CI runs two workers on two cores) a
    second torch thread only spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(tok):
    problems = [json.loads(line) for line in (MODEL / P.HOPS_FILE).read_text().splitlines()][:3]
    return [p["question"] for p in problems] + ["def mean(values):\n    return"]


def test_string_prompts_get_the_bos_token_in_the_engine(one_thread):
    """generate(text) == generate([0] + ids) with the checkpoint's HF tokenizer, with the plain
    tokenizers.Tokenizer that notebooks load, and through AsyncLLM."""
    from rltlab.engine import LLM, AsyncLLM, SamplingParams
    from rltlab.model.checkpoint import load_model, load_model_and_tokenizer
    params = SamplingParams(max_tokens=4, temperature=0.0)
    model, hf_tok = load_model_and_tokenizer(MODEL, dtype=torch.float32)
    _, raw_tok, _ = load_model(MODEL)
    texts = _prompts(hf_tok)
    ids = [[0] + E.encode(hf_tok, t) for t in texts]
    pool = {"kv_cache_memory_gib": 0.1}   # ~2,800 tokens, not the CPU default's 2 GiB to zero
    reference = [o.outputs[0].token_ids for o in LLM(model, hf_tok, **pool).generate(ids, params)]
    for tok in (hf_tok, raw_tok):
        outs = LLM(model, tok, **pool).generate(texts, params)
        assert [o.prompt_token_ids for o in outs] == ids
        assert [o.outputs[0].token_ids for o in outs] == reference

    async def run_async():
        engine = AsyncLLM(model, hf_tok, **pool)
        return [(await engine.generate_final(t, params)).outputs[0].token_ids for t in texts]

    assert asyncio.run(run_async()) == reference


def test_generation_is_deterministic_and_batch_independent(one_thread):
    from rltlab.model.checkpoint import load_model_and_tokenizer
    from rltlab.model.generate import generate_plain
    model, tok = load_model_and_tokenizer(MODEL, dtype=torch.float32)
    prompts = [[0] + E.encode(tok, t) for t in _prompts(tok)]
    together = generate_plain(model, prompts, 12, depth=4, eos_token_id=0).token_ids
    alone = [generate_plain(model, [p], 12, depth=4, eos_token_id=0).token_ids[0]
             for p in prompts]
    assert together == alone
