"""Tree speculative decoding inside the paged engine (rltlab.engine.tree_graph) is lossless at
T = 0: the engine's own target-only tokens, whatever the drafts. An oracle drafter that knows
the reference continuation forces deep and partial acceptances through ranks > 0, with a block
size equal to the tree depth so that paths cross block boundaries (both private blocks, the
prefix copy and the commit are exercised); real heads, EOS, max_tokens caps, ineligible
requests, the block accounting and bad input are checked too. A prompt-lookup chain beside the
tree (TreeProposer(lookup=L)) is held to the same host recompute, the lookup's drafts from
rltlab.engine.prompt_lookup's rule."""
import itertools

import pytest
import torch

import rltlab.kernels as kernels
from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.block_manager import RESERVED
from rltlab.engine.prompt_lookup import prompt_lookup_ref
from rltlab.engine.static_decode import StaticDecoder
from rltlab.engine.tree_graph import TreeShape, private_blocks
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

torch.set_num_threads(1)
VOCAB, DEPTH = 64, 4
TREE = [p for d in (1, 2, 3) for p in itertools.product((0, 1), repeat=d)] + [
    (0, 0, 0, 0), (1, 0, 0, 0)]
ENGINE = dict(block_size=DEPTH, decode_path="static", max_num_seqs=1, num_blocks=96,
              max_model_len=64)


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


def _greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, exit_policy="fixed", **kw)


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


class _Oracle(torch.nn.Module):
    """Lookahead 'heads' that know the reference output: after token x (the bonus), head k puts
    the token that followed x k + 1 places later at rank ranks[k - 1] and distinct wrong tokens
    around it (a table lookup, so it runs inside the device program). A token the output
    continues in two ways keeps its first continuation."""

    depth = DEPTH

    def __init__(self, output: list[int], ranks: tuple[int, ...]):
        super().__init__()
        table = torch.zeros(VOCAB, DEPTH, VOCAB)
        seen = set()
        for q, x in enumerate(output):
            if x not in seen:
                seen.add(x)
                for k in range(DEPTH):
                    true = output[q + k + 1] if q + k + 1 < len(output) else 1
                    order = [t for t in range(VOCAB) if t != true]
                    order.insert(ranks[k], true)
                    table[x, k, order] = -torch.arange(VOCAB, dtype=torch.float32)
        self.register_buffer("table", table)

    def forward(self, h, next_token):
        return self.table[next_token] + 0 * h[:, :1, None]


def _engine(model, proposer=None, **kw):
    llm = LLM(model, **{**ENGINE, **kw})
    if proposer is not None:
        llm.set_proposer(proposer)
    return llm


def _expected(oracle: _Oracle, output: list[int], max_tokens: int, tree=TREE, prompt=(),
              lookup: int = 0, ngram: int = 3, adaptive: bool = False, chain: int = 1,
              first_drafts: bool = False) -> tuple[int, int, int]:
    """(iterations, accepted drafts, nodes verified) by the tree's acceptance rule, recomputed
    on the host: the pending token output[i] verifies the drafts the oracle made after it (the
    nodes no deeper than the cap: the tokens still to emit, less one; 0 in the first iteration,
    which has no drafts unless a lookup chain supplies them), and a draft at depth j is
    accepted while the ranks of output[i + 1..i + j] form a tree path, or while the lookup
    chain's drafts from prompt + output[:i + 1] match output[i + 1..i + j]. adaptive: the
    lookup chain is verified in the first iteration and after one whose lookup drafts began
    with the first token it emitted, decided once per program of `chain` iterations.
    first_drafts: the first iteration verifies the oracle's drafts after token 0 too."""
    tree, i, steps, accepted, verified = set(tree), 0, 0, 0, 0
    drafted = first_drafts and bool(tree)
    hit = True
    while max_tokens - (i + 1) > 0:
        cap = min(max(DEPTH, lookup), max_tokens - (i + 1) - 1) if drafted or lookup else 0
        if steps % chain == 0:
            with_lookup = not adaptive or steps == 0 or hit
        verified += sum(len(p) <= cap for p in tree) * drafted + min(lookup, cap) * with_lookup
        path = ()
        for j in range(1, min(cap, DEPTH) + 1) if drafted else ():
            row = oracle.table[output[i], j - 1]
            rank = int((row > row[output[i + j]]).sum())
            if path + (rank,) not in tree:
                break
            path += (rank,)
        drafts = prompt_lookup_ref(list(prompt) + output[:i + 1], lookup, ngram)
        found = next((j for j in range(min(lookup, cap)) if drafts[j] != output[i + 1 + j]),
                     min(lookup, cap)) if with_lookup else 0
        n = max(len(path), found)
        hit = bool(drafts) and drafts[0] == output[i + 1]
        steps, accepted, i, drafted = steps + 1, accepted + n, i + n + 1, True
    return steps, accepted, verified


