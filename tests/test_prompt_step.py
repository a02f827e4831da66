"""Whole-prompt steps (rltlab.engine.prompt_step): a step whose rows are all fresh whole
prompts runs their R rounds in one runner call. Against R round steps
(ExecutionConfig.whole_prompt_steps=False) on the CPU in fp32: the same rollouts (tokens and exit
depths equal, log-probs within 1e-5: assert_same_rollouts) and the same KV cache afterwards
(within 1e-5), on the gather path, the fused prefill, and the fused prefill with bucketed graphs
(off CUDA the replay re-runs the captured function on the same buffers)."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.fused_prefill import bucket
from test_engine_exactness import POLICIES, assert_same_rollouts, params_list, random_prompts
from tiny_models import tiny_engine_model

torch.set_num_threads(1)

PATHS = {
    "gather": dict(decode_path="gather"),
    "fused prefill": dict(decode_path="static", prefill_graph_tokens=0),
    "prefill graphs": dict(decode_path="static", prefill_graph_tokens=128),
}


def _engines(model, **engine_args):
    return (LLM(model, whole_prompt_steps=False, **engine_args),
            LLM(model, whole_prompt_steps=True, **engine_args))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("policy", ["fixed", "q_exit"])
def test_whole_prompt_steps_equal_round_steps(path, policy):
    """Prompts of 1-19 tokens in batches of four, three running at a time, those over 16
    tokens split into chunks: the same rollouts and KV cache as round steps only. Each batch's
    first step holds every running sequence, all fresh prompts (a whole-prompt step unless one
    is chunked; with graphs, an R-round bucket, replayed once its shape recurs); the fourth
    prompt joins running rows (round steps)."""
    model = tiny_engine_model(3)
    prompts = random_prompts(16, seed=31)
    params = params_list(prompts, POLICIES[policy], seed0=70)
    engine_args = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                       prefill_chunk=16, **PATHS[path])
    rounds, whole = _engines(model, **engine_args)
    for lo in range(0, len(prompts), 4):
        batch = slice(lo, lo + 4)
        assert_same_rollouts(rounds.generate(prompts[batch], params[batch]),
                             whole.generate(prompts[batch], params[batch]))
    assert whole.llm_engine._whole_prompts.steps >= 2
    assert rounds.llm_engine._whole_prompts is None
    assert torch.allclose(rounds.llm_engine.runner.kv_cache, whole.llm_engine.runner.kv_cache,
                          atol=1e-5, rtol=0)
    graphs = whole.llm_engine.runner.prefill_graphs
    if graphs is not None:
        num_rounds = model.config.num_rounds
        assert graphs.stats["replayed"] >= 1, graphs.stats
        assert any(key[2] == num_rounds for key in graphs.buckets), list(graphs.buckets)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_one_prompt_at_a_time(path):
    """c = 1 (max_num_seqs 1), the case whole-prompt steps are for: every prompt takes one,
    and the rollouts and KV cache equal round steps'."""
    model = tiny_engine_model(7)
    prompts = random_prompts(6, seed=41, lo=2)
    params = params_list(prompts, POLICIES["q_exit"], seed0=90)
    rounds, whole = _engines(model, block_size=4, max_num_seqs=1, **PATHS[path])
    assert_same_rollouts(rounds.generate(prompts, params), whole.generate(prompts, params))
    assert whole.llm_engine._whole_prompts.steps == len(prompts)
    assert torch.allclose(rounds.llm_engine.runner.kv_cache, whole.llm_engine.runner.kv_cache,
                          atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_captured_buckets_take_their_inputs_from_token_ids(batch):
    """From a bucket's third whole-prompt step on (the first runs eagerly, the second captures
    it), PrefillGraphs.run_from_ids writes the padded token ids, slots and last rows in one
    copy and gathers the embeddings into the bucket: the same rollouts and KV cache as round
    steps, one prompt a step (c = 1) and three (a bucket of four: one prompt slot is all
    padding). Prompts of 2-15 tokens, so every step takes the 16-token bucket."""
    model = tiny_engine_model(9)
    prompts = random_prompts(5 * batch, seed=61, lo=2, hi=16)
    params = params_list(prompts, POLICIES["q_exit"], seed0=110)
    rounds, whole = _engines(model, block_size=4, max_num_seqs=batch,
                             **PATHS["prefill graphs"])
    for lo in range(0, len(prompts), batch):   # one whole-prompt step of `batch` prompts each
        step = slice(lo, lo + batch)
        assert_same_rollouts(rounds.generate(prompts[step], params[step]),
                             whole.generate(prompts[step], params[step]))
    graphs = whole.llm_engine.runner.prefill_graphs
    assert graphs.stats["from ids"] == 3 and graphs.stats["eager"] == 1, graphs.stats
    assert list(graphs.buckets) == [(bucket(batch, 1, 8), 16, model.config.num_rounds)]
    assert torch.allclose(rounds.llm_engine.runner.kv_cache, whole.llm_engine.runner.kv_cache,
                          atol=1e-5, rtol=0)


def test_samples_sharing_a_prompt_take_it_from_a_whole_prompt_step():
    """n = 3 samples of one prompt (groups.py: one prefill, the others fork from it) and a
    one-token prompt, sampled at T = 1 with seeds: the same as round steps."""
    model = tiny_engine_model(4)
    prompts = [[5, 9, 2, 7, 7, 1, 3], [11]]
    params = [SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, logprobs=0,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=5, logprobs=0, ignore_eos=True)]
    rounds, whole = _engines(model, block_size=4, max_num_seqs=4, decode_path="static")
    a, b = rounds.generate(prompts, params), whole.generate(prompts, params)
    for x, y in zip(a, b):
        assert_same_rollouts(x.outputs, y.outputs)
    assert len(b[0].outputs) == 3 and whole.llm_engine._whole_prompts.steps >= 1


