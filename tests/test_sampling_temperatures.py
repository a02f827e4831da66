"""Output distributions at T = 0.5, 0.7 and 0.9 (with top-k, top-p and both) against the exact
ones.

At T = 1 a sampler that ignores the temperature somewhere is still right, so the T = 1 tests
(test_speculative, test_engine_speculative) cannot see it. Here every sampling path is checked
at T < 1: the reference speculative decoder (rltlab.model.speculative), the engine's host loop
(rltlab.engine.spec.decoder, gather path), the one-program path (rltlab.engine.spec.draft_program, static
path) and plain engine sampling (rltlab.engine.sampling, no proposer).

The exact distribution is enumerated from full-depth logits of a 5-token model with a
hand-written temperature / top-k / top-p filter (not rltlab's process_logits), and compared
with the empirical one by a chi-square p-value (cells with expected count < 5 pooled) and the
total-variation distance. Filtered tokens must never appear.
"""
import pytest
import torch

from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.model.speculative import speculative_generate
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

torch.set_num_threads(1)
VOCAB, ROUNDS, PROMPT = 5, 4, [1, 3, 2]
# (temperature, top_k, top_p): one group per setting; the engine runs them in one batch. The
# third combines top-k with top-p: top-p measured on the full distribution instead of the
# top-k-renormalised one keeps a third token there (15% of the pairs' mass on filtered cells).
GROUPS = [(0.5, 3, 1.0), (0.9, -1, 0.8), (0.7, 3, 0.8)]


def _model() -> OuroForCausalLM:
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, total_ut_steps=ROUNDS,
                     max_position_embeddings=64)
    return OuroForCausalLM(cfg).init_weights(2, std=0.3).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _random_head(seed: int) -> torch.nn.Linear:
    head = torch.nn.Linear(16, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=torch.Generator().manual_seed(seed))
    return head


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """One row of logits -> the sampling distribution (float64), by the textbook definitions:
    softmax(logits / T); keep the top_k most likely tokens; of those (renormalized), keep the
    most likely ones until their mass reaches top_p."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(probs[t] for t in kept)
    nucleus, mass = [], 0.0
    for t in kept:
        nucleus.append(t)
        mass += probs[t] / total
        if mass >= top_p:
            break
    out = torch.zeros(len(probs), dtype=torch.float64)
    for t in nucleus:
        out[t] = probs[t]
    return out / out.sum()


def exact_joint(model, temperature: float, top_k: int = -1, top_p: float = 1.0):
    """p(t0, t1, t2 | PROMPT) of full-depth sampling, by enumeration: [V, V, V]."""
    t0, t1 = torch.meshgrid(torch.arange(VOCAB), torch.arange(VOCAB), indexing="ij")
    ids = torch.cat([torch.tensor(PROMPT).expand(VOCAB * VOCAB, -1),
                     t0.reshape(-1, 1), t1.reshape(-1, 1)], 1)
    with torch.no_grad():
        logits = model(ids).final_logits

    def dist(row):
        return filtered_probs(row, temperature, top_k, top_p)
    p0 = dist(logits[0, -3])
    p1 = torch.stack([dist(logits[a * VOCAB, -2]) for a in range(VOCAB)])    # [t0, t1]
    p2 = torch.stack([dist(row) for row in logits[:, -1]]).view(VOCAB, VOCAB, VOCAB)
    return p0[:, None, None] * p1[:, :, None] * p2


def goodness_of_fit(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """samples [n] cell indices, probs [cells] the exact distribution -> (chi-square p-value,
    total-variation distance). Cells with expected count < 5 are pooled into one (the
    chi-square approximation needs it); a sample in a zero-probability cell fails at once."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    assert observed[probs == 0].sum() == 0, "a filtered token was sampled"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    pvalue = 1.0   # one cell (a single token kept): the zero-probability check is the test
    if obs.numel() > 1:
        stat = ((obs - exp) ** 2 / exp).sum()
        dof = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
        pvalue = float(torch.special.gammaincc(dof / 2, stat / 2))
    return pvalue, float(0.5 * (observed / n - probs).abs().sum())


def _check(tokens: list[list[int]], joint: torch.Tensor, tv_max: float):
    """The speculative pair (t1, t2) and the prefill token t0 against the exact marginals."""
    seqs = torch.tensor([t[:3] for t in tokens])
    pvalue, tv = goodness_of_fit(seqs[:, 1] * VOCAB + seqs[:, 2], joint.sum(0).reshape(-1))
    assert pvalue > 1e-3 and tv < tv_max, (pvalue, tv)
    pvalue0, _ = goodness_of_fit(seqs[:, 0], joint.sum((1, 2)))
    assert pvalue0 > 1e-3, pvalue0


@pytest.mark.parametrize("temperature", [0.5, 0.9])
@pytest.mark.parametrize("d,k,with_head", [(1, 2, False), (2, 2, True)])
def test_reference_decoder_matches_target(model, temperature, d, k, with_head):
    n = 4000
    out = speculative_generate(model, [PROMPT] * n, 3, k=k, draft_rounds=d,
                               head=_random_head(1) if with_head else None,
                               temperature=temperature, seed=7)
    tot = out.totals()
    assert 0 < tot.accepted < tot.drafted            # both branches were exercised
    _check(out.token_ids, exact_joint(model, temperature), tv_max=0.05)


def _engine_samples(model, n: int, proposer=None, **engine):
    # Every sample in one wave: no admissions after the prefill, so every later step is
    # speculative (the engine steps normally while a waiting request can be admitted).
    llm = LLM(model, block_size=4, max_num_seqs=n * len(GROUPS),
              max_num_batched_tokens=n * len(GROUPS) * len(PROMPT), **engine)
    if proposer is not None:
        llm.set_proposer(proposer)
        # the static path runs each iteration as one program (spec_graph), gather the host loop
        assert (llm.llm_engine._spec._graph is not None) == (engine["decode_path"] == "static")
    params = [SamplingParams(n=n, temperature=t, top_k=k, top_p=p, seed=7 + i, max_tokens=4,
                             ignore_eos=True) for i, (t, k, p) in enumerate(GROUPS)]
    outs = llm.generate([PROMPT] * len(GROUPS), params)
    return [req.outputs for req in outs]


@pytest.mark.parametrize("path", ["host_loop", "one_program", "plain"])
@pytest.mark.slow
def test_engine_matches_target(model, path):
    """host_loop: spec_decode on the gather path; one_program: spec_graph on the static path
    (drafts, acceptance tests and residual draws on the device); plain: no proposer, every
    token from the engine's sampler. Heads are covered by the reference decoder's cases and
    the T = 1 tests; here the shallow drafter keeps the (slow, CPU) engine runs few."""
    n = 1000
    proposer = None if path == "plain" else DraftProposer(2, 1)
    groups = _engine_samples(model, n, proposer,
                             decode_path="static" if path == "one_program" else "gather")
    for (temperature, top_k, top_p), outs in zip(GROUPS, groups):
        if proposer is not None:
            stats = [o.spec_stats for o in outs]
            assert 0 < sum(s["accepted"] for s in stats) < sum(s["drafted"] for s in stats)
        _check([o.token_ids for o in outs], exact_joint(model, temperature, top_k, top_p),
               tv_max=0.1)
