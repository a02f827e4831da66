"""Tree speculative decoding with lookahead heads (rltlab.model.tree_spec) is lossless at
T = 0: the tokens of plain greedy full-depth decoding, whatever the drafts. An oracle drafter
that knows the reference continuation forces deep and partial acceptances through ranks > 0
(so the tree mask, the acceptance walk and the K/V commit are all exercised); the heads
themselves, the tree helpers and the on-disk format are checked on their own."""
import pytest
import torch

from rltlab.draft_heads import lookahead
from rltlab.draft_heads.lookahead import LookaheadHeads, tree_from_ranks, validate_tree
from rltlab.model.tree_spec import TreeSpecGenerator
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig
from rltlab.model.generate import generate_plain

torch.set_num_threads(1)
VOCAB = 64
# every path of ranks {0, 1} up to depth 3, and rank-0 paths to depth 4
TREE = [p for d in (1, 2, 3) for p in __import__("itertools").product((0, 1), repeat=d)] + [
    (0, 0, 0, 0), (1, 0, 0, 0)]


@pytest.fixture(scope="module")
def model():
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     total_ut_steps=4, max_position_embeddings=512)
    return OuroForCausalLM(cfg).init_weights(0, std=0.3).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 1, 6)]


def _reference(model, prompt, max_tokens, eos=None):
    return generate_plain(model, [prompt], max_tokens, temperature=0.0,
                          eos_token_id=eos).token_ids[0]


