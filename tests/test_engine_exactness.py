"""The engine vs the reference model's teacher-forced LAST_EXITED recompute (fp32, CPU).

Convention (docs/engine.md): exit_depths[i] is the round at which the position that produced
output token i exited; token 0 comes from the last prompt position at round R. The recompute
runs prompt positions R rounds and output token i (input at position P + i) exit_depths[i + 1]
rounds; the log-prob of token i is read at position P - 1 + i.
"""
import copy
import dataclasses
import math

import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.model.generate import generate_plain
from rltlab.model.architecture import OuroForCausalLM
from tiny_models import tiny_engine_model

torch.set_num_threads(1)   # tiny matmuls: threads only add contention
R = 4
TOL = 1e-5
# Small blocks and chunks so that prompts span several blocks and several prefill chunks, few
# sequences so that the batch refills, a token budget so that chunks get cut.
MIXED = dict(block_size=4, prefill_chunk=5, max_num_seqs=3, max_num_batched_tokens=12)


def tiny_model(seed: int = 0) -> OuroForCausalLM:
    return tiny_engine_model(seed)


def random_prompts(num: int, seed: int, lo: int = 1, hi: int = 20) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (num,), generator=gen).tolist()
    return [torch.randint(0, 61, (n,), generator=gen).tolist() for n in lengths]


def recompute(model, prompt, out):
    """Teacher-forced LAST_EXITED recompute -> (logprobs of out's tokens, log-softmax rows,
    gate logits rows) at the positions that produced each output token."""
    ids = prompt + out.token_ids[:-1]
    exits = [R] * len(prompt) + out.exit_depths[1:]
    assert len(exits) == len(ids)
    with torch.no_grad():
        res = model(torch.tensor([ids]), exit_rounds=torch.tensor([exits]))
    logp = torch.log_softmax(res.final_logits[0].float(), -1)[len(prompt) - 1:]
    chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    return chosen, logp, res.gate_logits[0, len(prompt) - 1:]


def check_against_recompute(model, prompts, outs, greedy_rows=()):
    worst = 0.0
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.prompt_token_ids == prompt
        assert len(out.logprobs) == len(out.token_ids) == len(out.exit_depths)
        assert out.exit_depths[0] == R and out.executed_depths == out.exit_depths
        chosen, logp, _ = recompute(model, prompt, out)
        err = (chosen - torch.tensor(out.logprobs)).abs().max().item()
        worst = max(worst, err)
        if row in greedy_rows:
            assert out.token_ids == logp.argmax(-1).tolist()
    assert worst < TOL, worst
    return worst


def params_list(prompts, policy_kwargs, seed0=0):
    """Alternate sampled (T=1, fixed seed) and greedy rows."""
    return [SamplingParams(temperature=0.0 if i % 3 == 2 else 1.0, seed=seed0 + i,
                           max_tokens=3 + (i * 5) % 11, logprobs=0, ignore_eos=i % 2 == 0,
                           **policy_kwargs(i)) for i in range(len(prompts))]


