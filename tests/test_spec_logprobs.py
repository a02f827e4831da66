"""Speculative log-probs are the target's under the verified round, in both logprobs_mode's
(issue 61 item 16): raw = log_softmax(logits), processed = log_softmax after temperature,
top-k and top-p, as the sampler reports them. Every speculative path is held to it: the
DraftProposer's host loop (gather path) and one-program iteration (static path), a Proposer
through the generic tree verifier, and a TreeProposer's requests that its device program does
not take (log-probs, here) through the same verifier.

T = 0 (with top-k / top-p, which processed mode sees): tokens, log-probs and top log-probs equal
the engine's without a proposer. T = 1: each log-prob equals a teacher-forced full-depth
recompute of the request's own tokens, raw or processed (planting raw logits in processed mode
fails here and in the T = 0 case)."""
import pytest
import torch

from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import LLM, DraftProposer, SamplingParams, TreeProposer
from rltlab.engine.sampling import process_logits
from rltlab.engine.spec.protocol import DraftTree
from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)
MODES = ["raw_logprobs", "processed_logprobs"]


class RepeatLast:
    def propose(self, states):
        return [DraftTree.chain(s.token_ids[-3:]) for s in states]

    def observe(self, state, verdict):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(4)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=8, min_len=2, max_len=10)


def _engine(model, kind, mode):
    if kind == "tree_proposer":
        llm = LLM(model, block_size=8, decode_path="static", logprobs_mode=mode, num_blocks=64)
        heads = LookaheadHeads(model, depth=2, inner=8)
        llm.set_proposer(TreeProposer(heads, [(0,), (1,), (0, 0)], lookup=3))
        return llm
    path = "static" if kind == "draft_program" else "gather"
    llm = LLM(model, block_size=4, decode_path=path, logprobs_mode=mode)
    llm.set_proposer(RepeatLast() if kind == "protocol" else DraftProposer(3, 1))
    return llm


KINDS = ["draft_host_loop", "draft_program", "protocol", "tree_proposer"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_logprobs_equal_plain_decoding(model, prompts, kind, mode):
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True,
                             exit_policy="fixed", **extra)
              for extra in ({"top_k": 3}, {"top_p": 0.6}, {}, {"top_k": 5, "top_p": 0.8})]
    refs = LLM(model, block_size=4, logprobs_mode=mode).generate(prompts, params)
    outs = _engine(model, kind, mode).generate(prompts, params)
    for out, ref in zip(outs, refs):
        a, b = out.outputs[0], ref.outputs[0]
        assert a.spec_stats is not None
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t] - y[t]) for t in x) < 1e-5


def _recomputed(model, prompt, out, params, mode):
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        logits = model(ids).final_logits[0, len(prompt) - 1:].float()
    if mode == "processed_logprobs":
        n = logits.shape[0]
        logits = process_logits(logits, torch.full((n,), params.temperature),
                                torch.full((n,), params.top_k), torch.full((n,), params.top_p))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_are_the_targets(model, prompts, kind, mode):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, logprobs=0,
                            seed=5, ignore_eos=True, exit_policy="fixed")
    outs = _engine(model, kind, mode).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        got = torch.tensor(out.outputs[0].logprobs)
        assert out.outputs[0].spec_stats is not None
        want = _recomputed(model, prompt, out.outputs[0], params, mode)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() < 1e-4, (got, want)