def test_prompts_admitted_while_another_sequence_runs_take_round_steps():
    """max_num_seqs 2: the first two prompts start together (one whole-prompt step); the third
    is admitted when the first finishes, while the second still decodes: round steps, the same
    rollouts."""
    model = tiny_engine_model(6)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in (2, 20, 3)]
    for path in ("gather", "static"):
        rounds, whole = _engines(model, block_size=4, max_num_seqs=2, decode_path=path)
        assert_same_rollouts(rounds.generate(prompts, params), whole.generate(prompts, params))
        assert whole.llm_engine._whole_prompts.steps == 1, path


def test_round_observers_still_see_every_prompt_round():
    """With a round observer registered, prompts take R round steps (the observer sees each)."""
    model = tiny_engine_model(5)
    llm = LLM(model, block_size=4, max_num_seqs=2, decode_path="static")
    seen = []
    llm.llm_engine.add_round_observer(lambda event: seen.append(event))
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=2))
    assert llm.llm_engine._whole_prompts.steps == 0
    assert len(seen) >= model.config.num_rounds


def test_whole_prompt_steps_must_be_a_bool():
    with pytest.raises(ValueError, match="whole_prompt_steps"):
        LLM(tiny_engine_model(0), whole_prompt_steps=1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_prompt_whose_token_0_logits_are_not_finite_fails_alone(temperature):
    """Token 0 sampled after a whole-prompt step (greedy rows: one kernel and one read-back;
    sampled rows: the sampler): the prompt whose h_R is NaN ends with a "non-finite logits"
    error and no token; the others' rollouts are those of an engine where nothing failed."""
    model = tiny_engine_model(3)
    prompts = random_prompts(3, seed=5)
    params = [SamplingParams(temperature=temperature, max_tokens=6, seed=40 + i,
                             exit_policy="fixed") for i in range(3)]
    clean = LLM(model, block_size=4, max_num_seqs=3).generate(prompts, params)
    llm = LLM(model, block_size=4, max_num_seqs=3)
    runner = llm.llm_engine.runner
    run_prompts = runner.run_prompts

    def nan_in_row_1(seqs):
        hidden = run_prompts(seqs).clone()
        hidden[1] = float("nan")
        return hidden
    runner.run_prompts = nan_in_row_1
    outs = llm.generate(prompts, params)
    assert llm.llm_engine._whole_prompts.steps == 1
    failed = outs[1].outputs[0]
    assert (failed.finish_reason, failed.error, failed.token_ids) == \
        ("error", "non-finite logits", [])
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == clean[i].outputs[0].token_ids
        assert outs[i].outputs[0].finish_reason == "length"
