"""Chained speculative iterations (ExecutionConfig.spec_chain): several iterations in one device
program, each starting where the last one's acceptance left off, read back once. Greedy outputs
and per-request stats equal one iteration per program and the engine without a proposer, with
stop tokens and length limits falling inside chains; sampled tokens that later iterations of a
chain draw follow full-depth sampling."""
import pytest
import torch

from rltlab.engine import LLM, DraftProposer, SamplingParams
from test_engine_speculative import _random_head, _vocab5_engine
from test_spec_adaptive_k import assert_tokens_3_4_follow_target
from tiny_models import tiny_engine_model

torch.set_num_threads(1)


def _prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(1, 61, (n,), generator=g).tolist() for n in (4, 11, 2, 7, 13)]


@pytest.mark.parametrize("d,k,conc,head,adaptive", [(1, 3, 5, None, False),
                                                    (2, 4, 1, "random", True),
                                                    (3, 2, 2, None, True)])
def test_chained_iterations_equal_single_ones(d, k, conc, head, adaptive):
    model = tiny_engine_model(3)
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 4 * i, exit_policy="fixed",
                             ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    refs = LLM(model, block_size=4, max_num_seqs=conc).generate(prompts, params)
    stop = refs[3].token_ids[4]   # request 3 stops there, inside a chain
    params[3].stop_token_ids = [stop]
    refs = LLM(model, block_size=4, max_num_seqs=conc).generate(prompts, params)
    assert refs[3].outputs[0].finish_reason == "stop"
    runs = {}
    for chain in (1, 4):
        llm = LLM(model, block_size=4, max_num_seqs=conc, decode_path="static",
                  spec_chain=chain)
        llm.set_proposer(DraftProposer(k, d, _random_head(32, 61, d) if head else None,
                                       adaptive=adaptive))
        runs[chain] = llm.generate(prompts, params)
        for out, ref in zip(runs[chain], refs):
            assert out.token_ids == ref.token_ids
            assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.owner
    if not adaptive:   # the device's caps follow the host's: the same drafts and accepts
        assert [o.spec_stats for o in runs[4]] == [o.spec_stats for o in runs[1]]
    # (adaptive K: a chain's draft passes are fixed at its start, so K grows within a chain
    # only up to the longest K its batch started with; the host's mirror of the device's K is
    # what slices the drafts, so a mismatch would break the token identity above)
    assert any(o.spec_stats and o.spec_stats["steps"] > 1 for o in runs[4])


def test_spec_chain_and_pipeline_must_be_positive_ints():
    model = tiny_engine_model(3)
    for name in ("spec_chain", "spec_pipeline"):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=name):
                LLM(model, **{name: bad})


def test_chained_iterations_sample_the_target_distribution():
    """Tokens 3 and 4 come from later iterations of one chain (K = 1: at most two tokens per
    iteration): their joint is full-depth sampling's (chi-square p > 1e-3, TV < 0.06)."""
    model, llm = _vocab5_engine("static", spec_chain=4)
    prompt = [1, 3, 2]
    llm.set_proposer(DraftProposer(1, 1, _random_head(16, 5, 2)))
    outs = llm.generate([prompt], SamplingParams(n=3000, temperature=1.0, seed=3, max_tokens=6,
                                                 ignore_eos=True))[0].outputs
    stats = [o.spec_stats for o in outs]
    assert 0 < sum(s["accepted"] for s in stats) < sum(s["drafted"] for s in stats)
    assert_tokens_3_4_follow_target(model, prompt, outs)
