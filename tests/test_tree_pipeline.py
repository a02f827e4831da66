"""Pipelined tree programs (ExecutionConfig.spec_pipeline), the adaptive lookup chain
(TreeProposer(adaptive_lookup=True)) and first drafts (TreeProposer(first_drafts=True)) in the
paged engine: target-only tokens and the host recompute of test_tree_graph.py's acceptance
rule, plus what those cannot see: launch counts, the capture's warm-up, the rows a program
skips and the state first drafts read."""
import pytest
import torch

from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import TreeProposer
from rltlab.engine.spec.decoder import SpecDecoder
from rltlab.engine.spec.tree_graph import TreeShape
from rltlab.engine.spec.tree_program import TreeProgram
from tree_oracle import (DEPTH, TREE, Oracle, expected_stats, greedy, make_engine,
                         target_tokens, token_lists, tree_model, tree_prompts)


@pytest.fixture(scope="module")
def model():
    return tree_model()


@pytest.fixture(scope="module")
def prompts():
    return tree_prompts()


# The oracle's ranks are set per prompt (each runs on its own engine): every case runs the
# three patterns (deep and partial acceptances; every heads' draft wrong, so every acceptance is
# the lookup chain's) on different prompts, rather than one pattern a case.
RANKS = [(0, 0, 0, 0), (1, 0, 0, 0), (9, 9, 9, 9), (0, 0, 0, 0)]