@pytest.mark.parametrize("ranks", [(0, 0, 0, 0), (1, 1, 0, 0), (0, 1, 5, 0), (3, 0, 0, 0)])
@pytest.mark.parametrize("chain, pipeline, first", [(1, 1, False), (3, 1, False), (1, 5, False),
                                                    (1, 5, True), (3, 1, True)])
@pytest.mark.parametrize("max_tokens", [24, 13])
def test_oracle_drafts_are_accepted_and_lossless(model, prompts, ranks, chain, pipeline, first,
                                                 max_tokens):
    """Tokens equal target-only, and every sequence's iterations and accepted drafts equal
    the host recompute of the acceptance rule (chained in one program, or in programs
    launched one after another from the device's state: spec_pipeline; first: the first
    iteration drafted from token 0's state, TreeProposer(first_drafts=True))."""
    params = _greedy(max_tokens)
    target = _tokens(_engine(model).generate(prompts, params))
    oracles = [_Oracle(out, ranks) for out in target]
    outs = [_engine(model, TreeProposer(oracle, TREE, first_drafts=first), spec_chain=chain,
                    spec_pipeline=pipeline)
            .generate([prompt], params)[0] for prompt, oracle in zip(prompts, oracles)]
    assert _tokens(outs) == target
    stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
             for o in outs]
    assert stats == [_expected(oracle, out, max_tokens, first_drafts=first)
                     for oracle, out in zip(oracles, target)]
    if ranks == (0, 0, 0, 0):              # deep acceptances happen
        assert sum(a for _, a, _ in stats) >= sum(s for s, _, _ in stats)


@pytest.mark.parametrize("lookup, ngram, tree", [(3, 2, TREE), (6, 3, TREE), (4, 1, [])])
@pytest.mark.parametrize("ranks", [(0, 0, 0, 0), (9, 9, 9, 9)])
@pytest.mark.parametrize("chain, pipeline, first", [(1, 1, False), (3, 1, False), (1, 5, False),
                                                    (2, 3, False), (1, 5, True)])
def test_lookup_chain_beside_the_tree_is_lossless_and_follows_the_rule(
        model, prompts, lookup, ngram, tree, ranks, chain, pipeline, first):
    """A lookup chain beside the oracle tree (its drafts always wrong with ranks 9, so every
    acceptance is the lookup's; and with no tree at all): tokens equal target-only, iterations,
    acceptances and verified nodes equal the host recompute, lookup acceptances happen, and a
    chain 6 deep (block_size 6) crosses block boundaries."""
    max_tokens = 32
    params = _greedy(max_tokens)
    bs = max(DEPTH, lookup)
    target = _tokens(_engine(model, block_size=bs).generate(prompts, params))
    oracles = [_Oracle(out, ranks) for out in target]
    outs = [_engine(model, TreeProposer(oracle, tree, lookup=lookup, ngram=ngram,
                                        first_drafts=first),
                    spec_chain=chain, spec_pipeline=pipeline, block_size=bs)
            .generate([prompt], params)[0]
            for prompt, oracle in zip(prompts, oracles)]
    assert _tokens(outs) == target
    stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
             for o in outs]
    expected = [_expected(oracle, out, max_tokens, tree, prompt, lookup, ngram,
                          first_drafts=first)
                for oracle, out, prompt in zip(oracles, target, prompts)]
    assert stats == expected
    lookup_alone = [_expected(oracle, out, max_tokens, [], prompt, lookup, ngram)
                    for oracle, out, prompt in zip(oracles, target, prompts)]
    assert sum(a for _, a, _ in lookup_alone) > 0


