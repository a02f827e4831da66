"""Sampler and per-request RNG: logprob modes, top-k/top-p, seeds, logprobs never consume RNG."""
import math

import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.sampling import process_logits, sample
from rltlab.model.architecture import OuroForCausalLM
from tiny_models import tiny_engine_model

torch.set_num_threads(1)


def tiny_model(seed: int = 0) -> OuroForCausalLM:
    return tiny_engine_model(seed)


def gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_process_logits_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    out = process_logits(logits, temperature=torch.tensor([1.0, 1.0, 2.0, 0.0]),
                         top_k=torch.tensor([2, -1, -1, 0]),
                         top_p=torch.tensor([1.0, 0.8, 1.0, 1.0]))
    keep = torch.isfinite(out)
    assert keep[0].tolist() == [True, True, False, False, False]          # top-2
    assert keep[1].tolist() == [True, True, True, False, False]           # 0.5+0.2 < 0.8
    assert torch.allclose(out[2], logits[2] / 2) and torch.equal(out[3], logits[3])


def test_logprob_modes():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, top_k=k, logprobs=3)
              for t, k in ((0.0, -1), (0.7, -1), (1.0, 1))]
    raw = sample(logits, params, gens(3), "raw_logprobs")
    proc = sample(logits, params, gens(3), "processed_logprobs")
    assert raw.tokens == proc.tokens
    full = torch.log_softmax(logits, -1)
    for row, tok in enumerate(raw.tokens):
        assert raw.logprobs[row] == pytest.approx(float(full[row, tok]), abs=1e-6)
        assert len(raw.top_logprobs[row]) == 3
    assert raw.tokens[0] == int(logits[0].argmax())
    assert proc.logprobs[0] == pytest.approx(raw.logprobs[0], abs=1e-6)   # T=0: unscaled
    scaled = torch.log_softmax(logits[1] / 0.7, -1)
    assert proc.logprobs[1] == pytest.approx(float(scaled[raw.tokens[1]]), abs=1e-6)
    assert proc.logprobs[2] == pytest.approx(0.0, abs=1e-6)               # top-1: certain
    assert raw.tokens[2] == int(logits[2].argmax())


def test_sampler_distribution_matches_probabilities():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    logits = torch.log(probs).expand(4000, -1).clone()
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = torch.tensor(sample(logits, params, gens(4000, seed=123), "raw_logprobs").tokens)
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert freq[2] == 0
    # 4000 draws: a standard error below 0.008 per class; 5 sigma is generous and can fail
    assert (freq - probs).abs().max() < 0.04, freq


def test_logprobs_never_change_tokens_and_seeds_reproduce():
    model = tiny_model(1)
    llm = LLM(model, block_size=4)
    prompt = [[4, 8, 15, 16, 23, 42]]
    runs = []
    for logprobs in (None, 0, 5):
        for mode_llm in (llm, LLM(model, block_size=4, logprobs_mode="processed_logprobs")):
            sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=20,
                                ignore_eos=True, logprobs=logprobs,
                                exit_policy="q_exit", exit_threshold=0.6, min_loops=1)
            out = mode_llm.generate(prompt, sp)[0]
            runs.append((out.token_ids, out.exit_depths))
            assert (out.logprobs is None) == (logprobs is None)
            if logprobs:
                assert len(out.top_logprobs) == len(out.token_ids)
                assert all(len(d) == logprobs for d in out.top_logprobs)
    assert all(r == runs[0] for r in runs)


def test_per_request_rng_fresh_seeds_differ_and_are_reported():
    model = tiny_model(2)
    llm = LLM(model, block_size=4)
    prompt = [7, 7, 7, 1]
    outs = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=16,
                                                     ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) == 4
    seeds = [o.sampling_params.seed for o in outs]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 4
    # the reported seed replays the rollout, alone or inside a different batch
    replay = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seeds[2])
    assert llm.generate([prompt], replay)[0].token_ids == outs[2].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=5, seed=i) for i in range(3)]
    mixed = llm.generate([[1, 2], prompt, [9] * 12, [3]], [others[0], replay] + others[1:])
    assert mixed[1].token_ids == outs[2].token_ids


