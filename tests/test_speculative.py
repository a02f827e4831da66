"""Loop-aware speculative decoding is lossless: identical tokens at T=0, the target's
distribution at T=1 (chi-square against the exact full-depth distribution)."""
import copy

import pytest
import torch

from rltlab.model.config import OuroConfig
from rltlab.model.speculative import speculative_generate
from rltlab.model.generate import generate_plain
from rltlab.model.architecture import OuroForCausalLM

torch.set_num_threads(1)



def chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; sf of chi2(k) is gammaincc(k/2, x/2)."""
    observed, expected = observed.double(), expected.double()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))

def _model(vocab=64, hidden=32, layers=2, std=0.3, seed=0):
    cfg = OuroConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                     total_ut_steps=4, max_position_embeddings=512)
    return OuroForCausalLM(cfg).init_weights(seed, std=std).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 5, 1)]


@pytest.mark.parametrize("d,k", [(1, 4), (2, 3), (3, 1)])
def test_greedy_identical_to_full_depth(model, prompts, d, k):
    ref = generate_plain(model, prompts, 12, depth=4)
    batched = speculative_generate(model, prompts, 12, k=k, draft_rounds=d)
    assert batched.token_ids == ref.token_ids
    for prompt, want in zip(prompts[:2], ref.token_ids):
        assert speculative_generate(model, prompt, 12, k=k, draft_rounds=d).token_ids[0] == want
    tot = batched.totals()
    assert tot.drafted == k * tot.steps and 0 <= tot.accepted <= tot.drafted
    # K drafts every step: tau (emitted / steps) = 1 + K * acceptance (accepted / drafted)
    assert tot.emitted == tot.steps + tot.accepted
    assert tot.tau == pytest.approx(1 + k * tot.acceptance_rate)


def test_greedy_identical_with_head_draft_model_and_eos(model, prompts):
    eos = generate_plain(model, prompts[:1], 6, depth=4).token_ids[0][4]   # stops early
    ref = generate_plain(model, prompts, 16, depth=4, eos_token_id=eos)
    head = torch.nn.Linear(32, 64, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    out = speculative_generate(model, prompts, 16, k=3, draft_rounds=1, head=head,
                               eos_token_id=eos)
    assert out.token_ids == ref.token_ids and out.token_ids[0][-1] == eos
    drafter = copy.deepcopy(model)   # draft-only layer changes: verification recomputes
    with torch.no_grad():
        drafter.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    out = speculative_generate(model, prompts, 16, k=3, draft_rounds=2, draft_model=drafter,
                               eos_token_id=eos)
    assert out.token_ids == ref.token_ids


def test_rejects_bad_arguments(model):
    with pytest.raises(ValueError):
        speculative_generate(model, [1, 2], 4, draft_rounds=4)
    with pytest.raises(ValueError):
        speculative_generate(model, [1, 2], 4, k=0)


def _exact_joint(model, prompt, vocab, temperature):
    """p(t0, t1, t2 | prompt) of full-depth sampling, by enumeration: [V, V, V]."""
    t0, t1 = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(vocab * vocab, -1),
                     t0.reshape(-1, 1), t1.reshape(-1, 1)], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).final_logits.double() / temperature, -1)
    p0 = logp[0, -3].exp()
    p1 = logp[::vocab, -2].exp()                      # [t0, t1]
    p2 = logp[:, -1].exp().view(vocab, vocab, vocab)  # [t0, t1, t2]
    return p0[:, None, None] * p1[:, :, None] * p2


@pytest.mark.parametrize("d,k,with_head", [(1, 2, False), (2, 1, True)])
def test_sampling_matches_target_distribution(d, k, with_head):
    vocab, n = 5, 4000
    model = _model(vocab=vocab, hidden=16, layers=1, std=0.6, seed=3)
    prompt = [1, 3, 2]
    head = None
    if with_head:
        head = torch.nn.Linear(16, vocab, bias=False)
        torch.nn.init.normal_(head.weight, std=1.0)
    out = speculative_generate(model, [prompt] * n, 3, k=k, draft_rounds=d, head=head,
                               temperature=1.0, seed=7)
    tot = out.totals()
    assert 0 < tot.accepted < tot.drafted            # both branches were exercised
    joint = _exact_joint(model, prompt, vocab, 1.0)
    seqs = torch.tensor([t[:3] for t in out.token_ids])
    cells = seqs[:, 1] * vocab + seqs[:, 2]          # (t1, t2): the speculative tokens
    observed = torch.bincount(cells, minlength=vocab * vocab).double()
    expected = joint.sum(0).reshape(-1) * n
    pvalue = chisquare_pvalue(observed, expected)
    tv = 0.5 * (observed / n - expected / n).abs().sum()
    assert pvalue > 1e-3 and tv < 0.06, (pvalue, tv)
    # Power: the draft distribution itself (tokens sampled at depth d) is rejected.
    shallow = generate_plain(model, [prompt] * n, 3, depth=d, temperature=1.0, seed=7)
    seqs = torch.tensor(shallow.token_ids)
    observed = torch.bincount(seqs[:, 1] * vocab + seqs[:, 2], minlength=vocab ** 2).double()
    assert chisquare_pvalue(observed, expected) < 1e-6