class _Oracle(TreeSpecGenerator):
    """Drafts the reference continuation: head k's true token at rank ranks[k - 1] (a rank
    outside the tree makes acceptance stop there), other ranks distinct wrong tokens."""

    def __init__(self, *args, full: list[int], ranks: tuple[int, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.full, self.ranks = full, ranks

    def _draft(self, h_last, bonus, bonus_pos):
        cand = torch.zeros(self.depth, self.max_rank, dtype=torch.long)
        for k in range(1, self.depth + 1):
            q = int(bonus_pos) + k
            true = self.full[q] if q < len(self.full) else 1
            wrong = [t for t in range(VOCAB) if t != true][:self.max_rank]
            row = wrong[:]
            if self.ranks[k - 1] < self.max_rank:
                row[self.ranks[k - 1]] = true
            cand[k - 1] = torch.tensor(row)
        return cand


@pytest.mark.parametrize("ranks,min_tau", [((0, 0, 0, 0), 4.0), ((1, 1, 0, 0), 3.0),
                                           ((0, 1, 5, 0), 2.4), ((3, 0, 0, 0), 1.0)])
def test_oracle_drafts_are_accepted_and_lossless(model, prompts, ranks, min_tau):
    heads = LookaheadHeads(model, depth=4, inner=16)
    for prompt in prompts:
        ref = _reference(model, prompt, 24)
        gen = _Oracle(model, heads, TREE, max_len=64, full=prompt + ref, ranks=ranks)
        out = gen.generate(prompt, 24)
        assert out.token_ids == ref
        # the oracle's tree depth: 4 at ranks (0,0,0,0), 3 for (1,1,0,0) (no (1,1,0,0) path)
        assert out.stats.tau >= min_tau - 1e-9 or out.stats.steps <= 2
        if ranks[0] >= 2:                  # head 1's token is never in the tree
            assert out.stats.accepted == 0


def test_trained_or_not_heads_are_lossless_with_eos_and_caps(model, prompts):
    """Real heads (random, so mostly wrong drafts), an EOS that stops mid-path and
    max_tokens caps of every remainder modulo the tree depth."""
    torch.manual_seed(0)
    heads = LookaheadHeads(model, depth=4, inner=16)
    for head in heads.heads:
        torch.nn.init.normal_(head.down.weight, std=0.5)
    gen = TreeSpecGenerator(model, heads, TREE, max_len=64)
    for prompt in prompts:
        for max_tokens in (1, 2, 5, 11, 24):
            assert gen.generate(prompt, max_tokens).token_ids == \
                _reference(model, prompt, max_tokens)
        ref = _reference(model, prompt, 24)
        eos = ref[len(ref) // 2]
        assert gen.generate(prompt, 24, eos).token_ids == _reference(model, prompt, 24, eos)


def test_oracle_with_eos_inside_an_accepted_path(model, prompts):
    prompt = prompts[1]
    ref = _reference(model, prompt, 24)
    eos = ref[5]
    gen = _Oracle(model, LookaheadHeads(model, 4, 16), TREE, max_len=64,
                  full=prompt + ref, ranks=(0, 0, 0, 0))
    assert gen.generate(prompt, 24, eos).token_ids == _reference(model, prompt, 24, eos)


def test_bad_input_is_refused(model):
    heads = LookaheadHeads(model, depth=2, inner=8)
    with pytest.raises(ValueError, match="prefix"):
        TreeSpecGenerator(model, heads, [(0,), (1, 0), (0, 0)], max_len=32)
    with pytest.raises(ValueError, match="length"):
        TreeSpecGenerator(model, heads, [(0,), (0, 0), (0, 0, 0)], max_len=32)
    gen = TreeSpecGenerator(model, heads, [(0,), (0, 0)], max_len=32)
    with pytest.raises(ValueError, match="max_len"):
        gen.generate([1] * 20, 13)
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate([], 4)
    for max_tokens in (3.5, 2.0, True, 0):           # issue 61.5: 3.5 returned 4 tokens
        with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1"):
            gen.generate([1, 2], max_tokens)
    for prompt, where in (([1, VOCAB], r"prompt\[1\] = 64"), ([-1], r"prompt\[0\] = -1"),
                          ([1, 2.0], r"prompt\[1\] = 2.0"), ([True], r"prompt\[0\] = True")):
        with pytest.raises(ValueError, match=rf"^{where} is not a token id in \[0, vocab_size=64\)"):
            gen.generate(prompt, 4)
    with pytest.raises(ValueError, match="^eos_token_id"):
        gen.generate([1, 2], 4, eos_token_id=VOCAB)
    with pytest.raises(ValueError, match="depth"):
        LookaheadHeads(model, depth=0)


def test_tree_from_ranks_is_prefix_closed_and_takes_frequent_paths():
    g = torch.Generator().manual_seed(0)
    ranks = [torch.randint(0, 3, (50, 4), generator=g) * (torch.rand(50, 4, generator=g) < 0.7)
             for _ in range(6)]
    ranks[0][:5, 2:] = -1                 # past a rollout's end
    for budget in (1, 5, 12, 30):
        tree = tree_from_ranks(ranks, budget)
        assert len(tree) == budget
        assert validate_tree(tree, 4) == tree
    assert tree_from_ranks(ranks, 1) == [(0,)]   # rank 0 is most frequent at every depth


def test_batched_draft_equals_the_heads_one_by_one(model):
    """LookaheadHeads.draft (the engine's batched drafting) computes forward's logits (fp32,
    trained-like random weights: every norm, projection and head differs)."""
    torch.manual_seed(3)
    heads = LookaheadHeads(model, depth=3, inner=24)
    for p in heads.parameters():
        torch.nn.init.normal_(p, mean=0.5 if p.dim() == 1 else 0.0, std=0.3)
    h = torch.randn(6, model.config.hidden_size)
    nxt = torch.randint(0, VOCAB, (6,))
    torch.testing.assert_close(heads.draft(h, nxt), heads(h, nxt), rtol=1e-5, atol=1e-5)


def test_heads_shapes_and_start_as_the_lm_head(model):
    heads = LookaheadHeads(model, depth=3, inner=8)
    h = torch.randn(5, model.config.hidden_size)
    nxt = torch.randint(0, VOCAB, (5,))
    logits = heads(h, nxt)
    assert logits.shape == (5, 3, VOCAB)
    # down is zero-initialised: every head starts as lm_head(h)
    torch.testing.assert_close(logits[:, 1], model.lm_head(h), rtol=0, atol=1e-6)
    assert not any(p is model.lm_head.weight for p in heads.parameters())


def test_save_load_round_trip_and_hash_check(model, tmp_path):
    heads = LookaheadHeads(model, depth=2, inner=8)
    torch.nn.init.normal_(heads.heads[1].down.weight)
    from rltlab.model.checkpoint import model_hash
    lookahead.save(heads, tmp_path / "la", [(0,), (1,), (0, 0)], model_hash(model), {"x": 1})
    loaded, tree, meta = lookahead.load(tmp_path / "la", model)
    assert tree == [(0,), (1,), (0, 0)] and meta["training"] == {"x": 1}
    h, nxt = torch.randn(3, 32), torch.tensor([1, 2, 3])
    torch.testing.assert_close(loaded(h, nxt), heads(h, nxt), rtol=0, atol=0)
    other = OuroForCausalLM(model.config).init_weights(1, std=0.3)
    with pytest.raises(ValueError, match="trained for model"):
        lookahead.load(tmp_path / "la", other)
    with pytest.raises(FileNotFoundError):
        lookahead.load(tmp_path / "missing", model)
    assert not list((tmp_path / "la").glob("*.tmp"))
    # stored in bf16: the file holds bf16, and load gives the model's dtype at those values
    from safetensors.torch import load_file
    lookahead.save(heads, tmp_path / "bf16", [(0,)], model_hash(model), {}, torch.bfloat16)
    assert {t.dtype for t in load_file(str(tmp_path / "bf16" / lookahead.WEIGHTS_FILE))
            .values()} == {torch.bfloat16}
    half, _, _ = lookahead.load(tmp_path / "bf16", model)
    for (name, got), want in zip(half.state_dict().items(), heads.state_dict().values()):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, want.bfloat16().float(), rtol=0, atol=0)


@pytest.mark.slow
def test_bench_on_the_embedded_model_and_its_shipped_heads(tmp_path):
    """The e2e bench on the embedded model with artifacts/.../lookahead_h4, both paths: every
    config gives the target's own tokens, and the shipped heads' tree accepts drafts (tau > 1.3
    where the H200 runs measured ~2.5)."""
    from rltlab.bench import tree_spec
    out = tmp_path / "b.json"
    res = tree_spec.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "8",
                          "--repeats", "1", "--budgets", "--out", str(out)])
    rows = {r["config"]: r for r in res["rows"]}
    trees = ["root only", "chain K=4", "artifact tree B=16"]
    assert set(rows) == {"target only", *trees, *(f"engine {t}" for t in trees)}
    assert all(r["identical"] == "2/2" for r in rows.values()), rows
    for prefix in ("", "engine "):
        assert rows[prefix + trees[0]]["tau"] == 1.0
        assert rows[prefix + trees[2]]["tau"] > 1.3
    assert not res["failed"] and out.is_file()


