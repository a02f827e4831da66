"""Greedy speculative iterations as one device program (rltlab.engine.spec.draft_program) against the
host-driven speculative loop (fused_spec=False) and the engine without a proposer: same tokens,
log-probs within 1e-5 (fp32, CPU; torch reference kernels, plus one run through the Triton
kernels under TRITON_INTERPRET=1), same per-request speculation stats, no leaked blocks."""
import pytest
import torch

from rltlab import kernels
from rltlab.draft_heads.heads import build_component
from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.engine.static_decode import StaticDecoder
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
ENGINE = dict(block_size=4, decode_path="static")


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(11)


def _prompts(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 61, (int(m),), generator=g).tolist()
            for m in torch.randint(1, 15, (n,), generator=g)]


def _params(n, **kw):
    # Different max_tokens: drafting is capped per sequence near its end (k_j < K rows).
    return [SamplingParams(temperature=0.0, max_tokens=3 + (i * 5) % 11, logprobs=0,
                           ignore_eos=i % 2 == 0, **kw) for i in range(n)]


def _head(model, kind, d):
    if kind is None:
        return None
    if kind == "random":
        head = torch.nn.Linear(32, 61, bias=False)
        torch.nn.init.normal_(head.weight, std=0.5, generator=torch.Generator().manual_seed(d))
        return head
    comp = build_component("residual_mlp", model, draft_rounds=d, inner=16)
    with torch.no_grad():
        comp.down.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(d))
    return comp.eval()


def _run(model, prompts, params, proposer=None, fused=True, count=None, **engine):
    llm = LLM(model, fused_spec=fused, **{**ENGINE, **engine})
    if proposer is not None:
        llm.set_proposer(proposer)
        graph = llm.llm_engine._spec._graph
        assert (graph is not None) == fused
        if count is not None and graph is not None:
            run = graph.run
            graph.run = lambda *a: count.append(len(a[0])) or run(*a)
    outs = llm.generate(prompts, params)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owner
    return outs


def _same(outs, refs, stats=True):
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-5
        if stats:
            assert out.spec_stats == ref.spec_stats


@pytest.mark.parametrize("d,k,conc,head", [(1, 4, 1, None), (1, 3, 5, "residual"),
                                           (2, 2, 3, "random"), (3, 5, 5, None),
                                           (2, 1, 2, "residual")])
def test_device_program_equals_host_loop_and_target(model, d, k, conc, head):
    prompts, params = _prompts(5), _params(5)
    target = _run(model, prompts, params, max_num_seqs=conc)
    proposer = DraftProposer(k, d, _head(model, head, d))
    host = _run(model, prompts, params, proposer, fused=False, max_num_seqs=conc)
    calls = []
    fused = _run(model, prompts, params, proposer, count=calls, max_num_seqs=conc)
    assert calls and max(calls) <= conc
    _same(fused, host)
    _same(fused, target, stats=False)
    if head is None:   # the model's own rounds get drafts accepted
        assert sum(o.spec_stats["accepted"] for o in fused) > 0


