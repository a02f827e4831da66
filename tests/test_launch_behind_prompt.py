"""ExecutionConfig.launch_behind_prompt: a lone request's first decode launch queued behind its
whole-prompt step, from token 0 still on the device: its first tree program
(TreeGraph.launch_first) or, without a proposer, its first token window
(TokenWindow.launch_first). The same tokens, the same iterations and the same number of
programs or windows as without it; the launch is taken over, never made twice, and dropped
where token 0 ends the request."""
import pytest
import torch

from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import SamplingParams, TreeProposer
from rltlab.engine.spec.tree_graph import TreeGraph
from rltlab.engine.token_window import TokenWindow
from rltlab.engine.spec.tree_program import TreeProgram
from tree_oracle import DEPTH, TREE, Oracle, greedy, make_engine, target_tokens, token_lists, \
    tree_model, tree_prompts

STATS = ("steps", "accepted", "drafted", "emitted")


@pytest.fixture(scope="module")
def model():
    return tree_model()


@pytest.fixture(scope="module")
def prompts():
    return tree_prompts()


@pytest.fixture
def counts(monkeypatch):
    """Calls of TreeProgram.launch, TreeGraph.launch_first and TokenWindow's, counted."""
    counted = {"launch": 0, "launch_first": 0, "window launch_first": 0}

    def counting(owner, name, key):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counted[key] += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)
    counting(TreeProgram, "launch", "launch")
    counting(TreeGraph, "launch_first", "launch_first")
    counting(TokenWindow, "launch_first", "window launch_first")
    return counted


def _run(llm, prompts, params, counts):
    counts.update({key: 0 for key in counts})
    outs = llm.generate(prompts, params)
    stats = [tuple(o.outputs[0].spec_stats[k] for k in STATS) if o.outputs[0].spec_stats
             else None for o in outs]
    return token_lists(outs), stats, dict(counts)


# The oracle's ranks and max_tokens are set per prompt (each runs on its own engines): every
# case runs both rank patterns and both caps (24, and 2: one token after token 0), rather than
# one of each a case.
PER_PROMPT = [((0, 0, 0, 0), 24), ((1, 0, 5, 0), 2), ((1, 0, 5, 0), 24), ((0, 0, 0, 0), 2)]


@pytest.mark.parametrize("pipeline, first", [(1, False), (5, True), (1, True), (3, False)])
@pytest.mark.parametrize("lookup, rule", [(0, False), (3, False), (3, "agree")])
def test_same_tokens_iterations_and_programs(model, prompts, counts, pipeline, first, lookup,
                                             rule):
    """Each prompt with an oracle that knows its output: tokens equal target-only's, and
    spec_stats and program launches equal the engine's without early launches; one early
    launch per request."""
    for prompt, target, (ranks, max_tokens) in zip(prompts, target_tokens(model, prompts, 24),
                                                     PER_PROMPT):
        out = target[:max_tokens]   # greedy: target-only's first max_tokens tokens
        proposer = TreeProposer(Oracle(out, ranks), TREE, lookup=lookup, adaptive_lookup=rule,
                                first_drafts=first)
        runs = [_run(make_engine(model, proposer, spec_pipeline=pipeline,
                                 launch_behind_prompt=early), [prompt], greedy(max_tokens),
                     counts)
                for early in (False, True)]
        (tokens, stats, launched), (early_tokens, early_stats, early_launched) = runs
        assert tokens == early_tokens == [out], (ranks, max_tokens)
        assert early_stats == stats, (ranks, max_tokens)
        assert early_launched["launch"] == launched["launch"] > 0
        assert (launched["launch_first"], early_launched["launch_first"]) == (0, 1)


