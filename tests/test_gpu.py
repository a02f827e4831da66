"""The engine's CUDA paths against the plain torch path, on a GPU (marked gpu: skipped without
CUDA; run with `python -m pytest -m gpu tests/test_gpu.py` on a GPU machine).

The CPU suite runs the Triton kernels in the interpreter; these run them compiled, with CUDA
graphs, whole-token windows and the one-row GEMV: fp32 outputs equal the gather path's, the
tree speculation path gives target-only's tokens, and warm_up() changes no output."""
from __future__ import annotations

import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.static_decode import CAPTURE_STATS
from tiny_models import random_prompts, tiny_engine_model

pytestmark = pytest.mark.gpu


def _params(num: int, max_tokens: int = 12) -> list[SamplingParams]:
    """Greedy requests at mixed exit regimes: full depth, fixed depth 2, the stock Q-exit."""
    kinds = [dict(exit_policy="fixed"), dict(exit_policy="fixed", exit_policy_args={"depth": 2}),
             dict(exit_policy="q_exit", exit_threshold=0.5, min_loops=1)]
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                           **kinds[i % 3]) for i in range(num)]


@pytest.mark.parametrize("concurrency", [1, 5])
def test_static_cuda_path_equals_the_gather_path_in_fp32(concurrency):
    """One row (the Triton GEMV, PDL where Hopper) and several rows (FMA products in fp32),
    with CUDA graphs and windows: the same tokens, exits and log-probs (1e-4)."""
    model = tiny_engine_model(3)
    prompts = random_prompts(6, seed=2, min_len=3, max_len=20)
    params = _params(len(prompts))
    kw = dict(device="cuda", dtype="float32", max_num_seqs=concurrency)
    fast = LLM(model, decode_path="static", **kw).generate(prompts, params)
    plain = LLM(model, decode_path="gather", **kw).generate(prompts, params)
    for a, b in zip(fast, plain):
        assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_tree_speculation_on_cuda_gives_target_only_tokens():
    from rltlab.common.paths import embedded_model_dir
    from rltlab.draft_heads.lookahead import load_proposer
    from rltlab.model.checkpoint import load_model

    model, tokenizer, model_dir = load_model(None, device="cuda", dtype="float32")
    heads = model_dir / "draft_heads" / "lookahead_h4"
    prompts = ["def f(x):\n    return", "Q: a=3; b=a+4; b=?\nA:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, tokenizer, max_num_seqs=1)
    target = [o.token_ids for o in llm.generate(prompts, params)]
    llm.set_proposer(load_proposer(heads, llm.llm_engine.model, lookup=8))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == target
    assert all(o.spec_stats and o.spec_stats["steps"] for o in spec)
    assert embedded_model_dir() == model_dir


def test_warm_up_captures_graphs_and_changes_no_output():
    model = tiny_engine_model(5)
    prompts = random_prompts(4, seed=8, min_len=3, max_len=30)
    params = _params(len(prompts))
    before = [o.token_ids for o in LLM(model, device="cuda", max_num_seqs=4)
              .generate(prompts, params)]
    llm = LLM(model, device="cuda", max_num_seqs=4)
    captured = CAPTURE_STATS["graphs"]
    result = llm.warm_up(prompt_len=40, max_tokens=8, progress=False)
    assert result["graphs"] > 0 and result["seconds"] > 0
    # every capture is counted: the static decoder's graphs and the prefill buckets'
    assert CAPTURE_STATS["graphs"] - captured >= result["graphs"]
    graphs, captured = len(llm.llm_engine.runner.static._graphs), CAPTURE_STATS["graphs"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    assert len(llm.llm_engine.runner.static._graphs) == graphs   # nothing new to capture
    assert CAPTURE_STATS["graphs"] == captured


def test_auto_loads_a_checkpoint_on_the_gpu_in_bf16():
    from rltlab.common.paths import embedded_model_dir

    llm = LLM(str(embedded_model_dir()))
    param = next(llm.llm_engine.model.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.bfloat16
    out = llm.generate("Q: a=3; b=a+4; b=?\nA:", SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].outputs[0].text


def test_lookahead_exit_patch_on_cuda_equals_the_cpu(tmp_path):
    """The N+2 exit patch on a model on the GPU, its predictor loaded from the checkpoint on the
    CPU (notebook 02's route): fp32 tokens and exit rounds equal the CPU engine's."""
    from test_lookahead_patch import PROMPTS, _checkpoint, _model

    from rltlab.engine_patches.lookahead_exit import install

    outputs = {}
    for device in ("cpu", "cuda"):
        model = _model().to(device)
        name = install(model, _checkpoint(tmp_path / device, model),
                       name=f"n_plus_2_{device}_test")
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                exit_policy=name, exit_policy_args={"threshold": 0.5})
        llm = LLM(model, device=device, dtype="float32", max_num_seqs=3)
        outputs[device] = [(o.outputs[0].token_ids, o.outputs[0].exit_depths)
                           for o in llm.generate(PROMPTS, params)]
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.parametrize("prefix_splits", [None, 3])
def test_shared_prefix_attention_compiled_equals_the_reference(prefix_splits):
    """The compiled shared-prefix kernels at Ouro's head shape (16 heads of 128, key tiles of
    64) on groups of 8 rows with a 512-key prompt and own keys of different lengths, plus rows
    in no group: fp32 outputs equal paged_decode_attention_ref's (the own keys are done by the
    group programs, dealt out by member and key-range split)."""
    import numpy as np

    from rltlab import kernels

    g = torch.Generator().manual_seed(11)
    block_size, blocks, heads, dim, prompt = 16, 48, 16, 128, 512
    rows, shared_blocks = 20, prompt // block_size
    free = torch.randperm(rows * blocks, generator=g).tolist()
    tables = []
    for group in ([8] * 2 + [1] * 4):
        common = [free.pop() for _ in range(shared_blocks)]
        tables += [common + [free.pop() for _ in range(blocks - shared_blocks)]
                   for _ in range(group)]
    tables = torch.tensor(tables, dtype=torch.int32)
    ctx = torch.randint(prompt + 1, blocks * block_size, (rows,), generator=g, dtype=torch.int32)
    planes = torch.zeros(rows, dtype=torch.int32)
    start, length = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    members = np.full((rows, kernels.MAX_MEMBERS), -1, np.int32)
    assert kernels.shared_prefix_plan(planes.numpy(), ctx.numpy(), tables.numpy(), block_size,
                                      start, length, members) == 2
    kv = torch.randn(2, 1, rows * blocks, block_size, heads, dim, generator=g).cuda()
    q = torch.randn(rows, heads, dim, generator=g).cuda()
    plan = kernels.SharedPrefix(*(torch.from_numpy(a).cuda() for a in (start, length, members)))
    args = (q, kv[0], kv[1], planes.cuda(), tables.cuda(), ctx.cuda(), dim ** -0.5)
    want = kernels.paged_decode_attention_ref(*args)
    got = kernels.paged_decode_attention(*args, shared=plan, num_prefix_splits=prefix_splits)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