def test_sampled_and_filtered_requests_in_the_program(model):
    """Mixed greedy / sampled batches run as one program: greedy requests (with top-k / top-p
    and top log-probs) equal the host loop; a seeded sampled request is reproducible; T = 1
    with top-k = 1 (a one-hot processed distribution: drafts, acceptance tests and residual
    draws all degenerate) reproduces greedy decoding. Distribution: test_engine_speculative."""
    prompts = _prompts(5, seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=7, top_k=5, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=9, top_p=0.9, logprobs=2),
              SamplingParams(temperature=0.9, max_tokens=8, seed=4, logprobs=1, top_p=0.8),
              SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=1.0, max_tokens=8, seed=5, top_k=1, logprobs=0)]
    proposer = DraftProposer(3, 1)
    host = _run(model, prompts, params, proposer, fused=False, max_num_seqs=5)
    calls = []
    fused = _run(model, prompts, params, proposer, count=calls, max_num_seqs=5)
    again = _run(model, prompts, params, proposer, max_num_seqs=5)
    assert calls
    for i in (0, 1, 3):
        assert fused[i].token_ids == host[i].token_ids
        assert fused[i].top_logprobs == host[i].top_logprobs or all(
            abs(a[t] - b[t]) < 1e-5 for a, b in zip(fused[i].top_logprobs,
                                                      host[i].top_logprobs) for t in a)
    assert [o.token_ids for o in again] == [o.token_ids for o in fused]
    greedy = _run(model, prompts[4:], [SamplingParams(temperature=0.0, max_tokens=8,
                                                       logprobs=0)])
    _same(fused[4:], greedy, stats=False)   # raw log-probs of the same tokens
    greedy_spec = _run(model, prompts[4:], [SamplingParams(temperature=0.0, max_tokens=8,
                                                           logprobs=0)], proposer)
    _same(fused[4:], greedy_spec)   # and the same acceptance decisions (spec_stats)


@pytest.mark.parametrize("d,k,conc,head,adaptive", [(1, 3, 5, None, False),
                                                    (2, 4, 1, "random", True),
                                                    (3, 2, 2, None, True)])
def test_stop_tokens_and_length_limits_inside_an_iteration(model, d, k, conc, head, adaptive):
    """A stop token and max_tokens falling inside a program's iteration (the accepted drafts
    after them dropped), fixed and adaptive K: tokens and finish reasons equal the engine
    without a proposer."""
    prompts = _prompts(5, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, exit_policy="fixed",
                             ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    refs = _run(model, prompts, params, max_num_seqs=conc)
    params[3].stop_token_ids = [refs[3].token_ids[4]]   # request 3 stops there
    refs = _run(model, prompts, params, max_num_seqs=conc)
    assert refs[3].outputs[0].finish_reason == "stop"
    proposer = DraftProposer(k, d, _head(model, head, d), adaptive=adaptive)
    outs = _run(model, prompts, params, proposer, max_num_seqs=conc)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert any(o.spec_stats and o.spec_stats["steps"] > 1 for o in outs)


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.slow
def test_device_program_through_the_triton_kernels(model):
    """The program's own row tensors (positions, slots, repeated block tables) fed to the
    Triton GEMV, fused RoPE + K/V write and paged attention kernels, interpreted on CPU."""
    # prompts of 2 and 13 tokens, max_tokens 3 and 5 (each iteration costs ~100 interpreted
    # kernel launches)
    prompts = _prompts(2, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=0, ignore_eos=i % 2 == 0)
              for i, m in enumerate((3, 5))]
    target = _run(model, prompts, params, max_num_seqs=1)
    llm = LLM(model, max_num_seqs=1, **ENGINE)
    runner = llm.llm_engine.runner
    runner._static_args = {**runner._static_args, "triton": True}
    runner.static = StaticDecoder(runner.model, max_batch=4, **runner._static_args)
    llm.set_proposer(DraftProposer(3, 1, _head(model, "residual", 1)))
    outs = llm.generate(prompts, params)
    _same(outs, target, stats=False)
    assert runner.static._small_rows == 1   # draft passes took the GEMV


def test_setting_a_proposer_again_reuses_its_device_programs(model):
    llm = LLM(model, max_num_seqs=2, **ENGINE)
    proposer = DraftProposer(2, 1)
    llm.set_proposer(proposer)
    graph = llm.llm_engine._spec._graph
    first = llm.generate(_prompts(2), _params(2))
    programs = dict(graph._programs)
    assert programs
    llm.set_proposer(DraftProposer(2, 2))
    assert llm.llm_engine._spec._graph is not graph
    llm.set_proposer(None)
    llm.set_proposer(proposer)
    assert llm.llm_engine._spec._graph is graph
    again = llm.generate(_prompts(2), _params(2))
    assert all(graph._programs[key] is programs[key] for key in programs)
    _same(again, first)