@pytest.mark.parametrize("lookup, ngram", [(3, 2), (6, 3)])
@pytest.mark.parametrize("pipeline, first", [(1, False), (3, False), (5, False), (5, True)])
@pytest.mark.parametrize("rule", [True, "agree"])
def test_adaptive_lookup_verifies_the_lookup_rows_after_a_hit(model, prompts, lookup, ngram,
                                                              pipeline, first, rule,
                                                              monkeypatch):
    """TreeProposer(adaptive_lookup=True or "agree"): tokens equal target-only, iterations,
    acceptances and verified nodes equal the host recompute of the rule (the lookup chain
    verified in a request's first iteration and after a lookup hit, or where the next lookup
    draft agrees with the heads), programs without the lookup rows run where the recompute
    says, and they never read the rows they skip (made NaN)."""
    max_tokens, bs = 32, max(DEPTH, lookup)
    params = greedy(max_tokens)
    target = target_tokens(model, prompts, max_tokens, block_size=bs)
    without, launch = [0], TreeProgram.launch

    def launch_poisoned(program):
        if not program.lookup_rows:
            without[0] += 1
            program.static.hidden_out[program.rows:].fill_(float("nan"))
        launch(program)
    monkeypatch.setattr(TreeProgram, "launch", launch_poisoned)
    skipped = 0
    for prompt, out, ranks in zip(prompts, target, RANKS):
        oracle = Oracle(out, ranks)
        without[0] = 0
        got = make_engine(model, TreeProposer(oracle, TREE, lookup=lookup, ngram=ngram,
                                              adaptive_lookup=rule, first_drafts=first),
                          spec_pipeline=pipeline, block_size=bs).generate(
                              [prompt], params)[0]
        assert token_lists([got]) == [out], ranks
        stats = tuple(got.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
        assert stats == expected_stats(oracle, out, max_tokens, TREE, prompt, lookup, ngram,
                                       rule, first), ranks
        always = expected_stats(oracle, out, max_tokens, TREE, prompt, lookup, ngram,
                                first_drafts=first)
        assert (without[0] > 0) == (stats != always), ranks   # skipping the rows changed what ran
        skipped += without[0]
    assert skipped > 0


def test_first_drafts_come_from_the_state_that_sampled_token_0(model, prompts, monkeypatch):
    """TreeProposer(first_drafts=True) with real heads: a request's first program drafts once
    from tree.first_hidden, which holds h_R of the prompt's last position (the reference
    model's final state there, fp32, 1e-5) and the pending token 0; tokens stay
    target-only's."""
    torch.manual_seed(0)
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    seen, draft = [], TreeProgram._draft_eager

    def spy(program, h, token):
        if h is program.tree.first_hidden:
            seen.append((h.clone(), token.clone()))
        return draft(program, h, token)
    monkeypatch.setattr(TreeProgram, "_draft_eager", spy)
    target = target_tokens(model, prompts, 12)
    tree = make_engine(model, TreeProposer(heads, TREE, lookup=3, first_drafts=True))
    for prompt, out in zip(prompts, target):
        seen.clear()
        assert token_lists(tree.generate([prompt], greedy(12))) == [out]
        assert len(seen) == 1
        with torch.no_grad():
            final = model(torch.tensor([prompt])).final_hidden[0, -1]
        torch.testing.assert_close(seen[0][0][0], final, atol=1e-5, rtol=1e-5)
        assert seen[0][1].tolist() == [out[0]]


def _count_calls(monkeypatch, owner, name) -> list[int]:
    calls, method = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return method(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("lookup", [0, 3])
def test_pipelined_programs_launch_only_while_the_sequence_goes_on(model, prompts, lookup,
                                                                   monkeypatch):
    """spec_pipeline = 3: a program is launched only after the last one's read-back shows the
    sequence goes on, so an EOS or stop token inside an accepted path and max_tokens end the
    launches: a request's launches equal its iterations, its engine steps are
    ceil(iterations / 3), and its tokens are target-only's. A streamed request takes one
    program per step."""
    launches = _count_calls(monkeypatch, TreeProgram, "launch")
    steps = _count_calls(monkeypatch, SpecDecoder, "_tree_step")
    target = target_tokens(model, prompts, 24)
    plain = make_engine(model)
    for prompt, out in zip(prompts, target):
        tree = make_engine(model, TreeProposer(Oracle(out, (0, 0, 0, 0)), TREE, lookup=lookup),
                           spec_pipeline=3)
        stop = greedy(24, stop_token_ids=[out[5]])
        for params, expected in ((stop, token_lists(plain.generate([prompt], stop))[0]),
                                 (greedy(24), out), (greedy(13), out[:13]),
                                 (greedy(2), out[:2])):   # greedy: target-only's first tokens
            launches[0] = steps[0] = 0
            outs = tree.generate([prompt], params)
            assert token_lists(outs) == [expected]
            stats = outs[0].outputs[0].spec_stats       # None: stopped at token 0
            iterations = stats["steps"] if stats else 0
            assert launches[0] == iterations and steps[0] == -(-iterations // 3)
        engine = tree.llm_engine
        launches[0] = steps[0] = 0
        engine.add_request(None, prompt, greedy(24), stream=True)
        while engine.has_unfinished_requests():
            engine.step()
        assert launches[0] == steps[0] > 2


@pytest.mark.parametrize("pipeline, which", [(4, 1), (1, 2)])   # prompts that show the bug
def test_pipelined_capture_warm_up_restores_the_programs_inputs(model, prompts, pipeline,
                                                                which, monkeypatch):
    """Where CUDA graphs run, the capture runs the program twice before capturing it; a
    program rewrites its candidates (a following one, spec_pipeline > 1, its pending token, P
    and cap too), so its warm-up must restore them. A stand-in capture (two warm-up runs, then
    the program at each replay), turned on after the request's first tree step so that it
    captures a program whose candidates are valid, must leave tokens and iterations as without
    it."""
    target = target_tokens(model, prompts, 24)

    captures = []

    class Replayed:
        def __init__(self, fn, warmup=None, keep=False):
            captures.append(fn)
            for _ in range(2):
                (warmup or fn)()
            self.replay = fn

    outs = {}
    for captured in (False, True):
        llm = make_engine(model, spec_pipeline=pipeline)
        proposer = TreeProposer(Oracle(target[which], (0, 1, 0, 0)), TREE, lookup=3)
        llm.set_proposer(proposer)
        # the decoder the program runs on (grown to the tree's rows)
        static = llm.llm_engine.runner.static_rows(TreeShape(proposer.paths, "cpu").num_rows)
        engine, done = llm.llm_engine, []
        engine.add_request(None, prompts[which], greedy(24))
        while engine.has_unfinished_requests():
            done += engine.step()
            running = engine.scheduler.running
            stats = running and getattr(running[0], "spec_stats", None)
            if captured and stats and not captures:
                monkeypatch.setattr(static, "cuda_graphs", True)
                monkeypatch.setattr(static, "_capture", Replayed)
        outs[captured] = done
        assert token_lists(done) == target[which: which + 1]
    assert len(captures) == 1
    assert outs[True][0].outputs[0].spec_stats == outs[False][0].outputs[0].spec_stats
    assert outs[True][0].outputs[0].spec_stats["accepted"] > 0


@pytest.mark.parametrize("pipeline", [1, 3, 5])
def test_first_leaf_writes_in_place_and_its_programs_copy_nothing(model, prompts, pipeline,
                                                                  monkeypatch):
    """A chain of heads beside an adaptive lookup chain (the claimed config's shape): the
    chain's leaf writes its K/V into the sequence's own slots, so a program without the lookup
    chain's rows copies no prefix block and commits nothing, and one with them commits once;
    tokens equal target-only and the iterations the host recompute."""
    max_tokens, lookup = 32, 3
    chain_tree = [tuple([0] * j) for j in range(1, DEPTH + 1)]
    params = greedy(max_tokens)
    target = target_tokens(model, prompts, max_tokens)
    # ranks per prompt: the heads' drafts true, then always wrong (every acceptance the lookup's)
    oracles = [Oracle(out, ((0, 0, 0, 0), (9, 9, 9, 9))[i % 2]) for i, out in enumerate(target)]
    launched, commits = {True: 0, False: 0}, [0]
    launch, commit = TreeProgram.launch, TreeProgram._commit

    def counted_launch(program):
        launched[program.lookup_rows] += 1
        launch(program)

    def counted_commit(program, *args):
        commits[0] += 1
        commit(program, *args)
    monkeypatch.setattr(TreeProgram, "launch", counted_launch)
    monkeypatch.setattr(TreeProgram, "_commit", counted_commit)
    outs = [make_engine(model, TreeProposer(oracle, chain_tree, lookup=lookup,
                                            adaptive_lookup="agree"),
                        spec_pipeline=pipeline)
            .generate([prompt], params)[0] for prompt, oracle in zip(prompts, oracles)]
    assert token_lists(outs) == target
    stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
             for o in outs]
    assert stats == [expected_stats(oracle, out, max_tokens, chain_tree, prompt, lookup,
                                    adaptive="agree")
                     for oracle, out, prompt in zip(oracles, target, prompts)]
    assert launched[False] > 0 and launched[True] > 0
    assert commits[0] == launched[True]   # the in-place programs commit nothing
