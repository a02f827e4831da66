"""Adaptive K (DraftProposer(adaptive=True)): each sequence's draft length follows its own
acceptance, and the engine stays lossless: token-identical to full-depth decoding at T = 0 and
the target distribution at T = 1 for tokens drafted after K has changed."""
import itertools

import pytest
import torch

from rltlab.engine import LLM, DraftProposer, SamplingParams
from test_engine_speculative import _params, _random_head, _same, _vocab5_engine
from test_speculative import chisquare_pvalue
from tiny_models import tiny_engine_model

torch.set_num_threads(1)


def test_draft_length_schedule():
    """+2 after a step that accepted every draft, -1 otherwise, within 1..num_draft_tokens;
    a fixed proposer always drafts num_draft_tokens."""
    adaptive = DraftProposer(5, 1, adaptive=True)
    assert [adaptive.next_draft_length(k, n) for k, n in
            [(5, 5), (3, 3), (4, 4), (5, 2), (3, 0), (1, 0), (1, 1)]] == [5, 5, 5, 4, 2, 1, 3]
    assert DraftProposer(5, 1).next_draft_length(2, 0) == 5
    with pytest.raises(ValueError):
        DraftProposer(4, 1, adaptive=1)


@pytest.mark.parametrize("path,conc", [("gather", 6), ("static", 6), ("static", 1)])
@pytest.mark.slow
def test_adaptive_k_greedy_identical_and_drafts_less_when_rejected(path, conc):
    """Against the engine without a proposer: the same tokens and log-probs. With a head that
    is mostly wrong, adaptive K drafts fewer tokens than fixed K; with the model's own round 3
    (mostly right) it drafts about as many."""
    model = tiny_engine_model(3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (3, 9, 5, 1, 14, 6)]
    params = [_params(i, exit_policy="fixed") for i in range(len(prompts))]
    refs = LLM(model, block_size=4, max_num_seqs=conc).generate(prompts, params)
    drafted = {}
    for (head, d), adaptive in itertools.product([("random", 1), (None, 3)], (False, True)):
        llm = LLM(model, block_size=4, max_num_seqs=conc, decode_path=path)
        llm.set_proposer(DraftProposer(4, d, _random_head(32, 61, d) if head else None,
                                       adaptive=adaptive))
        outs = llm.generate(prompts, params)
        _same(outs, refs)
        drafted[head, adaptive] = sum(o.spec_stats["drafted"] for o in outs if o.spec_stats)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.owner
    assert drafted["random", True] < 0.75 * drafted["random", False], drafted
    assert drafted[None, True] > 0.5 * drafted[None, False], drafted


def assert_tokens_3_4_follow_target(model, prompt, outs, vocab: int = 5) -> None:
    """The samples' joint of tokens 3 and 4 against full-depth sampling's at T = 1
    (chi-square p > 1e-3, TV < 0.06)."""
    n = len(outs)
    seqs = torch.tensor([o.token_ids[3:5] for o in outs])
    observed = torch.bincount(seqs[:, 0] * vocab + seqs[:, 1], minlength=vocab ** 2).double()
    expected = _exact_pair(model, prompt, vocab, 3).reshape(-1) * n
    pvalue = chisquare_pvalue(observed, expected)
    tv = 0.5 * (observed / n - expected / n).abs().sum()
    assert pvalue > 1e-3 and tv < 0.06, (pvalue, tv)


def _exact_pair(model, prompt, vocab, first: int):
    """p(t_first, t_first+1 | prompt) of full-depth sampling at T = 1, by enumerating every
    sequence t0..t_first+1: [V, V]."""
    length = first + 2
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).final_logits.double(), -1)
    at = torch.arange(length) + len(prompt) - 1           # logits predicting t_0..t_last
    logp_seq = logp[:, at].gather(-1, seqs[:, :, None])[:, :, 0].sum(-1)
    return logp_seq.exp().view(vocab ** first, vocab, vocab).sum(0)


@pytest.mark.parametrize("path", ["gather", "static"])
@pytest.mark.slow
def test_adaptive_k_samples_the_target_distribution(path):
    """Tokens 3 and 4 come from steps whose K the earlier steps chose (K alternates with a
    mostly wrong head): their joint is full-depth sampling's (chi-square p > 1e-3, TV < 0.06)."""
    model, llm = _vocab5_engine(path)
    prompt = [1, 3, 2]
    llm.set_proposer(DraftProposer(3, 1, _random_head(16, 5, 1), adaptive=True))
    outs = llm.generate([prompt], SamplingParams(n=3000, temperature=1.0, seed=7, max_tokens=6,
                                                 ignore_eos=True))[0].outputs
    stats = [o.spec_stats for o in outs]
    per_step = [s["drafted"] / s["steps"] for s in stats]
    assert min(per_step) < max(per_step) and 0 < sum(s["accepted"] for s in stats)
    assert_tokens_3_4_follow_target(model, prompt, outs)
