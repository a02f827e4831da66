"""Tree speculative decoding inside the paged engine (rltlab.engine.spec.tree_graph) is lossless at
T = 0: the engine's own target-only tokens, whatever the drafts. An oracle drafter that knows
the reference continuation forces deep and partial acceptances through ranks > 0, with a block
size equal to the tree depth so that paths cross block boundaries (both private blocks, the
prefix copy and the commit are exercised); real heads, EOS, max_tokens caps, ineligible
requests, the block accounting and bad input are checked too. A prompt-lookup chain beside the
tree (TreeProposer(lookup=L)) is held to the same host recompute, the lookup's drafts from
rltlab.engine.spec.prompt_lookup's rule. Pipelined programs, the adaptive lookup chain and first
drafts: test_tree_pipeline.py."""
import pytest
import torch

import rltlab.kernels as kernels
from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.spec import SpeculationOffWarning
from rltlab.engine.block_manager import RESERVED
from rltlab.engine.static_decode import StaticDecoder
from rltlab.engine.spec.tree_graph import TreeShape, private_blocks
from tree_oracle import (DEPTH, ENGINE, TREE, Oracle, expected_stats, greedy, make_engine,
                         target_tokens, token_lists, tree_model, tree_prompts)


@pytest.fixture(scope="module")
def model():
    return tree_model()


@pytest.fixture(scope="module")
def prompts():
    return tree_prompts()


# The oracle's ranks and max_tokens are set per prompt (each prompt runs on its own engine):
# every case runs all four rank patterns and both caps, and over the two turns every prompt
# meets both caps and each pattern meets both caps (the cases are the pipeline settings x turn,
# not x ranks x max_tokens: the same code paths, a quarter of the runs).
RANKS = [(0, 0, 0, 0), (1, 1, 0, 0), (0, 1, 5, 0), (3, 0, 0, 0)]
CAPS = (24, 13)


def _per_prompt(turn: int, i: int) -> tuple[tuple[int, ...], int]:
    """(ranks, max_tokens) of prompt i in turn 0 or 1."""
    return RANKS[(i + 2 * turn) % 4], CAPS[(i + turn) % 2]


@pytest.mark.parametrize("turn", [0, 1])
@pytest.mark.parametrize("pipeline, first", [(1, False), (5, False), (1, True), (5, True)])
def test_oracle_drafts_are_accepted_and_lossless(model, prompts, pipeline, first, turn):
    """Tokens equal target-only, and every sequence's iterations and accepted drafts equal
    the host recompute of the acceptance rule (one program a step, or programs launched one
    after another from the device's state: spec_pipeline; first: the first iteration drafted
    from token 0's state, TreeProposer(first_drafts=True))."""
    for i, prompt in enumerate(prompts):
        ranks, max_tokens = _per_prompt(turn, i)
        target = target_tokens(model, prompts, max_tokens)[i]
        oracle = Oracle(target, ranks)
        out = make_engine(model, TreeProposer(oracle, TREE, first_drafts=first),
                          spec_pipeline=pipeline).generate(
                              [prompt], greedy(max_tokens))[0]
        assert token_lists([out]) == [target], (i, ranks, max_tokens)
        stats = tuple(out.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
        assert stats == expected_stats(oracle, target, max_tokens, first_drafts=first), \
            (i, ranks, max_tokens)
        if ranks == (0, 0, 0, 0):              # deep acceptances happen
            assert stats[1] >= stats[0], (i, stats)


# (lookup, ngram, tree) x the pipeline settings; with no heads' tree there is nothing to draft
# first (refused), so that pair is left out. Ranks per prompt: the first and third prompts'
# oracles draft the true tokens (0, 0, 0, 0), the others' always wrong ones (9, 9, 9, 9).
LOOKUP_CASES = [pytest.param(lookup, ngram, tree, pipeline, first,
                             id=f"{pipeline}-{first}-{lookup}-{ngram}-"
                                f"{'tree' if tree else 'no tree'}")
                for lookup, ngram, tree in [(3, 2, TREE), (6, 3, TREE), (4, 1, [])]
                for pipeline, first in [(1, False), (3, False), (5, False), (5, True)]
                if tree or not first]


@pytest.mark.parametrize("lookup, ngram, tree, pipeline, first", LOOKUP_CASES)
def test_lookup_chain_beside_the_tree_is_lossless_and_follows_the_rule(
        model, prompts, lookup, ngram, tree, pipeline, first):
    """A lookup chain beside the oracle tree (its drafts always wrong with ranks 9, so every
    acceptance is the lookup's; and with no tree at all): tokens equal target-only, iterations,
    acceptances and verified nodes equal the host recompute, lookup acceptances happen, and a
    chain 6 deep (block_size 6) crosses block boundaries."""
    max_tokens = 32
    params = greedy(max_tokens)
    bs = max(DEPTH, lookup)
    target = target_tokens(model, prompts, max_tokens, block_size=bs)
    oracles = [Oracle(out, ((0, 0, 0, 0), (9, 9, 9, 9))[i % 2]) for i, out in enumerate(target)]
    outs = [make_engine(model, TreeProposer(oracle, tree, lookup=lookup, ngram=ngram,
                                            first_drafts=first),
                        spec_pipeline=pipeline, block_size=bs)
            .generate([prompt], params)[0]
            for prompt, oracle in zip(prompts, oracles)]
    assert token_lists(outs) == target
    stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
             for o in outs]
    expected = [expected_stats(oracle, out, max_tokens, tree, prompt, lookup, ngram,
                               first_drafts=first)
                for oracle, out, prompt in zip(oracles, target, prompts)]
    assert stats == expected
    lookup_alone = [expected_stats(oracle, out, max_tokens, [], prompt, lookup, ngram)
                    for oracle, out, prompt in zip(oracles, target, prompts)]
    assert sum(a for _, a, _ in lookup_alone) > 0


