"""Shared-prefix decode attention in the engine (ExecutionConfig.shared_prefix_attention,
rltlab/engine/prefix_groups.py): groups of n samples decode through the Triton kernels
(interpreted on CPU, fp32) with their prompt's K/V read once per group, and give the rollouts
of the same engine without groups (on the torch reference kernels, which the plain Triton
kernels equal), in token windows, whole-token steps (per-step staging) and round windows (where
the plan is cleared)."""
import pytest
import torch

from rltlab import kernels
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.static_decode import StaticDecoder
from test_engine_exactness import random_prompts
from test_engine_groups import assert_same, completions
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
# Prompts of 9 and 14 tokens: two and three whole blocks of 4 shared by each group's samples.
PROMPTS = [random_prompts(1, seed=31, lo=9, hi=10)[0], random_prompts(1, seed=32, lo=14,
                                                                        hi=15)[0]]
# 3 samples of each prompt: 6 rows, a bucket of 6 (each row costs interpreted programs)
ENGINE = dict(block_size=4, prefill_chunk=16, max_num_seqs=6, max_num_batched_tokens=64)
FIXED = [dict(exit_policy="fixed")] * 2
# replayed depths, one trace per request: whole tokens of depth 3 first (a token window plans
# groups), then the groups' rows sit at different rounds (round windows must clear the plan)
TRACES = [dict(exit_policy="trace", exit_policy_args={"depths": depths})
          for depths in ([4, 3, 3, 3, 2, 4, 1, 3, 2], [4, 3, 3, 3, 4, 1, 2, 2, 3])]
# token windows (default), whole-token steps staged per step, round windows
PATHS = {"token_window": ({}, FIXED), "per_step": ({"token_window": 0}, FIXED),
         "round_window": ({}, TRACES)}


def triton_engine(model, shared: bool, **extra):
    """The static path with the Triton kernels forced (interpreted off CUDA)."""
    llm = LLM(model, decode_path="static", shared_prefix_attention=shared, **ENGINE, **extra)
    runner = llm.llm_engine.runner
    runner.static = StaticDecoder(runner.model, max_batch=runner.static.max_batch, triton=True,
                                  **{**runner._static_args, "shared_prefix": shared})
    return llm


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.slow
def test_grouped_samples_equal_the_plain_kernels(path):
    extra, policies = PATHS[path]
    model = tiny_engine_model(8)
    # 6 tokens: the round window's rows reach different rounds at tokens 4 and 5 (each token
    # costs ~60 interpreted kernel launches)
    params = [SamplingParams(n=3, temperature=1.0, seed=50 + i, max_tokens=6, logprobs=0,
                             **policies[i]) for i in range(len(PROMPTS))]
    # the reference: the same engine without groups, on the torch reference attention (the
    # plain Triton kernels equal it: test_kernels.py, test_engine_static.py)
    plain = LLM(model, decode_path="static", shared_prefix_attention=False, **ENGINE,
                **extra).generate(PROMPTS, params)
    llm = triton_engine(model, shared=True, **extra)
    groups = llm.llm_engine.runner.static.groups
    planned = []   # groups per plan
    plan = groups.plan
    groups.plan = lambda *a: planned.append(groups.count(made := plan(*a))) or made
    launches = []   # per attention call: (inside a round window, took a plan)
    engine, in_window = llm.llm_engine, [False]
    attention = engine.runner.static._attention
    engine.runner.static._attention = lambda *a, **k: launches.append(
        (in_window[0], "shared" in k)) or attention(*a, **k)
    window_step = engine._round_window.step

    def round_window_step(plan):
        in_window[0] = True
        try:
            return window_step(plan)
        finally:
            in_window[0] = False
    engine._round_window.step = round_window_step
    outs = llm.generate(PROMPTS, params)
    assert_same(completions(outs), completions(plain))
    assert max(planned) == 2   # both prompts' samples grouped
    assert any(shared for _, shared in launches)
    if path == "round_window":   # rows change planes from step to step: never planned there
        assert any(inside for inside, _ in launches)
        assert not any(shared for inside, shared in launches if inside)