@pytest.mark.slow
def test_shipped_heads_with_a_lookup_chain_through_load_proposer():
    """lookahead.load_proposer(..., lookup=8, adaptive_lookup=True) on the embedded model: the
    artifact's tree plus 8 lookup nodes, the engine's target-only tokens, and more tokens per
    iteration than the heads alone on the held-out text prompts (whose greedy continuations
    loop)."""
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.engine import LLM, SamplingParams
    from rltlab.engine.spec.tree_graph import private_blocks
    from rltlab.model.checkpoint import load_model
    model, tok, md = load_model(None)
    path = "artifacts/ouro-tiny/draft_heads/lookahead_h4"
    prompts = eval_prompts(tok, md, 4)[2:]                     # the two text prompts
    params = SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed")
    taus, tokens = {}, {}
    for lookup in (0, 8):
        proposer = lookahead.load_proposer(path, model, lookup=lookup, ngram=2,
                                           adaptive_lookup=lookup > 0)
        assert (proposer.lookup, proposer.ngram, proposer.span) == (lookup, 2, max(4, lookup))
        assert proposer.adaptive_lookup == (lookup > 0)
        assert proposer.paths[:len(proposer.tree)] == proposer.tree
        assert len(proposer.paths) == len(proposer.tree) + lookup
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=96,
                  num_blocks=6 + private_blocks(proposer), decode_path="static")
        llm.set_proposer(proposer)
        outs = llm.generate(prompts, params)
        tokens[lookup] = [list(o.outputs[0].token_ids) for o in outs]
        stats = [o.outputs[0].spec_stats for o in outs]
        taus[lookup] = sum(x["emitted"] for x in stats) / sum(x["steps"] for x in stats)
    target = LLM(model, max_num_seqs=1, block_size=16, max_model_len=96).generate(prompts, params)
    assert tokens[0] == tokens[8] == [list(o.outputs[0].token_ids) for o in target]
    assert taus[8] > taus[0] + 0.5, taus