def test_one_engine_stages_each_requests_own_history(model, prompts):
    """Requests one after another on one engine (the staged history is kept between programs
    and only extended for the same sequence): every request's lookup drafts come from its own
    tokens, so its iterations and acceptances equal the host recompute."""
    params = greedy(24)
    target = target_tokens(model, prompts, 24)
    oracle = Oracle(target[0], (9, 9, 9, 9))
    llm = make_engine(model, TreeProposer(oracle, [], lookup=4, ngram=1))
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for order in (by_length[::-1], by_length):   # longest prompts first, then shortest
        outs = llm.generate([prompts[i] for i in order], params)
        assert token_lists(outs) == [target[i] for i in order]
        stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
                 for o in outs]
        assert stats == [expected_stats(oracle, target[i], 24, [], prompts[i], 4, 1) for i in order]


@pytest.mark.parametrize("lookup", [0, 2])
def test_candidates_left_by_another_request_are_not_verified(model, prompts, lookup):
    """The device holds the last request's candidates; a new request's first iteration must
    not accept them, even when they happen to be its true continuation: it verifies the root
    alone, or the root and the lookup chain."""
    params = greedy(16)
    first, second = target_tokens(model, prompts[:2], 16)
    oracle = Oracle(second, (0, 0, 0, 0))
    llm = make_engine(model, TreeProposer(oracle, TREE, lookup=lookup))
    llm.generate(prompts[:1], params)
    tree = llm.llm_engine._spec._tree
    tree.cand_in[:, 0] = torch.tensor(second[1: 1 + DEPTH])   # all accepted, were they read
    out = llm.generate(prompts[1:2], greedy(DEPTH + 2))[0]   # read, they would end it at once
    assert token_lists([out]) == [second[:DEPTH + 2]]
    stats = out.outputs[0].spec_stats
    assert (stats["steps"], stats["accepted"], stats["drafted"]) == \
        expected_stats(oracle, second, DEPTH + 2, TREE, prompts[1], lookup)
    assert stats["steps"] > 1