@pytest.mark.parametrize("lookup, ngram", [(3, 2), (6, 3)])
@pytest.mark.parametrize("ranks", [(0, 0, 0, 0), (1, 0, 0, 0), (9, 9, 9, 9)])
@pytest.mark.parametrize("chain, pipeline, first", [(1, 1, False), (1, 5, False), (2, 3, False),
                                                    (1, 5, True)])
def test_adaptive_lookup_verifies_the_lookup_rows_after_a_hit(model, prompts, lookup, ngram,
                                                             ranks, chain, pipeline, first,
                                                             monkeypatch):
    """TreeProposer(adaptive_lookup=True): tokens equal target-only, iterations, acceptances
    and verified nodes equal the host recompute of the rule (the lookup chain verified in a
    request's first iteration and after a lookup hit), programs without the lookup rows run
    where the recompute says, and they never read the rows they skip (made NaN)."""
    from rltlab.engine.tree_program import TreeProgram
    max_tokens, bs = 32, max(DEPTH, lookup)
    params = _greedy(max_tokens)
    target = _tokens(_engine(model, block_size=bs).generate(prompts, params))
    oracles = [_Oracle(out, ranks) for out in target]
    without, launch = [0], TreeProgram.launch

    def launch_poisoned(program):
        if not program.lookup_rows:
            without[0] += 1
            program.static.hidden_out[program.rows:].fill_(float("nan"))
        launch(program)
    monkeypatch.setattr(TreeProgram, "launch", launch_poisoned)
    outs = [_engine(model, TreeProposer(oracle, TREE, lookup=lookup, ngram=ngram,
                                        adaptive_lookup=True, first_drafts=first),
                    spec_chain=chain, spec_pipeline=pipeline, block_size=bs)
            .generate([prompt], params)[0] for prompt, oracle in zip(prompts, oracles)]
    assert _tokens(outs) == target
    stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
             for o in outs]
    assert stats == [_expected(oracle, out, max_tokens, TREE, prompt, lookup, ngram, True, chain,
                               first)
                     for oracle, out, prompt in zip(oracles, target, prompts)]
    always = [_expected(oracle, out, max_tokens, TREE, prompt, lookup, ngram,
                        first_drafts=first)
              for oracle, out, prompt in zip(oracles, target, prompts)]
    assert (without[0] > 0) == (stats != always)   # skipping the rows changed what ran


def test_first_drafts_come_from_the_state_that_sampled_token_0(model, prompts, monkeypatch):
    """TreeProposer(first_drafts=True) with real heads: a request's first program drafts once
    from tree.first_hidden, which holds h_R of the prompt's last position (the reference
    model's final state there, fp32, 1e-5) and the pending token 0; tokens stay
    target-only's."""
    from rltlab.engine.tree_program import TreeProgram
    torch.manual_seed(0)
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    seen, draft = [], TreeProgram._draft_eager

    def spy(program, h, token):
        if h is program.tree.first_hidden:
            seen.append((h.clone(), token.clone()))
        return draft(program, h, token)
    monkeypatch.setattr(TreeProgram, "_draft_eager", spy)
    target = _tokens(_engine(model).generate(prompts, _greedy(12)))
    tree = _engine(model, TreeProposer(heads, TREE, lookup=3, first_drafts=True))
    for prompt, out in zip(prompts, target):
        seen.clear()
        assert _tokens(tree.generate([prompt], _greedy(12))) == [out]
        assert len(seen) == 1
        with torch.no_grad():
            final = model(torch.tensor([prompt])).final_hidden[0, -1]
        torch.testing.assert_close(seen[0][0][0], final, atol=1e-5, rtol=1e-5)
        assert seen[0][1].tolist() == [out[0]]