@pytest.mark.slow
def test_bench_keeps_only_the_named_trees_and_adds_a_config_per_gemv_rows_and_lookup():
    """--only, --gemv-rows, --pipelines, --lookup, --adaptive-lookup and --first-drafts rows,
    and --round-step-prompts' target-only row."""
    from rltlab.bench import tree_spec
    res = tree_spec.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "4",
                          "--repeats", "1", "--budgets", "--paths", "engine", "--only",
                          "chain K=4", "--gemv-rows", "1", "4", "--lookup", "0", "3",
                          "--pipelines", "1", "3", "--round-step-prompts",
                          "--adaptive-lookup", "--first-drafts"])
    engine = [f"engine chain K=4{lookup}{first}{pipeline}{gemv}"
              for pipeline in (" P=1", " P=3") for gemv in ("", " gemv<=4")
              for lookup in ("", " +lookup3", " +lookup3 adaptive") for first in ("", " first")]
    assert [r["config"] for r in res["rows"]] == [
        "target only", "target only (round-step prompts)", *engine]
    assert all(r["identical"] == "2/2" for r in res["rows"]) and res["gemv_rows"] == [1, 4]
    assert [r["nodes"] for r in res["rows"]] == [None, None] + [4, 4, 7, 7, 7, 7] * 4
    assert res["pipelines"] == [1, 3]
    for bad in (["--only", "chain K=5"], ["--gemv-rows", "0"], ["--gemv-rows", "65"],
                ["--lookup", "17"], ["--lookup", "2", "--ngram", "0"], ["--pipelines", "0"],
                ["--adaptive-lookup", "never"]):
        with pytest.raises(SystemExit):
            tree_spec.main(["--device", "cpu", "--paths", "engine", *bad])


@pytest.mark.slow
def test_bench_runs_each_named_lookup_rule():
    """--adaptive-lookup hits agree: one row per rule, as TreeProposer(adaptive_lookup=rule);
    the agreement rule's verified nodes are its own (tree_sim's replay of the same rule)."""
    from rltlab.bench import tree_spec, tree_sim
    res = tree_spec.main(["--device", "cpu", "--prompts", "4", "--max-tokens", "16",
                          "--repeats", "1", "--budgets", "--paths", "engine", "--only",
                          "chain K=4", "--lookup", "6", "--adaptive-lookup", "hits", "agree"])
    names = [r["config"] for r in res["rows"]]
    assert names == ["target only", "engine chain K=4 +lookup6",
                     "engine chain K=4 +lookup6 adaptive", "engine chain K=4 +lookup6 agree"]
    assert all(r["identical"] == "4/4" for r in res["rows"])
    assert set(res["host"]) == {"start", "end"} and res["host"]["end"]["dispatch_us"] > 0
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.engine import TreeProposer
    from rltlab.model.checkpoint import load_model
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    heads, _, _ = lookahead.load(tree_spec.HEADS, model)
    rollouts = tree_sim.record(model, heads, eval_prompts(tok, model_dir, 4), 16,
                               model.config.eos_token_id)
    chain = [(0,) * j for j in range(1, 5)]
    for rule, row in (("hits", res["rows"][2]), ("agree", res["rows"][3])):
        proposer = TreeProposer(heads, chain, lookup=6, adaptive_lookup=rule)
        replayed = [tree_sim.replay(r, proposer, 16) for r in rollouts]
        assert row["tau"] == pytest.approx(sum(it.emitted for its in replayed for it in its) /
                                           sum(map(len, replayed)))


