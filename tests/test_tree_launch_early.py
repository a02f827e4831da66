"""EngineConfig.spec_launch_early: a lone request's first tree program launched behind its
whole-prompt step, from token 0 still on the device (TreeGraph.launch_first). The same tokens,
the same iterations and the same number of programs as without it; the program is taken over,
never launched twice, and dropped where token 0 ends the request."""
import pytest

from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import SamplingParams, TreeProposer
from rltlab.engine.tree_graph import TreeGraph
from rltlab.engine.tree_program import TreeProgram
from tree_oracle import DEPTH, TREE, Oracle, greedy, make_engine, token_lists, tree_model, \
    tree_prompts

STATS = ("steps", "accepted", "drafted", "emitted")


@pytest.fixture(scope="module")
def model():
    return tree_model()


@pytest.fixture(scope="module")
def prompts():
    return tree_prompts()


@pytest.fixture
def counts(monkeypatch):
    """Calls of TreeProgram.launch and TreeGraph.launch_first, counted."""
    counted = {"launch": 0, "launch_first": 0}

    def counting(owner, name):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counted[name] += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)
    counting(TreeProgram, "launch")
    counting(TreeGraph, "launch_first")
    return counted


def _run(llm, prompts, params, counts):
    counts.update(launch=0, launch_first=0)
    outs = llm.generate(prompts, params)
    stats = [tuple(o.outputs[0].spec_stats[k] for k in STATS) if o.outputs[0].spec_stats
             else None for o in outs]
    return token_lists(outs), stats, dict(counts)


@pytest.mark.parametrize("ranks", [(0, 0, 0, 0), (1, 0, 5, 0)])
@pytest.mark.parametrize("chain, pipeline, first", [(1, 1, False), (1, 5, True), (3, 1, True),
                                                    (2, 3, False)])
@pytest.mark.parametrize("lookup, rule", [(0, False), (3, False), (3, "agree")])
@pytest.mark.parametrize("max_tokens", [24, 2])
def test_same_tokens_iterations_and_programs(model, prompts, counts, ranks, chain, pipeline,
                                             first, lookup, rule, max_tokens):
    """Each prompt with an oracle that knows its output: tokens equal target-only's, and
    spec_stats and program launches equal the engine's without early launches; one early
    launch per request."""
    params = greedy(max_tokens)
    target = token_lists(make_engine(model).generate(prompts, params))
    for prompt, out in zip(prompts, target):
        proposer = TreeProposer(Oracle(out, ranks), TREE, lookup=lookup, adaptive_lookup=rule,
                                first_drafts=first)
        runs = [_run(make_engine(model, proposer, spec_chain=chain, spec_pipeline=pipeline,
                                 spec_launch_early=early), [prompt], params, counts)
                for early in (False, True)]
        (tokens, stats, launched), (early_tokens, early_stats, early_launched) = runs
        assert tokens == early_tokens == [out]
        assert early_stats == stats
        assert early_launched["launch"] == launched["launch"] > 0
        assert (launched["launch_first"], early_launched["launch_first"]) == (0, 1)


def test_one_engine_many_requests_with_real_heads(model, prompts, counts):
    """Requests one after another on one engine (candidates, staged history and the adaptive
    rule's state carried between them), untrained heads with first drafts and a lookup chain
    by agreement: the same tokens, statistics and programs."""
    heads = LookaheadHeads(model, DEPTH, 16).eval()
    proposer = TreeProposer(heads, [(0,) * j for j in range(1, DEPTH + 1)], lookup=3,
                            adaptive_lookup="agree", first_drafts=True)
    params = greedy(20)
    batch = prompts + prompts[::-1]
    target = token_lists(make_engine(model).generate(batch, params))
    off, on = (_run(make_engine(model, proposer, spec_launch_early=early), batch, params,
                    counts) for early in (False, True))
    assert off[0] == on[0] == target
    assert on[1] == off[1] and on[2]["launch"] == off[2]["launch"]
    assert on[2]["launch_first"] == len(batch)


def test_a_stop_at_token_0_drops_the_early_program(model, prompts, counts):
    """Token 0 of the second request is a stop token: its early program is launched and
    dropped (one launch more than without), its output is that token alone, and the requests
    after it are still exact."""
    params = greedy(16)
    target = token_lists(make_engine(model).generate(prompts, params))
    stop = greedy(16, stop_token_ids=[target[1][0]])
    expected = token_lists(make_engine(model).generate(prompts, stop))
    assert expected[1] == [target[1][0]]
    proposer = TreeProposer(Oracle(target[0], (0, 0, 0, 0)), TREE, lookup=3)
    off, on = (_run(make_engine(model, proposer, spec_launch_early=early), prompts, stop,
                    counts) for early in (False, True))
    assert off[0] == on[0] == expected
    assert on[1] == off[1]
    assert on[2]["launch"] == off[2]["launch"] + 1 and on[2]["launch_first"] == len(prompts)


def test_no_early_launch_where_the_tree_would_not_take_the_request(model, prompts, counts):
    """max_tokens = 1 (nothing after token 0), a sampled request (the tree takes greedy ones
    only): no early launch, the same outputs as without."""
    proposer = TreeProposer(Oracle([1, 2, 3], (0, 0, 0, 0)), TREE)
    sampled = SamplingParams(temperature=0.7, max_tokens=8, exit_policy="fixed", seed=3)
    for params in (greedy(1), sampled):
        off, on = (_run(make_engine(model, proposer, spec_launch_early=early), prompts, params,
                        counts) for early in (False, True))
        assert on[0] == off[0] and on[2]["launch_first"] == 0


def test_the_setting_must_be_a_bool(model):
    with pytest.raises(ValueError, match="spec_launch_early must be a bool"):
        make_engine(model, spec_launch_early="yes")


def test_bench_pairs_early_launches_in_the_same_run(counts):
    """python -m rltlab.bench.tree_spec --launch-early: an " early" row beside every engine
    row, identical tokens, the same tau; its engines launched early (4 rows x 4 requests, a
    warm-up and a repeat)."""
    from rltlab.bench import tree_spec
    res = tree_spec.main(["--device", "cpu", "--prompts", "4", "--max-tokens", "12",
                          "--repeats", "1", "--budgets", "--paths", "engine", "--only",
                          "chain K=4", "--lookup", "4", "--adaptive-lookup", "agree",
                          "--first-drafts", "--launch-early"])
    rows = {r["config"]: r for r in res["rows"]}
    engine = [name for name in rows if name.startswith("engine") and not name.endswith(" early")]
    assert len(engine) == 4 and res["launch_early"] is True
    for name in engine:
        early = rows[name + " early"]
        assert early["identical"] == rows[name]["identical"] == "4/4"
        assert early["tau"] == rows[name]["tau"]
    assert counts["launch_first"] == 4 * 4 * 2