def test_one_engine_stages_each_requests_own_history(model, prompts):
    """Requests one after another on one engine (the staged history is kept between programs
    and only extended for the same sequence): every request's lookup drafts come from its own
    tokens, so its iterations and acceptances equal the host recompute."""
    params = _greedy(24)
    target = _tokens(_engine(model).generate(prompts, params))
    oracle = _Oracle(target[0], (9, 9, 9, 9))
    llm = _engine(model, TreeProposer(oracle, [], lookup=4, ngram=1), spec_chain=2)
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for order in (by_length[::-1], by_length):   # longest prompts first, then shortest
        outs = llm.generate([prompts[i] for i in order], params)
        assert _tokens(outs) == [target[i] for i in order]
        stats = [tuple(o.outputs[0].spec_stats[k] for k in ("steps", "accepted", "drafted"))
                 for o in outs]
        assert stats == [_expected(oracle, target[i], 24, [], prompts[i], 4, 1) for i in order]


@pytest.mark.parametrize("lookup", [0, 2])
def test_candidates_left_by_another_request_are_not_verified(model, prompts, lookup):
    """The device holds the last request's candidates; a new request's first iteration must
    not accept them, even when they happen to be its true continuation: it verifies the root
    alone, or the root and the lookup chain."""
    params = _greedy(16)
    first, second = _tokens(_engine(model).generate(prompts[:2], params))
    oracle = _Oracle(second, (0, 0, 0, 0))
    llm = _engine(model, TreeProposer(oracle, TREE, lookup=lookup))
    llm.generate(prompts[:1], params)
    tree = llm.llm_engine._spec._tree
    tree.cand_in[:, 0] = torch.tensor(second[1: 1 + DEPTH])   # all accepted, were they read
    out = llm.generate(prompts[1:2], _greedy(DEPTH + 2))[0]   # read, they would end it at once
    assert _tokens([out]) == [second[:DEPTH + 2]]
    stats = out.outputs[0].spec_stats
    assert (stats["steps"], stats["accepted"], stats["drafted"]) == \
        _expected(oracle, second, DEPTH + 2, TREE, prompts[1], lookup)
    assert stats["steps"] > 1