def test_one_engine_many_requests_with_real_heads(model, prompts, counts):
    """Requests one after another on one engine (candidates, staged history and the adaptive
    rule's state carried between them), untrained heads with first drafts and a lookup chain
    by agreement: the same tokens, statistics and programs."""
    heads = LookaheadHeads(model, DEPTH, 16).eval()
    proposer = TreeProposer(heads, [(0,) * j for j in range(1, DEPTH + 1)], lookup=3,
                            adaptive_lookup="agree", first_drafts=True)
    params = greedy(12)
    batch = prompts + prompts[::-1]
    target = [out[:12] for out in target_tokens(model, prompts, 24)]   # greedy: the first 12
    target += target[::-1]
    off, on = (_run(make_engine(model, proposer, launch_behind_prompt=early), batch, params,
                    counts) for early in (False, True))
    assert off[0] == on[0] == target
    assert on[1] == off[1] and on[2]["launch"] == off[2]["launch"]
    assert on[2]["launch_first"] == len(batch)


def test_a_stop_at_token_0_drops_the_early_program(model, prompts, counts):
    """Token 0 of the second request is a stop token: its early program is launched and
    dropped (one launch more than without), its output is that token alone, and the requests
    after it are still exact."""
    target = [out[:16] for out in target_tokens(model, prompts, 24)]   # greedy: the first 16
    stop = greedy(16, stop_token_ids=[target[1][0]])
    expected = token_lists(make_engine(model).generate(prompts, stop))
    assert expected[1] == [target[1][0]]
    proposer = TreeProposer(Oracle(target[0], (0, 0, 0, 0)), TREE, lookup=3)
    off, on = (_run(make_engine(model, proposer, launch_behind_prompt=early), prompts, stop,
                    counts) for early in (False, True))
    assert off[0] == on[0] == expected
    assert on[1] == off[1]
    assert on[2]["launch"] == off[2]["launch"] + 1 and on[2]["launch_first"] == len(prompts)


def test_no_early_launch_where_nothing_would_take_it(model, prompts, counts):
    """max_tokens = 1 (nothing after token 0), with the tree or without, and a sampled request
    without a tree (token windows launch early for greedy rows only): no early launch, the
    same outputs as without."""
    proposer = TreeProposer(Oracle([1, 2, 3], (0, 0, 0, 0)), TREE)
    sampled = SamplingParams(temperature=0.7, max_tokens=8, exit_policy="fixed", seed=3)
    for params, drafter in ((greedy(1), proposer), (greedy(1), None), (sampled, None)):
        off, on = (_run(make_engine(model, drafter, launch_behind_prompt=early), prompts,
                        params, counts) for early in (False, True))
        assert on[0] == off[0]
        assert on[2]["launch_first"] == on[2]["window launch_first"] == 0


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 0.9)])
def test_sampled_requests_launch_their_first_program_early(model, prompts, counts, top_k,
                                                          top_p):
    """A sampled request's tree program draws its uniforms from (seed, position), so launched
    behind the prompt it emits exactly the tokens it emits launched after it, in as many
    programs; token 0 is drawn once either way."""
    proposer = TreeProposer(Oracle([1, 2, 3], (1, 0, 5, 0)), TREE)
    sampled = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, max_tokens=12,
                             exit_policy="fixed", seed=5)
    off, on = (_run(make_engine(model, proposer, launch_behind_prompt=early), prompts,
                    sampled, counts) for early in (False, True))
    assert on[0] == off[0] and on[1] == off[1]
    assert on[2]["launch"] == off[2]["launch"]
    assert on[2]["launch_first"] == len(prompts) and off[2]["launch_first"] == 0


@pytest.mark.parametrize("depth", [4, 2])
@pytest.mark.parametrize("token_window", [8, 3])
def test_target_only_token_windows(model, prompts, counts, depth, token_window):
    """Without a proposer: the first token window launched behind the prompt step; the same
    tokens and windows (chained and planned ahead alike) as without, one early launch per
    request, at full depth and at a fixed depth of 2; the requests' max_tokens take turns
    (24, 9, 2: windows chained, cut short, and one token after token 0)."""
    params = [greedy(max_tokens, exit_policy_args={"depth": depth})
              for max_tokens in (24, 9, 2, 24, 9, 2, 24, 9)]
    runs = []
    for early in (False, True):
        llm = make_engine(model, token_window=token_window, launch_behind_prompt=early)
        runs.append(_run(llm, prompts + prompts[::-1], params, counts) +
                    (dict(llm.llm_engine._token_window.stats),))
    (tokens, _, launched, windows), (early_tokens, _, early_launched, early_windows) = runs
    assert early_tokens == tokens and early_windows == windows and windows["windows"] > 0
    assert launched["window launch_first"] == 0
    assert early_launched["window launch_first"] == 2 * len(prompts)


