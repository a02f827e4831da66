"""W5 of `python -m rltlab.bench.engine`: shared-prompt groups (the GRPO shape) against the same
samples sent as independent requests, on one engine in one run.

64 prompts x n = 8 samples, 512-token prompts, temperature 1, logprobs=0, fixed depth R, closed
loop: the client keeps 2 x max_num_seqs / n groups (the grouped run) or 2 x max_num_seqs
requests (the independent run) outstanding, so that the engine always holds max_num_seqs
sequences (samples that finish early free their slot; a waiting group is admitted when all
its samples fit, rltlab.engine.groups). Sample j of prompt i has the same seed in both runs
(the group's sample_seed(j)), so in exact arithmetic both runs produce the same tokens
(`same_tokens` reports the fraction of samples that did).

EOS-terminated lengths: a random-weight model never ends a sample on purpose, so every request
stops at any of k = round(V x 2 / max_tokens) token ids (one seeded set for all requests;
ignore_eos). The model's probability mass on k random ids of its vocabulary V is about k / V,
so a sample stops at each token with probability ~ 2 / max_tokens (1/128 at max_tokens 256):
geometric lengths, mean ~ 0.43 x max_tokens, ~13% run to max_tokens. The run reports the
measured mean length and the fraction that stopped.
"""
from __future__ import annotations

import statistics

import torch

from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine_checks import closed_loop, prefill_only
from rltlab.common.profiling import phase_profile
from rltlab.engine import SamplingParams


def stop_ids(vocab: int, max_tokens: int, seed: int = 5) -> list[int]:
    """round(vocab x 2 / max_tokens) distinct ids (at least one), drawn with a fixed seed."""
    count = min(vocab - 1, max(1, round(vocab * 2 / max_tokens)))
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(vocab - 1, generator=gen)[:count] + 1).tolist()


def group_params(spec: dict, vocab: int, num: int) -> list[SamplingParams]:
    stops = stop_ids(vocab, spec["max_tokens"])
    return [SamplingParams(n=spec["n"], temperature=1.0, seed=1000 + i,
                           max_tokens=spec["max_tokens"], logprobs=0, ignore_eos=True,
                           stop_token_ids=stops, exit_policy="fixed") for i in range(num)]


def independent(prompts, params: list[SamplingParams]):
    """The n = 1 requests a group run stands for: sample j with seed sample_seed(j)."""
    pairs = [(prompt, SamplingParams(**{**vars(sp), "n": 1, "seed": sp.sample_seed(j)}))
             for prompt, sp in zip(prompts, params) for j in range(sp.n)]
    return [p for p, _ in pairs], [sp for _, sp in pairs]


def _short(params: list[SamplingParams], max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(**{**vars(p), "max_tokens": max_tokens}) for p in params]


def run(llm, spec: dict, prompts, params: list[SamplingParams], costs: ModelCosts,
        rounds: int = 1, profile: bool = False) -> dict:
    """Grouped and independent closed loops (+ the grouped prefill-only run) on one engine:
    one untimed pass of each, then `rounds` rounds of both, their order alternating; the
    figures are the last round's, group_speedup the median of the rounds' ratios (with their
    mean and standard error: rounds are paired and independent). profile: after the timed
    figures, one more loop of each under torch.profiler (grouped_profile, independent_profile:
    rltlab.common.profiling.phase_profile)."""
    n, c = spec["n"], spec["concurrency"]
    solo_prompts, solo_params = independent(prompts, params)
    groups_out, solo_out = max(1, 2 * c // n), 2 * c
    # capture / autotune outside the timings: every batch size both runs use, then one whole
    # pass of each (its draining tail and staggered admissions reach batch buckets and Triton
    # specialisations the short runs do not, as the other workloads' first pass)
    llm.generate(solo_prompts[:c], _short(solo_params[:c], 2))
    llm.generate(prompts[: max(1, c // n)], _short(params[: max(1, c // n)], 2))
    first = {"closed_loop": closed_loop(llm, prompts, params, groups_out, costs)[0]["tok_s"],
             "independent": closed_loop(llm, solo_prompts, solo_params, solo_out,
                                        costs)[0]["tok_s"]}
    ratios = []
    for r in range(rounds):
        for kind in (("shared", "solo") if r % 2 == 0 else ("solo", "shared")):
            if kind == "shared":
                shared, shared_outs = closed_loop(llm, prompts, params, groups_out, costs)
            else:
                solo, solo_outs = closed_loop(llm, solo_prompts, solo_params, solo_out, costs)
        ratios.append(shared["tok_s"] / solo["tok_s"])
    prefill = prefill_only(llm, prompts, params, groups_out, costs)
    profiles = {}
    if profile:   # after the timed figures: the profiler slows what it watches
        profiles = {"grouped_profile": phase_profile(
                        lambda: closed_loop(llm, prompts, params, groups_out, costs)),
                    "independent_profile": phase_profile(
                        lambda: closed_loop(llm, solo_prompts, solo_params, solo_out, costs))}
    samples = [c for o in shared_outs for c in o.outputs]
    same = sum(a.token_ids == b.token_ids for a, b in zip(samples, solo_outs))
    mean = statistics.fmean(ratios)
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    return {"closed_loop": shared, "independent": solo, "prefill": prefill,
            "first_pass_tok_s": first, "round_speedups": [round(x, 4) for x in ratios],
            "group_speedup_mean": round(mean, 4),
            "group_speedup_se": None if se is None else round(se, 4),
            "group_speedup": round(statistics.median(ratios), 3),
            "same_tokens": round(same / len(samples), 4),
            "mean_output_tokens": round(sum(len(s.token_ids) for s in samples) / len(samples), 2),
            "stopped_fraction": round(sum(s.finish_reason == "stop" for s in samples)
                                      / len(samples), 4), **profiles}