def test_real_heads_with_eos_and_max_tokens_caps(model, prompts):
    """Random heads (mostly wrong drafts), every max_tokens remainder modulo the depth, and an
    EOS that stops a request; the engine serves a plain request afterwards."""
    torch.manual_seed(0)
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    for head in heads.heads:
        torch.nn.init.normal_(head.down.weight, std=0.5)
    plain, tree = make_engine(model), make_engine(model, TreeProposer(heads, TREE))
    ref = target_tokens(model, prompts, 24)
    for max_tokens in (1, 2, 3, 5, 8, 11):   # greedy: target-only's first max_tokens tokens
        assert token_lists(tree.generate(prompts, greedy(max_tokens))) == \
            [out[:max_tokens] for out in ref]
    for prompt, out in zip(prompts, ref):
        eos = out[len(out) // 2]
        params = greedy(24, stop_token_ids=[eos])
        assert token_lists(tree.generate([prompt], params)) == \
            token_lists(plain.generate([prompt], params))
    assert token_lists(tree.generate(prompts, greedy(24))) == ref


@pytest.mark.slow
def test_compiled_program_makes_the_same_iterations(model, prompts):
    """ExecutionConfig.compile: torch.compile'd glue around the rounds (the lookup's drafts and
    the next program's inputs too); the tokens of target-only and the uncompiled
    program's iterations and acceptances, without a lookup chain and with one (in one test:
    the first compile in a process pays inductor's start-up, ~10 s)."""
    target = target_tokens(model, prompts[:2], 16)
    for lookup in (0, 3):
        outs = {}
        for compiled in (False, True):
            proposer = TreeProposer(Oracle(target[0], (0, 1, 0, 0)), TREE, lookup=lookup)
            llm = make_engine(model, proposer, compile=compiled)
            outs[compiled] = llm.generate(prompts[:2], greedy(16))
            assert token_lists(outs[compiled]) == target
            program = llm.llm_engine._spec._tree._programs[True, True, False, None]
            for glue in ("_prepare", "_conclude", "_advance"):
                assert (getattr(program, glue) != getattr(program, glue + "_eager")) == compiled
        assert [o.outputs[0].spec_stats for o in outs[True]] == \
            [o.outputs[0].spec_stats for o in outs[False]], lookup
        assert outs[True][0].outputs[0].spec_stats["accepted"] > 0


@pytest.mark.slow
def test_compiled_programs_past_the_recompile_limit_stay_compiled(model, prompts, monkeypatch):
    """Every program's glue shares two code objects; with dynamo's recompile limit at 1, two
    programs of different shapes must still compile every graph they compile under a limit of
    64 (past the limit dynamo runs the glue eagerly, or raises)."""
    from torch._dynamo.utils import counters
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    heads = LookaheadHeads(model, depth=DEPTH, inner=8)
    graphs = {}
    # the first phase also compiles what a process compiles once: it only warms up
    for phase, limit in (("warm-up", 64), ("low", 1), ("high", 64)):
        monkeypatch.setattr(config, name, limit)
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        for tree in ([(0,)], [(0,), (0, 0)]):
            make_engine(model, TreeProposer(heads, tree), compile=True).generate(
                prompts[:1], greedy(4))
        graphs[phase] = counters["stats"]["unique_graphs"] - before
    assert graphs["low"] == graphs["high"] >= 4   # at least _prepare and _conclude, twice


def test_oracle_eos_inside_an_accepted_path(model, prompts):
    target = target_tokens(model, prompts, 24)
    plain = make_engine(model)
    for prompt, out in zip(prompts, target):
        tree = make_engine(model, TreeProposer(Oracle(out, (0, 0, 0, 0)), TREE))
        params = greedy(24, stop_token_ids=[out[5]])
        assert token_lists(tree.generate([prompt], params)) == \
            token_lists(plain.generate([prompt], params))


def test_requests_beyond_the_graph_go_to_the_generic_verifier(model, prompts):
    """What the tree's device program does not take (log-probs, top-k, T > 0, two requests at
    once) speculates through the generic tree verifier: greedy ones keep target-only's tokens
    and log-probs, and every one counts tree steps; a request below full depth turns
    speculation off, with one warning, and decodes as target-only."""
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    plain = make_engine(model, max_num_seqs=2)
    tree = make_engine(model, TreeProposer(heads, TREE), max_num_seqs=2)
    for params in (greedy(12, logprobs=0), greedy(12, top_k=5)):
        outs, ref = tree.generate(prompts[:1], params), plain.generate(prompts[:1], params)
        assert token_lists(outs) == token_lists(ref)
        assert outs[0].outputs[0].spec_stats["steps"] > 0
    got, want = (torch.tensor(llm.generate(prompts[:1], greedy(12, logprobs=0))[0]
                              .outputs[0].logprobs) for llm in (tree, plain))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    both = tree.generate(prompts[:2], greedy(12))
    assert token_lists(both) == token_lists(plain.generate(prompts[:2], greedy(12)))
    assert all(o.outputs[0].spec_stats["steps"] > 0 for o in both)
    sampled = tree.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=12, seed=3))
    assert len(sampled[0].outputs[0].token_ids) == 12
    assert sampled[0].outputs[0].spec_stats["steps"] > 0
    shallow = SamplingParams(temperature=0.0, max_tokens=12, exit_policy="fixed",
                             exit_policy_args={"depth": 2})
    with pytest.warns(SpeculationOffWarning, match="full depth"):
        outs = tree.generate(prompts[:1], shallow)
    assert token_lists(outs) == token_lists(plain.generate(prompts[:1], shallow))
    assert outs[0].outputs[0].spec_stats is None