def test_target_only_stop_at_token_0_drops_the_early_window(model, prompts, counts):
    """Token 0 of the second request is a stop token: its early window is launched and
    dropped (one window more), and the requests after it are still exact."""
    target = target_tokens(model, prompts, 24)
    stop = greedy(16, stop_token_ids=[target[1][0]])
    (tokens, windows), (early_tokens, early_windows) = (
        (_run(llm, prompts, stop, counts)[0], llm.llm_engine._token_window.stats)
        for llm in (make_engine(model, launch_behind_prompt=early) for early in (False, True)))
    assert early_tokens == tokens and tokens[1] == [target[1][0]]
    assert early_windows["windows"] == windows["windows"] + 1


@pytest.mark.parametrize("tree", [True, False])
def test_a_weight_update_after_the_prompt_step_drops_the_early_launch(model, prompts, counts,
                                                                      tree):
    """The prompt step (with its early launch) runs, then a weight update recomputes the
    sequence at the same position: the launch made under the old weights is dropped, and the
    tokens equal those of the engine without early launches through the same update."""
    other = tree_model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.3)
    runs = []
    for early in (False, True):
        proposer = TreeProposer(Oracle([1, 2, 3], (0, 0, 0, 0)), TREE, lookup=3) if tree \
            else None
        llm = make_engine(model, proposer, launch_behind_prompt=early)
        counts.update({key: 0 for key in counts})
        llm.llm_engine.add_request("r", prompts[1], greedy(12))
        llm.step()                                     # the whole-prompt step
        assert counts["launch_first" if tree else "window launch_first"] == early
        llm.start_weight_update(1)
        llm.update_weights((n, p.detach()) for n, p in other.named_parameters())
        llm.finish_weight_update()
        outs = []
        while llm.has_unfinished_requests():
            outs += llm.step()
        runs.append(list(outs[0].outputs[0].token_ids))
    assert runs[0] == runs[1]


def test_the_setting_must_be_a_bool(model):
    with pytest.raises(ValueError, match="launch_behind_prompt must be a bool"):
        make_engine(model, launch_behind_prompt="yes")


@pytest.mark.slow
def test_bench_pairs_early_launches_in_the_same_run(counts, monkeypatch):
    """python -m rltlab.bench.tree_spec --launch-early: an " early" row beside every engine
    row and a "target only early" baseline, identical tokens, the same tau; its engines
    launched early (4 rows x 2 requests, a warm-up and a repeat; target only's windows too)."""
    from rltlab.bench import tree_spec
    from rltlab.engine.config import EngineConfig
    # target only's engines on the static path (token windows), as "auto" picks on CUDA
    monkeypatch.setattr(EngineConfig, "use_static_decode", lambda self, device: True)
    res = tree_spec.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "8",
                          "--repeats", "1", "--budgets", "--paths", "engine", "--only",
                          "chain K=4", "--lookup", "4", "--adaptive-lookup", "agree",
                          "--first-drafts", "--launch-early"])
    rows = {r["config"]: r for r in res["rows"]}
    engine = [name for name in rows if name.startswith("engine") and not name.endswith(" early")]
    assert len(engine) == 4 and res["launch_early"] is True
    assert rows["target only early"]["identical"] == "2/2"
    assert all("vs_faster" in rows[name] for name in engine)   # target only early beside it
    for name in engine:
        early = rows[name + " early"]
        assert early["identical"] == rows[name]["identical"] == "2/2"
        assert early["tau"] == rows[name]["tau"]
    assert counts["launch_first"] == 4 * 2 * 2
    assert counts["window launch_first"] == 2 * 2
