"""Bucketed prefill graphs (rltlab.engine.prefill_graphs): steps of whole prompts padded to
(prompts, length) buckets and replayed from static buffers, against the plain fused prefill.
fp32 on CPU, where the replay re-runs the captured function on the same buffers (the capture
itself needs CUDA). Tolerance 1e-5 on log-probs (assert_same_rollouts), 1e-5 on the KV cache."""
import pytest
import torch

from rltlab.engine import LLM, ExecutionConfig, SamplingParams
from rltlab.engine.prefill_graphs import (DEFAULT_MAX_TOKENS, PrefillGraphs, bucket,
                                          resolve_max_tokens)
from test_engine_exactness import POLICIES, assert_same_rollouts, params_list, random_prompts
from tiny_models import tiny_engine_model

torch.set_num_threads(1)


@pytest.mark.parametrize("policy", ["fixed", "q_exit"])
def test_bucketed_prefill_graphs_equal_the_fused_prefill(policy):
    """Prompts of 1-19 tokens admitted two or three at a time, so their whole-prompt steps pad
    into recurring buckets and replay: the same rollouts as the fused prefill, and the same KV
    cache afterwards (padding tokens write nothing, and no slot of an earlier, larger step is
    written again)."""
    model = tiny_engine_model(8)
    prompts = random_prompts(14, seed=21)
    params = params_list(prompts, POLICIES[policy], seed0=50)
    # one round per step (whole-prompt steps replay R-round buckets: test_prompt_step.py)
    engine_args = dict(decode_path="static", block_size=4, max_num_seqs=3,
                       max_num_batched_tokens=64, prefill_chunk=32, whole_prompt_steps=False)
    plain = LLM(model, **engine_args)
    graphs = LLM(model, prefill_graph_tokens=128, **engine_args)
    assert_same_rollouts(plain.generate(prompts, params), graphs.generate(prompts, params))
    stats = graphs.llm_engine.runner.prefill_graphs.stats
    assert stats["replayed"] >= 8 and stats["eager"] >= 1, stats
    assert len(graphs.llm_engine.runner.prefill_graphs.buckets) >= 2
    assert torch.allclose(plain.llm_engine.runner.kv_cache, graphs.llm_engine.runner.kv_cache,
                          atol=1e-5, rtol=0)


def test_steps_that_do_not_fit_a_bucket_run_eagerly():
    model = tiny_engine_model(8)
    llm = LLM(model, decode_path="static", block_size=4, max_num_seqs=3,
              max_num_batched_tokens=64, prefill_chunk=32, prefill_graph_tokens=64)
    graphs = llm.llm_engine.runner.prefill_graphs
    assert graphs.bucket_of([(0, 5, 0, 0), (5, 20, 1, 0), (25, 9, 0, 0)]) is None   # 4 x 32
    assert graphs.bucket_of([(0, 5, 0, 0), (5, 9, 1, 0)]) == (2, 16)
    assert graphs.bucket_of([(0, 5, 0, 3)]) is None    # a chunk from position 3
    assert graphs.bucket_of([(0, 5, 0, 0), (6, 5, 0, 0)]) is None   # not back to back
    assert [bucket(n, 16, 128) for n in (1, 16, 17, 100, 129, 300)] == [16, 16, 32, 128, 256, 384]
    assert [bucket(n, 1, 8) for n in (1, 3, 8, 9, 17)] == [1, 4, 8, 16, 24]
    assert graphs.bucket_of([(0, 3, 0, 0), (3, 3, 0, 0), (6, 3, 0, 0)]) == (4, 16)
    # A 59-token prompt in chunks of 32: the first (from position 0) buckets as (1, 32), its
    # round 1 eager, rounds 2-4 replayed; the later chunk's 4 rounds take the fused prefill.
    out = llm.generate([list(range(1, 60))], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out[0].token_ids) == 2
    assert graphs.stats == {"eager": 5, "replayed": 3, "from ids": 0}, graphs.stats


def test_prefill_graphs_are_on_by_default_only_where_cuda_graphs_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_max_tokens(None, cuda, cuda_graphs=True) == DEFAULT_MAX_TOKENS > 0
    assert resolve_max_tokens(None, cuda, cuda_graphs=False) == 0
    assert resolve_max_tokens(None, cpu, cuda_graphs=True) == 0
    assert resolve_max_tokens(0, cuda, cuda_graphs=True) == 0     # an explicit value wins
    assert resolve_max_tokens(64, cpu, cuda_graphs=True) == 64
    assert ExecutionConfig().prefill_graph_tokens is None


def test_prefill_graph_tokens_must_be_a_non_negative_int():
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="prefill_graph_tokens"):
            ExecutionConfig(prefill_graph_tokens=bad)
    model = tiny_engine_model(8)
    assert LLM(model, decode_path="static").llm_engine.runner.prefill_graphs is None
    assert LLM(model, decode_path="gather",
               prefill_graph_tokens=64).llm_engine.runner.prefill_graphs is None
    assert isinstance(LLM(model, decode_path="static", prefill_graph_tokens=64)
                      .llm_engine.runner.prefill_graphs, PrefillGraphs)