@pytest.mark.slow
def test_bench_pairs_other_heads_in_the_same_run(tmp_path):
    """--also-heads: every engine config again with those heads, named after their folder, in
    the same run (lossless too); untrained heads accept fewer drafts than the shipped ones."""
    from rltlab.bench import tree_spec
    from rltlab.model.checkpoint import load_model, model_hash
    embedded, _, _ = load_model(None, dtype="float32", device="cpu")
    _, tree, _ = lookahead.load(tree_spec.HEADS, embedded)
    untrained = tmp_path / "untrained"
    lookahead.save(LookaheadHeads(embedded, 4, 64), untrained, tree, model_hash(embedded), {})
    res = tree_spec.main(["--device", "cpu", "--prompts", "4", "--max-tokens", "12",
                          "--repeats", "1", "--budgets", "--paths", "engine", "--only",
                          "chain K=4", "--also-heads", str(untrained)])
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["target only", "engine chain K=4", "engine chain K=4 heads=untrained"]
    assert all(r["identical"] == "4/4" for r in res["rows"])
    assert rows["engine chain K=4"]["tau"] > \
        rows["engine chain K=4 heads=untrained"]["tau"] + 0.3, res["rows"]
    assert res["also_heads"] == [str(untrained)]
    trained, other = (rows[f"engine chain K=4{label}"] for label in ("", " heads=untrained"))
    want = [a / b for a, b in zip(trained["seconds_all"], other["seconds_all"])]
    assert other["vs_heads"]["median"] == pytest.approx(want[0]) and "vs_heads" not in trained


def test_rollouts_cache_is_reused_only_for_the_same_settings(tmp_path):
    from rltlab.draft_heads.lookahead_train import cached_rollouts
    cache, calls = tmp_path / "sub" / "rollouts.pt", []

    def capture(seed):
        def go():
            calls.append(seed)
            g = torch.Generator().manual_seed(seed)
            return [(torch.randint(1, 50, (n,), generator=g), torch.randn(n, 8, generator=g))
                    for n in (3, 5)]
        return go

    def never():
        raise AssertionError("captured again")

    first = cached_rollouts(str(cache), {"n_text": 2}, capture(1))
    again = cached_rollouts(str(cache), {"n_text": 2}, never)
    assert calls == [1] and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                for a, b in zip(first, again))
    other = cached_rollouts(str(cache), {"n_text": 3}, capture(2))   # settings differ: anew
    assert calls == [1, 2] and not torch.equal(other[0][1], first[0][1])
    assert torch.load(cache)["settings"] == {"n_text": 3}
    assert cached_rollouts(None, {"n_text": 3}, capture(3)) and calls == [1, 2, 3]
    assert sorted(p.name for p in cache.parent.iterdir()) == ["rollouts.pt"]   # no temp files