def one_at_a_time(model, prompts, params):
    llm = LLM(model, block_size=8, max_num_seqs=1)
    return [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def record_finished(engine) -> list:
    """A list that receives every sequence the engine finishes, at its finish."""
    finished, finish = [], engine._finish
    engine._finish = lambda seq, *args: finished.append(seq) or finish(seq, *args)
    return finished


def assert_same_rollouts(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.exit_depths == y.exit_depths
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < TOL


def test_trace_replay_random_exit_patterns():
    model = tiny_model(0)
    prompts = random_prompts(10, seed=1)
    gen = torch.Generator().manual_seed(2)
    traces = [[R] + torch.randint(1, R + 1, (15,), generator=gen).tolist() for _ in prompts]
    params = params_list(prompts, lambda i: dict(exit_policy="trace",
                                                 exit_policy_args={"depths": traces[i]}))
    outs = LLM(model, **MIXED).generate(prompts, params)
    assert {len(o.token_ids) for o in outs} != {1}
    for out, trace in zip(outs, traces):
        assert out.exit_depths == trace[: len(out.token_ids)]
    check_against_recompute(model, prompts, outs, greedy_rows=range(2, 10, 3))
    assert_same_rollouts(outs, one_at_a_time(model, prompts, params))
    # Replaying a rollout's own exit_depths reproduces it exactly.
    replay = [SamplingParams(**{**vars(p), "exit_policy": "trace",
                                "exit_policy_args": {"depths": o.exit_depths}})
              for p, o in zip(params, outs)]
    assert_same_rollouts(outs, LLM(model, block_size=16).generate(prompts, replay))


def test_full_depth_matches_plain_forward():
    """All exits at R: a plain full-depth forward over prompt + outputs gives the log-probs."""
    model = tiny_model(3)
    prompts = random_prompts(5, seed=4)
    outs = LLM(model, **MIXED).generate(prompts, SamplingParams(
        temperature=1.0, seed=0, max_tokens=8, logprobs=0, exit_policy="fixed"))
    for prompt, out in zip(prompts, outs):
        assert out.exit_depths == [R] * len(out.token_ids)
        with torch.no_grad():
            res = model(torch.tensor([prompt + out.token_ids[:-1]]))
        logp = torch.log_softmax(res.final_logits[0].float(), -1)[len(prompt) - 1:]
        got = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert (got - torch.tensor(out.logprobs)).abs().max() < TOL


def stock_cdf(g) -> list[float]:
    """CDF_r = 1 - S_r with S_r = prod_{j<=r} (1 - sigmoid(g_j)) for r = 1..R, written out
    from docs/ouro.md, the exit gate (float64 on the host) so that the oracle shares no code
    with the engine's rltlab.model.gates."""
    cdf, surviving = [], 1.0
    for logit in g.tolist():
        surviving *= 1.0 - 1.0 / (1.0 + math.exp(-logit))
        cdf.append(1.0 - surviving)
    return cdf


def stock_q_exit_round(g, threshold, min_loops, max_loops) -> int:
    """Exit after the first round r with r >= max_loops, or threshold < 1, r >= min_loops and
    CDF_r >= threshold (rounds before min_loops still count in the survival product)."""
    cdf = stock_cdf(g)
    for r in range(1, max_loops):
        if threshold < 1.0 and r >= min_loops and cdf[r - 1] >= threshold:
            return r
    return max_loops


def expected_exit(name, g, sp, index):
    """The policy's exit round for output token `index` from the true gate logits g (fp32 [R])
    of the position that produced it."""
    if name == "fixed":
        return sp.exit_policy_args["depth"]
    if name == "trace":
        return sp.exit_policy_args["depths"][index]
    if name == "q_exit":
        return stock_q_exit_round(g, sp.exit_threshold, sp.min_loops, sp.max_loops)
    if name == "q_exit_delayed":   # fires at r (by threshold, r < max_loops) -> exits at r + 1
        r = stock_q_exit_round(g, sp.exit_threshold, sp.min_loops, sp.max_loops)
        return r + 1 if r < sp.max_loops else r
    if name == "lookahead":        # the placeholder predictor: the stock CDF after round 1
        n, k, thr = 1, sp.exit_policy_args["k"], sp.exit_policy_args["threshold"]
        return min(n + k, sp.max_loops) if stock_cdf(g)[n - 1] >= thr else sp.max_loops
    raise AssertionError(name)


def check_exit_oracle(model, prompts, outs, name):
    """Every decode token's exit round equals the oracle's answer from the teacher-forced gates
    of its producing position; the rollouts must exit at more than one depth."""
    seen = set()
    for prompt, out in zip(prompts, outs):
        _, _, gate_rows = recompute(model, prompt, out)
        for i in range(1, len(out.token_ids)):
            assert out.exit_depths[i] == expected_exit(name, gate_rows[i], out.sampling_params,
                                                       i), (i, out)
            seen.add(out.exit_depths[i])
    assert len(seen) > 1, f"{name}: all decode tokens exited at {seen}; the test is too weak"


POLICIES = {
    "fixed": lambda i: dict(exit_policy="fixed", exit_policy_args={"depth": 1 + i % R}),
    "q_exit": lambda i: dict(exit_policy="q_exit", exit_threshold=(0.5, 0.7, 0.9)[i % 3],
                             min_loops=1 + i % 2, max_loops=R - (i % 4 == 3)),
    "q_exit_delayed": lambda i: dict(exit_policy="q_exit_delayed", min_loops=1,
                                     exit_threshold=(0.5, 0.8)[i % 2]),
    "lookahead": lambda i: dict(exit_policy="lookahead",
                                exit_policy_args={"k": 1 + i % 2, "threshold": 0.5}),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_matches_recompute_and_solo_runs(name):
    model = tiny_model(5)
    prompts = random_prompts(8, seed=6)
    params = params_list(prompts, POLICIES[name], seed0=10)
    outs = LLM(model, **MIXED).generate(prompts, params)
    check_against_recompute(model, prompts, outs, greedy_rows=range(2, 8, 3))
    check_exit_oracle(model, prompts, outs, name)
    assert_same_rollouts(outs, one_at_a_time(model, prompts, params))


def test_q_exit_matches_model_generation_loop():
    """Greedy Q-exit rollouts equal the reference model's own cached loop (generate_plain)."""
    model = tiny_model(7)
    prompts = random_prompts(6, seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True,
                        exit_policy="q_exit", exit_threshold=0.6, min_loops=1)
    outs = LLM(model, **MIXED).generate(prompts, sp)
    plain = generate_plain(model, prompts, 10, threshold=0.6, min_loops=1)
    for i, out in enumerate(outs):
        assert out.token_ids == plain.token_ids[i]
        assert out.exit_depths == plain.exit_rounds[i]
        assert max(abs(a - b) for a, b in zip(out.logprobs, plain.logprobs[i])) < TOL
    assert len({d for o in outs for d in o.exit_depths}) > 1


def test_mixed_batches_rows_at_different_rounds():
    """Steps really mix rounds and prefill/decode rows (observed through the round hook)."""
    model = tiny_model(9)
    prompts = random_prompts(8, seed=10)
    llm = LLM(model, **MIXED)
    steps = []
    llm.add_round_observer(lambda ev: steps.append(
        (set(ev.rounds.tolist()), set(ev.is_decode.tolist()), len(set(ev.request_ids)))))
    sp = SamplingParams(temperature=0.0, max_tokens=9, logprobs=0, exit_policy="q_exit",
                        exit_threshold=0.6, min_loops=1)
    outs = llm.generate(prompts, sp)
    assert any(len(r) > 1 for r, _, _ in steps)          # rows at different rounds
    assert any(d == {True, False} for _, d, _ in steps)  # prefill chunks next to decodes
    assert max(n for _, _, n in steps) == MIXED["max_num_seqs"]
    check_against_recompute(model, prompts, outs, greedy_rows=range(8))


def test_rollout_logprobs_vs_training_model_fp32():
    """The trainer's model (separate copy, train mode, autograd on) recomputes the rollout."""
    engine_model = tiny_model(11)
    trainer = copy.deepcopy(engine_model).train()
    prompts = random_prompts(6, seed=12)
    gen = torch.Generator().manual_seed(13)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, logprobs=0,
                             exit_policy="trace", exit_policy_args={
                                 "depths": [R] + torch.randint(1, R + 1, (12,),
                                                               generator=gen).tolist()})
              for i in range(len(prompts))]
    outs = LLM(engine_model, **MIXED).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        exits = torch.tensor([[R] * len(prompt) + out.exit_depths[1:]])
        res = trainer(ids, exit_rounds=exits)
        logp = torch.log_softmax(res.final_logits[0].float(), -1)[len(prompt) - 1:]
        train_lp = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert train_lp.requires_grad
        assert (train_lp.detach() - torch.tensor(out.logprobs)).abs().max() < TOL


def test_bf16_engine_close_to_fp32_recompute():
    """bf16 rollouts vs the fp32 recompute: the gap is measured (docs/engine.md), bounded here."""
    model = tiny_model(14)
    prompts = random_prompts(4, seed=15)
    llm = LLM(model, dtype=torch.bfloat16, block_size=4)
    assert llm.llm_engine.model is not model and llm.llm_engine.runner.kv_cache.dtype \
        == torch.bfloat16
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=8,
                                                logprobs=0, exit_policy="q_exit",
                                                exit_threshold=0.6, min_loops=1))
    gaps = []
    for prompt, out in zip(prompts, outs):
        chosen, _, _ = recompute(model, prompt, out)
        gaps.append((chosen - torch.tensor(out.logprobs)).abs().max().item())
    assert 0 < max(gaps) < 0.25, gaps


def test_first_chunk_causal_attention_equals_the_cache_gather():
    """Rows holding positions 0..n-1 (a first prefill chunk) attend over their own fresh k/v
    with causal SDPA; the general path gathers the same keys from the cache with a mask."""
    llm = LLM(tiny_model(3), decode_path="gather", block_size=4, prefill_chunk=64,
              max_num_seqs=3, max_num_batched_tokens=64)
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(3, seed=12)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2))
    seqs = engine.scheduler.schedule()
    batch = engine.runner.prepare(seqs)
    assert batch.from_start and len(set(batch.row_sizes)) > 1   # padded rows
    cache = engine.runner.kv_cache.clone()
    fast, fast_gates = engine.runner.run_round(batch)
    engine.runner.kv_cache.copy_(cache)
    slow, slow_gates = engine.runner.run_round(dataclasses.replace(batch, from_start=False))
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_gates, slow_gates, atol=1e-5, rtol=1e-5)
