"""The Proposer protocol (rltlab.engine.spec.protocol): a drafter written here, "repeat the last
k tokens", plugs in through set_proposer and decoding stays lossless: token-identical to the
engine without a proposer at T = 0 (log-probs within 1e-5), the target's distribution at
T = 1 (chi-square against the enumerated joint). A branching oracle whose right guess sits in
the tree's second branch forces every acceptance through a fork, so the fork's prefix copy and
the commit of its K/V are exercised (breaking either changes the tokens); paths cross block
boundaries. Bad proposers and bad trees are refused by name; short of KV blocks, trees are
pruned, still lossless; observe() hears exactly what was appended."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.spec.decoder import SpeculationOffWarning
from rltlab.engine.spec.protocol import DraftTree, Proposer
from test_sampling_temperatures import PROMPT, VOCAB, _model, exact_joint, goodness_of_fit
from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)
R = 4


class RepeatLast:
    """The toy drafter: guesses that the text repeats its last k tokens."""

    def __init__(self, k: int = 3):
        self.k, self.batches, self.verdicts = k, [], {}

    def propose(self, states):
        self.batches.append(len(states))
        return [DraftTree.chain(s.token_ids[-self.k:]) for s in states]

    def observe(self, state, verdict):
        self.verdicts.setdefault(state.key, []).append(verdict)


class BranchOracle:
    """Knows each request's reference output: the tree's first branch is 3 wrong tokens, its
    second the next `depth` true ones, so every acceptance is the second branch's (a fork)."""

    def __init__(self, refs: dict, depth: int = 5):
        self.refs, self.depth = refs, depth

    def propose(self, states):
        trees = []
        for s in states:
            done = len(s.token_ids) - s.num_prompt_tokens     # outputs so far: ref[:done]
            true = self.refs[s.request_id][done: done + self.depth]
            if not true:
                trees.append(None)
                continue
            wrong = [(t + 1) % 61 for t in true[:3]]
            parents = list(range(-1, len(wrong) - 1)) + [-1] + \
                [len(wrong) + j for j in range(len(true) - 1)]
            trees.append(DraftTree(wrong + true, parents))
        return trees

    def observe(self, state, verdict):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=5, min_len=1, max_len=14)


def _greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, seed=0,
                          exit_policy="fixed", **kw)