def test_real_heads_with_eos_and_max_tokens_caps(model, prompts):
    """Random heads (mostly wrong drafts), every max_tokens remainder modulo the depth, and an
    EOS that stops inside a chain; the engine serves a plain request afterwards."""
    torch.manual_seed(0)
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    for head in heads.heads:
        torch.nn.init.normal_(head.down.weight, std=0.5)
    plain, tree = _engine(model), _engine(model, TreeProposer(heads, TREE), spec_chain=3)
    for max_tokens in (1, 2, 3, 5, 8, 11, 24):
        assert _tokens(tree.generate(prompts, _greedy(max_tokens))) == \
            _tokens(plain.generate(prompts, _greedy(max_tokens)))
    ref = _tokens(plain.generate(prompts, _greedy(24)))
    for prompt, out in zip(prompts, ref):
        eos = out[len(out) // 2]
        params = _greedy(24, stop_token_ids=[eos])
        assert _tokens(tree.generate([prompt], params)) == _tokens(plain.generate([prompt],
                                                                                 params))
    assert _tokens(tree.generate(prompts, _greedy(24))) == ref


@pytest.mark.parametrize("lookup", [0, 3])
def test_compiled_program_makes_the_same_iterations(model, prompts, lookup):
    """EngineConfig.compile: torch.compile'd glue around the rounds (the lookup's drafts and
    the step to the next iteration too); the tokens of target-only and the uncompiled program's iterations and
    acceptances."""
    target = _tokens(_engine(model).generate(prompts[:2], _greedy(16)))
    outs = {}
    for compiled in (False, True):
        proposer = TreeProposer(_Oracle(target[0], (0, 1, 0, 0)), TREE, lookup=lookup)
        llm = _engine(model, proposer, compile=compiled, spec_chain=2)
        outs[compiled] = llm.generate(prompts[:2], _greedy(16))
        assert _tokens(outs[compiled]) == target
        program = llm.llm_engine._spec._tree._programs[2, True, True, False]
        for glue in ("_prepare", "_conclude", "_advance"):
            assert (getattr(program, glue) != getattr(program, glue + "_eager")) == compiled
    assert [o.outputs[0].spec_stats for o in outs[True]] == \
        [o.outputs[0].spec_stats for o in outs[False]]
    assert outs[True][0].outputs[0].spec_stats["accepted"] > 0


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
            _engine(model, TreeProposer(heads, tree), compile=True).generate(prompts[:1],
                                                                              _greedy(4))
        graphs[phase] = counters["stats"]["unique_graphs"] - before
    assert graphs["low"] == graphs["high"] >= 4   # at least _prepare and _conclude, twice


def test_oracle_eos_inside_an_accepted_path(model, prompts):
    target = _tokens(_engine(model).generate(prompts, _greedy(24)))
    plain = _engine(model)
    for prompt, out in zip(prompts, target):
        tree = _engine(model, TreeProposer(_Oracle(out, (0, 0, 0, 0)), TREE), spec_chain=2)
        params = _greedy(24, stop_token_ids=[out[5]])
        assert _tokens(tree.generate([prompt], params)) == _tokens(plain.generate([prompt],
                                                                                 params))


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
    from rltlab.engine.spec_decode import SpecDecoder
    from rltlab.engine.tree_program import TreeProgram
    launches = _count_calls(monkeypatch, TreeProgram, "launch")
    steps = _count_calls(monkeypatch, SpecDecoder, "_tree_step")
    target = _tokens(_engine(model).generate(prompts, _greedy(24)))
    plain = _engine(model)
    for prompt, out in zip(prompts, target):
        tree = _engine(model, TreeProposer(_Oracle(out, (0, 0, 0, 0)), TREE, lookup=lookup),
                       spec_pipeline=3)
        for params in (_greedy(24, stop_token_ids=[out[5]]), _greedy(24), _greedy(13),
                       _greedy(2)):
            launches[0] = steps[0] = 0
            outs = tree.generate([prompt], params)
            assert _tokens(outs) == _tokens(plain.generate([prompt], params))
            stats = outs[0].outputs[0].spec_stats       # None: stopped at token 0
            iterations = stats["steps"] if stats else 0
            assert launches[0] == iterations and steps[0] == -(-iterations // 3)
        engine = tree.llm_engine
        launches[0] = steps[0] = 0
        engine.add_request(None, prompt, _greedy(24), stream=True)
        while engine.has_unfinished_requests():
            engine.step()
        assert launches[0] == steps[0] > 2


def test_pipelined_capture_warm_up_restores_the_programs_inputs(model, prompts, monkeypatch):
    """Where CUDA graphs run, the capture runs the program twice before capturing it; a
    following program rewrites its own inputs (pending token, P, cap, candidates), so its
    warm-up must restore them. A stand-in capture (two warm-up runs, then the program at each
    replay), turned on after the request's first tree step so that it captures a program
    whose candidates are valid, must leave tokens and iterations as without it."""
    target = _tokens(_engine(model).generate(prompts, _greedy(24)))

    captures = []

    class Replayed:
        def __init__(self, fn, warmup=None):
            captures.append(fn)
            for _ in range(2):
                (warmup or fn)()
            self.replay = fn

    outs = {}
    for captured in (False, True):
        llm = _engine(model, spec_pipeline=4)
        proposer = TreeProposer(_Oracle(target[1], (0, 1, 0, 0)), TREE, lookup=3)
        llm.set_proposer(proposer)
        # the decoder the program runs on (grown to the tree's rows)
        static = llm.llm_engine.runner.static_rows(TreeShape(proposer.paths, "cpu").num_rows)
        engine, done = llm.llm_engine, []
        engine.add_request(None, prompts[1], _greedy(24))
        while engine.has_unfinished_requests():
            done += engine.step()
            running = engine.scheduler.running
            stats = running and getattr(running[0], "spec_stats", None)
            if captured and stats and not captures:
                monkeypatch.setattr(static, "cuda_graphs", True)
                monkeypatch.setattr(static, "_capture", Replayed)
        outs[captured] = done
        assert _tokens(done) == target[1:2]
    assert len(captures) == 1
    assert outs[True][0].outputs[0].spec_stats == outs[False][0].outputs[0].spec_stats
    assert outs[True][0].outputs[0].spec_stats["accepted"] > 0


def test_ineligible_requests_step_normally(model, prompts):
    """Sampled requests and two greedy ones at once are not speculated on: the engine's own
    tokens, and no tree step counted."""
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=3, exit_policy="fixed")
    plain = _engine(model, max_num_seqs=2)
    tree = _engine(model, TreeProposer(heads, TREE), max_num_seqs=2)
    for params in (sampled, _greedy(12, logprobs=0), _greedy(12, top_k=5)):
        outs = tree.generate(prompts[:1], params)
        assert _tokens(outs) == _tokens(plain.generate(prompts[:1], params))
        assert outs[0].outputs[0].spec_stats is None
    both = tree.generate(prompts[:2], _greedy(12))
    assert _tokens(both) == _tokens(plain.generate(prompts[:2], _greedy(12)))


def test_private_blocks_are_reserved_once_and_refused_when_short(model, prompts):
    heads = LookaheadHeads(model, depth=DEPTH, inner=16)
    proposer = TreeProposer(heads, TREE)
    llm = _engine(model)
    manager = llm.llm_engine.block_manager
    total = manager.num_blocks
    llm.set_proposer(proposer)
    leaves = llm.llm_engine._spec._tree.shape.num_leaves
    assert manager.num_blocks == total - 2 * leaves
    reserved = [b for b, owners in manager.owner.items() if owners == {RESERVED}]
    assert len(reserved) == 2 * leaves
    llm.generate(prompts, _greedy(16))
    llm.set_proposer(None)
    llm.set_proposer(proposer)              # the same proposer: its program and blocks again
    assert manager.num_blocks == total - 2 * leaves
    assert manager.num_free_blocks == manager.num_blocks
    assert private_blocks(proposer) == private_blocks(TREE) == 2 * leaves
    assert private_blocks(TreeProposer(heads, [])) == 2                   # the root's row
    assert private_blocks(TreeProposer(heads, TREE, lookup=3)) == 2 * (leaves + 1)
    short = _engine(model, num_blocks=20)
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
        _engine(model, block_size=1).set_proposer(TreeProposer(heads, [(0,), (0, 0)]))
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="lookup"):
            TreeProposer(heads, [(0,)], lookup=bad)
    with pytest.raises(ValueError, match="ngram"):
        TreeProposer(heads, [(0,)], lookup=2, ngram=0)
    for bad in (dict(lookup=2, adaptive_lookup=1), dict(adaptive_lookup=True),
                dict(lookup=2, tree=[], adaptive_lookup=True)):
        with pytest.raises(ValueError, match="adaptive_lookup"):
            TreeProposer(heads, **{"tree": [(0,)], **bad})
    with pytest.raises(ValueError, match="first_drafts"):
        TreeProposer(heads, [(0,)], first_drafts="yes")
    llm = _engine(model)                       # block_size 4 < the lookup chain's 5
    with pytest.raises(ValueError, match="block_size >= 5"):
        llm.set_proposer(TreeProposer(heads, [(0,)], lookup=5))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_blocks"]


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("gemv_rows", [1, 64])
def test_device_program_through_the_triton_kernels(model, prompts, gemv_rows, monkeypatch):
    """The program's per-row block tables and slots fed to the Triton RoPE + K/V write and
    paged attention kernels, interpreted on CPU; with gemv_rows = 64 the tree's rows go through
    the several-row q/k/v + RoPE + K/V-write GEMV and the GEMVs too."""
    target = _tokens(_engine(model).generate(prompts[:1], _greedy(10)))
    oracle = _Oracle(target[0], (0, 1, 0, 0))
    llm = _engine(model)
    runner = llm.llm_engine.runner
    runner._static_args = {**runner._static_args, "triton": True, "gemv_rows": gemv_rows}
    runner.static = StaticDecoder(runner.model, max_batch=4, **runner._static_args)
    llm.set_proposer(TreeProposer(oracle, TREE))
    rows, rope_kv_linear = [], kernels.rope_kv_linear
    monkeypatch.setattr(kernels, "rope_kv_linear",
                        lambda x, *a, **k: rows.append(x.shape[0]) or rope_kv_linear(x, *a, **k))
    outs = llm.generate(prompts[:1], _greedy(10))
    assert _tokens(outs) == target
    assert sum(o.outputs[0].spec_stats["accepted"] for o in outs) > 0
    tree_rows = TreeShape(TREE, "cpu").num_rows
    assert (tree_rows in rows) == (gemv_rows > 1) and tree_rows > 1
