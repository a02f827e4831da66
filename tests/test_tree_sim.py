"""rltlab.bench.tree_sim replays TreeProposers on recorded greedy rollouts: for every request,
the engine's own spec_stats (iterations, nodes verified, tokens emitted) and tokens, with oracle
heads on a tiny random model (deep and partial acceptances, lookup hits, caps from max_tokens,
each adaptive rule, first drafts) and with the shipped heads on the embedded model; the cost
model's arithmetic; the CLI."""
import pytest

from rltlab.bench import tree_sim
from rltlab.engine import TreeProposer
from tree_oracle import DEPTH, TREE, Oracle, greedy, make_engine, target_tokens, tree_model, \
    tree_prompts

STATS = ("steps", "drafted", "emitted")


@pytest.fixture(scope="module")
def model():
    return tree_model()


# The oracle's ranks and max_tokens are set per prompt (each is recorded and run on its own):
# every case replays both rank patterns and both caps, rather than one of each a case.
PER_PROMPT = [((0, 0, 0, 0), 32), ((1, 0, 2, 0), 13), ((1, 0, 2, 0), 32), ((0, 0, 0, 0), 13)]


@pytest.mark.parametrize("lookup, rule, first", [(0, False, False), (0, False, True),
                                                 (6, False, False), (6, True, False),
                                                 (4, "agree", False), (6, "agree", True)])
def test_replay_gives_the_engines_spec_stats(model, lookup, rule, first):
    block = max(DEPTH, lookup)
    prompts = tree_prompts()
    decisions = set()
    for prompt, full, (ranks, max_tokens) in zip(prompts, target_tokens(model, prompts, 32,
                                                                        block_size=block),
                                                 PER_PROMPT):
        out = full[:max_tokens]   # greedy: the target's first max_tokens tokens
        oracle = Oracle(out, ranks)
        proposer = TreeProposer(oracle, TREE, lookup=lookup, adaptive_lookup=rule,
                                first_drafts=first)
        engine = make_engine(model, proposer, block_size=block).generate(
            [prompt], greedy(max_tokens))[0]
        rollout, = tree_sim.record(model, oracle, [prompt], max_tokens,
                                   model.config.eos_token_id)
        assert rollout.tokens[:rollout.end] == list(engine.outputs[0].token_ids) == out
        iterations = tree_sim.replay(rollout, proposer, max_tokens)
        assert tree_sim.spec_stats(iterations) == \
            {k: engine.outputs[0].spec_stats[k] for k in STATS}, (ranks, max_tokens)
        decisions |= {it.lookup for it in iterations[1:]}
    if rule:   # the adaptive rule both ran and skipped the lookup chain somewhere
        assert decisions == {True, False}


@pytest.mark.slow
def test_replay_gives_the_engines_spec_stats_with_the_shipped_heads():
    """The embedded model, its lookahead heads and four held-out prompts (two arithmetic, two
    text): chain K = 4 with lookup 10 by the agreement rule and first drafts, the artifact's
    tree with lookup by hits."""
    from rltlab.bench.tree_spec import HEADS
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.model.checkpoint import load_model
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    heads, tree, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, model_dir, 4)
    rollouts = tree_sim.record(model, heads, prompts, 24, model.config.eos_token_id)
    chain = [(0,) * j for j in range(1, 5)]
    for proposer in (TreeProposer(heads, chain, lookup=10, adaptive_lookup="agree",
                                  first_drafts=True),
                     TreeProposer(heads, tree, lookup=10, adaptive_lookup=True)):
        assert tree_sim.verify(model, proposer, rollouts, 24) == len(prompts)


def test_cost_model_arithmetic():
    cost = tree_sim.CostModel(program_at_5=0.4, program_at_16=0.62, target_token=0.4,
                              prompt_step=1.0)
    assert cost.program_ms(5) == pytest.approx(0.4)
    assert cost.program_ms(16) == pytest.approx(0.62)
    assert cost.program_ms(27) == pytest.approx(0.84)      # extrapolated: 0.02 ms a row
    rollouts = [tree_sim.Rollout([1], [5] * 9, 9, [], []), tree_sim.Rollout([1], [5] * 9, 3, [],
                                                                            [])]
    its = [[tree_sim.Iteration(5, 4, 4, False), tree_sim.Iteration(16, 14, 4, True)],
           [tree_sim.Iteration(5, 0, 2, False)]]
    # target: 2 prompt steps + (8 + 2) tokens; tree: 2 prompt steps + 0.4 + 0.62 + 0.4
    assert cost.ratio(its, rollouts) == pytest.approx((2 + 10 * 0.4) / (2 + 1.42))


