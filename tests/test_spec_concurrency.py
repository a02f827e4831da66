"""Several requests speculate in the same step, and speculation switches itself off where it
does not run, saying so (issue 61 item 12).

- c >= 2: every running request's tree is proposed in one call and verified in one batched
  pass, lossless; a TreeProposer's requests at c = 2 go through the same verifier (its device
  program keeps the lone greedy request, unchanged).
- ExecutionConfig.spec_max_concurrency: above it the engine decodes without speculation (with
  target-only decoding's own paths, the proposer restored after each step), warns once per
  engine naming the setting, and speculates again once few enough run.
- A request whose exit policy is not full depth turns speculation off while it runs: warned
  once per engine, naming the policy; a new engine warns again."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.config import ExecutionConfig
from rltlab.engine.spec.decoder import SpeculationOffWarning
from rltlab.engine.spec.protocol import DraftTree
from tiny_models import random_prompts, tiny_engine_model
from tree_oracle import TREE, Oracle, greedy, make_engine, token_lists, tree_model, tree_prompts

torch.set_num_threads(1)


class RepeatLast:
    def __init__(self):
        self.batches = []

    def propose(self, states):
        self.batches.append(len(states))
        return [DraftTree.chain(s.token_ids[-2:]) for s in states]

    def observe(self, state, verdict):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(5)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=2, min_len=2, max_len=9)


def _params(max_tokens):
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens + 3 * i, ignore_eos=True,
                           exit_policy="fixed") for i in range(4)]


def _off_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, SpeculationOffWarning)]


def test_requests_speculate_together(model, prompts):
    refs = LLM(model, block_size=4).generate(prompts, _params(8))
    toy = RepeatLast()
    llm = LLM(model, block_size=4)
    llm.set_proposer(toy)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outs = llm.generate(prompts, _params(8))
    assert token_lists(outs) == token_lists(refs)
    assert toy.batches[0] == 4 and min(toy.batches) < 4   # fewer as requests finish
    assert all(o.outputs[0].spec_stats for o in outs) and not _off_warnings(record)


@pytest.mark.parametrize("path", ["gather", "static"])
def test_concurrency_limit_switches_off_and_back_with_one_warning(model, prompts, path):
    """On the static path the plain steps are token windows (several tokens a step), which
    here finish every request while more than 2 run."""
    refs = LLM(model, block_size=4, decode_path=path).generate(prompts, _params(8))
    toy = RepeatLast()
    llm = LLM(model, block_size=4, decode_path=path, spec_max_concurrency=2)
    llm.set_proposer(toy)
    engine = llm.llm_engine
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outs = llm.generate(prompts, _params(8))
        again = llm.generate(prompts, _params(8))
    assert token_lists(outs) == token_lists(refs) == token_lists(again)
    assert max(toy.batches, default=0) <= 2     # never above the limit
    assert outs[0].outputs[0].spec_stats is None   # it finished while 3 or 4 ran
    if path == "gather":   # one token a plain step: the last two speculate at the end
        assert outs[3].outputs[0].spec_stats is not None
    messages = _off_warnings(record)
    assert len(messages) == 1 and "spec_max_concurrency=2" in messages[0]
    assert engine.proposer is toy                # restored after every plain step


def test_policy_not_full_depth_is_warned_once_per_engine(model, prompts):
    early = SamplingParams(temperature=0.0, max_tokens=6, exit_threshold=0.5, min_loops=1)
    for _ in range(2):   # a new engine warns again
        llm = LLM(model, block_size=4)
        llm.set_proposer(RepeatLast())
        with pytest.warns(SpeculationOffWarning, match="exit policy") as record:
            first = llm.generate(prompts[:2], early)
            second = llm.generate(prompts[:2], early)
        assert len(_off_warnings(record)) == 1
        assert all(o.outputs[0].spec_stats is None for o in first + second)


def test_bad_limits_are_refused():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="spec_max_concurrency"):
            ExecutionConfig(spec_max_concurrency=bad)


def test_tree_proposer_at_c2_through_the_verifier():
    """Two greedy requests at once: the TreeProposer's oracle candidates as trees, verified
    together; lossless. A lone greedy request still takes its device program."""
    model, prompts = tree_model(), tree_prompts()[:2]
    target = token_lists(make_engine(model, max_num_seqs=2).generate(prompts, greedy(20)))
    llm = make_engine(model, max_num_seqs=2, num_blocks=128)
    oracle = Oracle(target[0], (0, 1, 0, 0))   # right for the first request's tokens only
    llm.set_proposer(TreeProposer(oracle, TREE, lookup=3))
    spec = llm.llm_engine._spec
    calls = []
    step = spec._generic.step
    spec._generic.step = lambda seqs: calls.append(len(seqs)) or step(seqs)
    outs = llm.generate(prompts, greedy(20))
    assert token_lists(outs) == target
    assert 2 in calls
    stats = outs[0].outputs[0].spec_stats
    assert stats["accepted"] > stats["steps"]    # deep acceptances through the tree
    calls.clear()                                # a lone greedy request: the device program
    alone = llm.generate(prompts[:1], greedy(20))
    assert token_lists(alone) == target[:1] and not calls
    assert alone[0].outputs[0].spec_stats["accepted"] > 0


def test_cuda_default_lets_sampled_requests_speculate_only_alone(model):
    """With spec_max_concurrency=None on CUDA (the device faked here): up to 8 greedy sequences
    speculate, sampled ones only alone (docs/results.md H23: at T = 1 the generic verifier of
    c >= 2 lost at every concurrency measured); a configured limit holds at any temperature."""
    from rltlab.engine.spec.decoder import (SPEC_MAX_CONCURRENCY_CUDA,
                                            SPEC_MAX_CONCURRENCY_CUDA_SAMPLED)
    llm = LLM(model, block_size=4)
    llm.set_proposer(RepeatLast())
    spec = llm.llm_engine._spec
    spec.runner = SimpleNamespace(device=torch.device("cuda"))

    def running(*temperatures, limit=None):
        seqs = [SimpleNamespace(params=SamplingParams(temperature=t)) for t in temperatures]
        execution = SimpleNamespace(spec_max_concurrency=limit)
        spec.engine = SimpleNamespace(scheduler=SimpleNamespace(running=seqs),
                                      config=SimpleNamespace(execution=execution))
        return spec.max_concurrency()

    assert running(0.0, 0.0) == SPEC_MAX_CONCURRENCY_CUDA == 8
    assert running(0.0, 1.0) == running(0.5) == SPEC_MAX_CONCURRENCY_CUDA_SAMPLED == 1
    assert running(1.0, 1.0, limit=4) == running(0.0, limit=4) == 4