def test_bench_pairs_against_the_faster_baseline_and_the_primary_heads():
    from rltlab.bench.tree_spec import _pairings
    seconds = {"target only": [2.0, 4.0, 1.0], "target only compiled": [3.0, 3.0, 2.0],
               "engine x": [1.0, 1.0, 0.5], "engine x heads=b": [0.5, 2.0, 1.0]}
    labels = ["", " heads=b"]
    own = _pairings(seconds, "engine x", labels)
    assert own["vs_faster"]["median"] == 2.0 and own["vs_faster"]["mean"] == pytest.approx(7 / 3)
    assert "vs_heads" not in own   # repeat by repeat: min(2, 3) / 1, min(4, 3) / 1, min(1, 2) / .5
    other = _pairings(seconds, "engine x heads=b", labels)
    assert other["vs_heads"]["median"] == 0.5 and other["vs_heads"]["mean"] == pytest.approx(
        (2.0 + 0.5 + 0.5) / 3)   # 1 / 0.5, 1 / 2, 0.5 / 1
    assert other["vs_faster"]["median"] == 1.5
    seconds["target only early"] = [1.0, 1.0, 5.0]   # the fastest of three, repeat by repeat
    assert _pairings(seconds, "engine x", labels)["vs_faster"]["median"] == 1.0
    del seconds["target only compiled"], seconds["target only early"]
    assert "vs_faster" not in _pairings(seconds, "engine x", labels)


@pytest.mark.slow
def test_training_cli_writes_heads_the_generator_loads(tmp_path):
    """python -m rltlab.draft_heads.lookahead_train, tiny: rollouts of the embedded model,
    a few steps, a tree of the asked size; the saved heads load and decode losslessly, and
    head 1 predicts held-out continuations better than untrained heads."""
    from rltlab.draft_heads import lookahead_train
    from rltlab.model.checkpoint import load_model
    out = tmp_path / "heads"
    record = lookahead_train.main(["--device", "cpu", "--out", str(out), "--n-arith", "10",
                                   "--n-text", "20", "--steps", "60", "--batch", "128",
                                   "--inner", "64", "--budget", "6", "--lr", "3e-3",
                                   "--rollout-batch", "7", "--rollouts-cache",
                                   str(tmp_path / "rollouts.pt")])
    assert (tmp_path / "rollouts.pt").is_file()
    with pytest.raises(SystemExit):
        lookahead_train.main(["--device", "cpu", "--out", str(tmp_path / "bad"),
                              "--rollout-batch", "0"])
    assert not (tmp_path / "bad").exists()
    model, tok, md = load_model(None)
    heads, tree, meta = lookahead.load(out, model)
    assert len(tree) == 6 and meta["training"]["steps"] == 60
    assert meta["training"] == record   # the returned record is the one saved with the heads
    assert meta["training"]["calibration_rollouts"] == 3
    from rltlab.draft_heads.evaluate import eval_prompts
    prompts = eval_prompts(tok, md, 8)
    rollouts = lookahead_train.capture_rollouts(model, prompts, 12, 4, eos=0)
    for (y, h), ref in zip(rollouts, generate_plain(model, prompts, 12, eos_token_id=0)
                           .token_ids):
        assert y.tolist() == ref and h.shape == (len(y), model.config.hidden_size)
    ranks = torch.cat(lookahead_train.true_ranks(heads, rollouts, "cpu"))
    base = torch.cat(lookahead_train.true_ranks(LookaheadHeads(model, 4, 64), rollouts, "cpu"))
    assert ranks.shape[1] == 4 and (ranks[:, 0] == -1).sum() == len(rollouts)
    # positions in chunks that straddle rollouts: each rollout's ranks as on its own
    chunked = lookahead_train.true_ranks(heads, rollouts, "cpu", chunk=5)
    alone = [lookahead_train.true_ranks(heads, [r], "cpu")[0] for r in rollouts]
    assert [r.shape[0] for r in chunked] == [len(y) for y, _ in rollouts]
    assert all(torch.equal(a, b) for a, b in zip(chunked, alone))
    # head 1 on held-out prompts: trained top-1 hits beat the untrained head's (lm_head on h)
    assert (ranks[:, 0] == 0).sum() > (base[:, 0] == 0).sum()
    gen = TreeSpecGenerator(model, heads, tree, max_len=64)
    prompt = [0, 5, 6, 7]
    assert gen.generate(prompt, 16, 0).token_ids == \
        generate_plain(model, [prompt], 16, eos_token_id=0).token_ids[0]