def test_private_blocks_are_reserved_once_and_refused_when_short(model, prompts):
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    proposer = TreeProposer(heads, TREE)
    llm = make_engine(model)
    manager = llm.llm_engine.block_manager
    total = manager.num_blocks
    llm.set_proposer(proposer)
    leaves = llm.llm_engine._spec._tree.shape.num_leaves   # the first writes in place
    assert manager.num_blocks == total - 2 * (leaves - 1)
    reserved = [b for b, owners in manager.owner.items() if owners == {RESERVED}]
    assert len(reserved) == 2 * (leaves - 1)
    llm.generate(prompts, greedy(16))
    llm.set_proposer(None)
    llm.set_proposer(proposer)              # the same proposer: its program and blocks again
    assert manager.num_blocks == total - 2 * (leaves - 1)
    assert manager.num_free_blocks == manager.num_blocks
    assert private_blocks(proposer) == private_blocks(TREE) == 2 * (leaves - 1)
    assert private_blocks(TreeProposer(heads, [])) == 0                   # the root's row alone
    assert private_blocks(TreeProposer(heads, TREE, lookup=3)) == 2 * leaves
    short = make_engine(model, num_blocks=20)
    with pytest.raises(ValueError, match="num_blocks >= "):
        short.set_proposer(TreeProposer(heads, TREE))
    assert short.llm_engine.block_manager.num_free_blocks == 20   # nothing taken


def test_bad_proposers_are_refused(model):
    heads = LookaheadHeads(model, depth=2, inner=8)
    with pytest.raises(TypeError, match="lookahead heads"):
        TreeProposer(torch.nn.Linear(2, 2), [(0,)])
    with pytest.raises(ValueError, match="prefix"):
        TreeProposer(heads, [(0,), (1, 0), (0, 0)])
    with pytest.raises(ValueError, match="static decode path"):
        LLM(model, block_size=4, decode_path="gather").set_proposer(TreeProposer(heads, [(0,)]))
    with pytest.raises(ValueError, match="block_size"):
        make_engine(model, block_size=1).set_proposer(TreeProposer(heads, [(0,), (0, 0)]))
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="lookup"):
            TreeProposer(heads, [(0,)], lookup=bad)
    with pytest.raises(ValueError, match="ngram"):
        TreeProposer(heads, [(0,)], lookup=2, ngram=0)
    for bad in (dict(lookup=2, adaptive_lookup=1), dict(adaptive_lookup=True),
                dict(lookup=2, tree=[], adaptive_lookup=True),
                dict(lookup=2, adaptive_lookup="sometimes"), dict(lookup=2, adaptive_lookup=None),
                dict(adaptive_lookup="agree")):
        with pytest.raises(ValueError, match="adaptive_lookup"):
            TreeProposer(heads, **{"tree": [(0,)], **bad})
    for bad in (dict(first_drafts="yes"), dict(tree=[], lookup=2, first_drafts=True)):
        with pytest.raises(ValueError, match="first_drafts"):   # the second: nothing to draft
            TreeProposer(heads, **{"tree": [(0,)], **bad})
    llm = make_engine(model)                       # block_size 4 < the lookup chain's 5
    with pytest.raises(ValueError, match="block_size >= 5"):
        llm.set_proposer(TreeProposer(heads, [(0,)], lookup=5))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_blocks"]


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("gemv_rows", [1, 64])
@pytest.mark.slow
def test_device_program_through_the_triton_kernels(model, prompts, gemv_rows, monkeypatch):
    """The program's per-row block tables and slots fed to the Triton RoPE + K/V write and
    paged attention kernels, interpreted on CPU; with gemv_rows = 64 the tree's rows go through
    the several-row q/k/v + RoPE + K/V-write GEMV and the GEMVs too. A tree of two leaves in 7
    rows (TREE's 34 cost 5x the interpreted programs): the first leaf's rows write in place, the
    second's, 4 deep, on private blocks past a block boundary, and the oracle's drafts are
    accepted along it (a commit)."""
    tree = [(0,), (1,), (0, 1), (0, 1, 0), (0, 1, 0, 0)]
    prompt = prompts[3:]   # 6 tokens: the second program's path crosses into a third block
    target = target_tokens(model, prompt, 7)   # two programs: the root, then 4 accepted
    oracle = Oracle(target[0], (0, 1, 0, 0))
    llm = make_engine(model)
    runner = llm.llm_engine.runner
    runner._static_args = {**runner._static_args, "triton": True, "gemv_rows": gemv_rows}
    runner.static = StaticDecoder(runner.model, max_batch=4, **runner._static_args)
    llm.set_proposer(TreeProposer(oracle, tree))
    rows, rope_kv_linear = [], kernels.rope_kv_linear
    monkeypatch.setattr(kernels, "rope_kv_linear",
                        lambda x, *a, **k: rows.append(x.shape[0]) or rope_kv_linear(x, *a, **k))
    outs = llm.generate(prompt, greedy(7))
    assert token_lists(outs) == target
    assert outs[0].outputs[0].spec_stats["accepted"] == 4   # the path through the second leaf
    shape = TreeShape(tree, "cpu")
    assert (shape.num_rows in rows) == (gemv_rows > 1) and shape.num_leaves == 2