def _same(outs, refs):
    for out, ref in zip(outs, refs):
        a, b = out.outputs[0], ref.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.exit_depths == b.exit_depths == [R] * len(b.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def _no_leaks(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owner


@pytest.mark.parametrize("conc", [1, 5])
def test_toy_proposer_is_lossless_at_t0(model, prompts, conc):
    params = [_greedy(ignore_eos=i % 2 == 0) if i % 3 else _greedy(stop_token_ids=[7])
              for i in range(len(prompts))]
    refs = LLM(model, block_size=4, max_num_seqs=conc).generate(prompts, params)
    toy = RepeatLast(3)
    assert isinstance(toy, Proposer)
    llm = LLM(model, block_size=4, max_num_seqs=conc)
    llm.set_proposer(toy)
    outs = llm.generate(prompts, params)
    _same(outs, refs)
    assert max(toy.batches) == conc              # every running request in one propose call
    for out in outs:
        s = out.outputs[0].spec_stats
        assert s["emitted"] == s["accepted"] + s["steps"] and s["drafted"] <= 3 * s["steps"]
        tokens = out.outputs[0].token_ids
        verdicts = toy.verdicts[(out.request_id, 0)]
        assert sum((v.tokens for v in verdicts), []) == tokens[1:]   # token 0: the prefill's
        assert verdicts[-1].finished and not any(v.finished for v in verdicts[:-1])
    assert any(o.outputs[0].spec_stats["accepted"] for o in outs)
    _no_leaks(llm)


@pytest.mark.parametrize("path", ["gather", "static"])
def test_accepted_branch_in_a_fork_is_committed(model, prompts, path):
    params = _greedy(16, ignore_eos=True)
    refs = LLM(model, block_size=4, decode_path=path).generate(prompts, params)
    oracle = BranchOracle({str(i): r.outputs[0].token_ids for i, r in enumerate(refs)})
    llm = LLM(model, block_size=4, decode_path=path)
    llm.set_proposer(oracle)
    outs = llm.generate(prompts, params)
    _same(outs, refs)
    for out in outs:   # every step accepts the second branch to the cap
        s = out.outputs[0].spec_stats
        assert s["accepted"] == s["emitted"] - s["steps"] >= 2 * s["steps"] - 2
    _no_leaks(llm)


def test_toy_proposer_is_lossless_at_t1():
    model, n = _model(), 1500
    llm = LLM(model, block_size=4, max_num_seqs=n, max_num_batched_tokens=n * len(PROMPT),
              decode_path="gather")
    llm.set_proposer(RepeatLast(2))
    outs = llm.generate([PROMPT], SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=3,
                                                 ignore_eos=True, exit_policy="fixed"))[0].outputs
    stats = [o.spec_stats for o in outs]
    assert 0 < sum(s["accepted"] for s in stats) < sum(s["drafted"] for s in stats)
    seqs = torch.tensor([o.token_ids[:3] for o in outs])
    joint = exact_joint(model, 1.0)
    pvalue, tv = goodness_of_fit(seqs[:, 1] * VOCAB + seqs[:, 2], joint.sum(0).reshape(-1))
    assert pvalue > 1e-3 and tv < 0.1, (pvalue, tv)


def test_short_of_blocks_trees_are_pruned_and_still_lossless(model, prompts):
    params = _greedy(16, ignore_eos=True)
    refs = LLM(model, block_size=4).generate(prompts[:2], params)
    oracle = BranchOracle({str(i): r.outputs[0].token_ids for i, r in enumerate(refs)})
    # the two sequences' reservations and one block more: too few for most forks
    blocks = sum(-(-(len(p) + 15) // 4) for p in prompts[:2]) + 1
    llm = LLM(model, block_size=4, num_blocks=blocks, max_num_seqs=2)
    llm.set_proposer(oracle)
    with pytest.warns(SpeculationOffWarning, match="KV blocks"):
        outs = llm.generate(prompts[:2], params)
    _same(outs, refs)
    _no_leaks(llm)


def test_rows_stay_within_the_step_token_budget(model, prompts):
    """max_num_batched_tokens = 4 at c = 1: at most 4 rows a step (the first leaf cut to 3
    drafts, the fork's branch dropped unless both fit); still lossless."""
    params = _greedy(12, ignore_eos=True)
    refs = LLM(model, block_size=4, max_num_batched_tokens=4).generate(prompts, params)
    oracle = BranchOracle({str(i): r.outputs[0].token_ids for i, r in enumerate(refs)})
    llm = LLM(model, block_size=4, max_num_batched_tokens=4, max_num_seqs=1)
    llm.set_proposer(oracle)
    verifier, rows = llm.llm_engine._spec._generic, []
    verify = verifier._verify
    verifier._verify = lambda plans: rows.append(sum(len(p) for pl in plans
                                                     for p in pl.leaves)) or verify(plans)
    outs = llm.generate(prompts, params)
    _same(outs, refs)
    assert max(rows) == 4 and all(o.outputs[0].spec_stats["drafted"] <= 3 * o.outputs[0]
                                  .spec_stats["steps"] for o in outs)


class _Bad:
    def __init__(self, make):
        self.make = make

    def propose(self, states):
        return self.make(states)

    def observe(self, state, verdict):
        pass


@pytest.mark.parametrize("make, match", [
    (lambda s: [], "one DraftTree"),
    (lambda s: [[1, 2]] * len(s), "DraftTree or None"),
    (lambda s: [DraftTree([1, 2], [-1, 1])] * len(s), "parent 1"),
    (lambda s: [DraftTree([1, 61], [-1, 0])] * len(s), "token 1"),
    (lambda s: [DraftTree([1], [-1], torch.ones(1, 5))] * len(s), "DraftTree.q"),
])
def test_bad_trees_are_refused_by_name(model, make, match):
    llm = LLM(model, block_size=4)
    llm.set_proposer(_Bad(make))
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3]], _greedy(4))


def test_objects_without_the_protocol_are_refused(model):
    class OnlyPropose:
        def propose(self, states):
            return [None] * len(states)
    llm = LLM(model)
    for bad in (object(), OnlyPropose()):
        with pytest.raises(TypeError, match="Proposer"):
            llm.set_proposer(bad)