def test_greedy_is_argmax_and_temperature_zero_ignores_seed():
    model = tiny_model(3)
    llm = LLM(model, block_size=4)
    a = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, seed=1, max_tokens=8,
                                                 ignore_eos=True, logprobs=0))[0]
    b = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, seed=2, max_tokens=8,
                                                 ignore_eos=True, logprobs=0))[0]
    assert a.token_ids == b.token_ids
    ids = torch.tensor([[5, 6, 7] + a.token_ids[:-1]])
    with torch.no_grad():
        logits = model(ids).final_logits[0, 2:]
    assert a.token_ids == logits.argmax(-1).tolist()
    assert all(lp <= 0 and math.isfinite(lp) for lp in a.logprobs)


def test_a_draw_at_the_top_of_the_cdf_lands_on_the_last_possible_token(monkeypatch):
    """u * total can round up onto the CDF's end, past the last token with probability > 0
    (here the top-k filter's -inf tail): the sampler then takes the last token it can emit."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(4))
    logits[:, -1] = -10.0   # the last id is outside every top-k < 12
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (3, 7, 12)]
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    tokens = sample(logits, params, gens(3), "raw_logprobs").tokens
    for row, k in enumerate((3, 7, 12)):
        kept = logits[row].topk(k).indices
        assert tokens[row] == int(kept.max())   # the highest-index token of its support


def test_sampling_parameters_upload_once_per_batch_composition(monkeypatch):
    """sample_on_device keeps the device copies of a batch's (temperature, top-k, top-p): the
    same composition again uploads nothing, and any changed value of a row is a new batch (a
    cache keyed on less would sample with another row's settings)."""
    from rltlab.engine import sampling

    uploads = []
    real = sampling.to_device

    def counting(values, dtype, device):
        uploads.append(list(values))
        return real(values, dtype, device)

    monkeypatch.setattr(sampling, "to_device", counting)
    monkeypatch.setattr(sampling, "_PARAM_TENSORS", {})
    logits = torch.randn(3, 29, generator=torch.Generator().manual_seed(1))

    def draw(params, seed=0):
        return sampling.sample_on_device(logits, params, gens(3, seed), "raw_logprobs").tokens

    def reference(params, seed=0):
        temps = torch.tensor([p.temperature for p in params])
        processed = process_logits(logits, temps, torch.tensor([p.top_k for p in params]),
                                   torch.tensor([p.top_p for p in params]))
        out = []
        for row, (p, g) in enumerate(zip(params, gens(3, seed))):
            if p.temperature == 0:
                out.append(int(processed[row].argmax()))
                continue
            probs = torch.softmax(processed[row], -1)
            u = torch.rand((), generator=g)
            out.append(int(torch.searchsorted(probs.cumsum(-1), u * probs.sum(), right=True)))
        return out

    base = [SamplingParams(temperature=t, top_k=k, top_p=q)
            for t, k, q in ((0.0, -1, 1.0), (0.8, 5, 1.0), (1.0, -1, 0.6))]
    first = draw(base)
    count = len(uploads)
    assert count == 4                                    # temperature, top-k, top-p, rows
    assert draw(base).tolist() == first.tolist() == reference(base)
    assert len(uploads) == count                         # the same batch: nothing uploaded
    for changed in ([base[0], base[1], SamplingParams(temperature=1.0, top_p=0.3)],
                    [base[0], SamplingParams(temperature=0.8, top_k=2), base[2]],
                    [base[0], SamplingParams(temperature=0.3, top_k=5), base[2]]):
        for seed in range(4):
            assert draw(changed, seed).tolist() == reference(changed, seed)
    assert len(uploads) == count + 3 * 4