def test_cli_prints_every_proposer_and_refuses_bad_input(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the shipped heads are found from any working directory
    result = tree_sim.main(["--prompts", "2", "--max-tokens", "8", "--lookup", "4"])
    assert len(result["configs"]) == 16   # 12 proposers, 2 oracle bounds, 2 decided late
    for row in result["configs"].values():
        assert 1 <= row["tau"] <= 8 and row["programs"] >= 2 and row["model_ratio"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
    with pytest.raises(SystemExit):
        tree_sim.main(["--lookup", "0"])


def test_oracle_rule_takes_always_on_iterations_on_fewer_rows(model):
    """rule="oracle" emits exactly what the chain verified in every iteration emits (it runs
    the lookup rows only where they win), on no more rows, and no adaptive rule beats its tau;
    bad replay arguments are refused."""
    prompts, max_tokens = tree_prompts(), 32
    target = target_tokens(model, prompts, 32, block_size=6)
    for prompt, out in zip(prompts, target):
        oracle = Oracle(out, (1, 0, 2, 0))
        rollout, = tree_sim.record(model, oracle, [prompt], max_tokens,
                                   model.config.eos_token_id)
        always = tree_sim.replay(rollout, TreeProposer(oracle, TREE, lookup=6), max_tokens)
        bound = tree_sim.replay(rollout, TreeProposer(oracle, TREE, lookup=6), max_tokens,
                                rule="oracle")
        assert [it.emitted for it in bound] == [it.emitted for it in always]
        assert sum(it.rows for it in bound) <= sum(it.rows for it in always)
        for rule in (True, "agree"):
            ruled = tree_sim.replay(rollout, TreeProposer(oracle, TREE, lookup=6,
                                                          adaptive_lookup=rule), max_tokens)
            assert len(ruled) >= len(bound)
    with pytest.raises(ValueError):
        tree_sim.replay(rollout, TreeProposer(oracle, TREE, lookup=6), max_tokens, rule="x")


def test_late_rule_takes_the_last_programs_decision(model, monkeypatch):
    """rule="late" (launching each program before the last one is read back): programs 0 and
    1 verify the lookup chain, program j >= 2 does where the rule held at program j - 1's
    root; the engine's rule (None) uses each root's own."""
    prompts, max_tokens = tree_prompts(), 32
    target = target_tokens(model, prompts, 32, block_size=6)
    held = []
    rule_holds = tree_sim._rule_holds
    monkeypatch.setattr(tree_sim, "_rule_holds", lambda *a: held.append(rule_holds(*a)) or
                        held[-1])
    lates = 0
    for prompt, out in zip(prompts, target):
        oracle = Oracle(out, (1, 0, 2, 0))
        rollout, = tree_sim.record(model, oracle, [prompt], max_tokens,
                                   model.config.eos_token_id)
        proposer = TreeProposer(oracle, TREE, lookup=6, adaptive_lookup="agree")
        for rule in (None, "late"):
            held.clear()
            its = tree_sim.replay(rollout, proposer, max_tokens, rule=rule)
            assert len(held) == len(its) >= 3
            expected = [True] + held[1:] if rule is None else [True, True] + held[1:-1]
            assert [it.lookup for it in its] == expected
            lates += rule == "late" and expected != [True] + held[1:]
    assert lates   # the late decisions differed from the roots' own somewhere


def test_cli_replays_a_prompts_file_of_texts_and_ids(tmp_path, capsys):
    """--prompts-file: texts get the tokenizer's special tokens (the embedded model's bos), as
    the engine's text prompts do; id lists are taken as they are; bad files are refused."""
    from rltlab.engine.tokenize import encode_prompt
    from rltlab.model.checkpoint import load_model
    _, tok, _ = load_model(None)
    text = "def add(a, b):\n    return"
    path = tmp_path / "prompts.json"
    path.write_text(__import__("json").dumps([text, [0, 5, 9, 17], "x = 1"]))
    assert tree_sim.file_prompts(str(path), tok, 1024, 2) == [encode_prompt(tok, text),
                                                                [0, 5, 9, 17]]
    assert encode_prompt(tok, text)[0] == 0    # the bos the embedded tokenizer adds
    result = tree_sim.main(["--prompts-file", str(path), "--prompts", "2", "--max-tokens", "6",
                            "--lookup", "4"])
    assert result["prompts"] == 2 and result["split"] == f"file {path}"
    assert all(1 <= row["tau"] <= 6 for row in result["configs"].values())
    for bad in ("[]", "{\"a\": 1}", "[[0, 2000]]", "[[]]", "[3.5]", "not json"):
        path.write_text(bad)
        with pytest.raises(SystemExit):
            tree_sim.main(["--prompts-file", str(path)])
    assert "prompts.json" in capsys.readouterr().err


def test_cli_cache_reuses_a_recording_and_refuses_one_of_other_inputs(tmp_path, monkeypatch):
    cache = tmp_path / "rollouts.pt"
    argv = ["--prompts", "2", "--max-tokens", "6", "--lookup", "4", "--cache", str(cache)]
    first = tree_sim.main(argv)
    saved = cache.read_bytes()

    def no_recording(*args, **kwargs):
        raise AssertionError("recorded again although the cache holds these rollouts")
    monkeypatch.setattr(tree_sim, "record", no_recording)
    assert tree_sim.main(argv)["configs"] == first["configs"]
    for other in (["--max-tokens", "7"], ["--split", "train"]):
        with pytest.raises(SystemExit):
            tree_sim.main(argv + other)
    assert cache.read_bytes() == saved            # refused, untouched
    cache.write_bytes(b"not a recording")
    with pytest.raises(SystemExit):
        tree_sim.main(argv)
