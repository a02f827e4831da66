"""Shared-prompt groups (rltlab.engine.groups): n samples prefill their prompt once, share its
KV blocks, and equal n independent requests with seeds sample_seed(j) (fp32, CPU, tiny model).
"""
from collections import deque

import pytest
import torch

from rltlab.engine import LLM, ExitPolicy, SamplingParams, register_exit_policy
from test_engine_exactness import POLICIES, TOL, random_prompts, recompute
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4
STOPS = [3, 7, 11, 19]   # ~7% of the tiny vocabulary: most samples end at a stop token
# Prompts of 3 (< one block), 8 (whole blocks only) and 13 (whole blocks + a partial one)
# tokens, small chunks and a token budget so that prompts take several prefill steps.
PROMPTS = random_prompts(3, seed=21, lo=3, hi=4)[:1] + [
    random_prompts(1, seed=22, lo=8, hi=9)[0], random_prompts(1, seed=23, lo=13, hi=14)[0]]
ENGINE = dict(block_size=4, prefill_chunk=5, max_num_seqs=6, max_num_batched_tokens=12)
# Lifecycle cases on the static path too: there round windows and prefill first (decode rows
# wait while any sample prefills) decide when each sample computes.
LIFECYCLE_PATHS = ["gather", "static"]
N = 4

POLICY_CASES = {
    "fixed_R": dict(exit_policy="fixed"),
    "fixed_2": dict(exit_policy="fixed", exit_policy_args={"depth": 2}),
    "q_exit": POLICIES["q_exit"](1),
    "q_exit_delayed": POLICIES["q_exit_delayed"](0),
    "trace": dict(exit_policy="trace", exit_policy_args={
        "depths": [R] + torch.randint(1, R + 1, (30,),
                                      generator=torch.Generator().manual_seed(5)).tolist()}),
}


def group_params(policy: dict, seed: int, n: int = N, **extra) -> SamplingParams:
    return SamplingParams(**{**dict(n=n, temperature=1.0, seed=seed, max_tokens=24, logprobs=0,
                                    stop_token_ids=STOPS), **policy, **extra})


def independent(params: list[SamplingParams], prompts):
    """The n = 1 requests a group stands for: sample j with seed sample_seed(j)."""
    pairs = [(p, SamplingParams(**{**vars(sp), "n": 1, "seed": sp.sample_seed(j)}))
             for p, sp in zip(prompts, params) for j in range(sp.n)]
    return [p for p, _ in pairs], [sp for _, sp in pairs]


def count_prompt_token_rounds(llm) -> list[int]:
    """Wrap the runner: counter[0] = prompt positions run, summed over rounds (round steps,
    and whole-prompt steps: R rounds each, rltlab.engine.prompt_step)."""
    runner, counter = llm.llm_engine.runner, [0]
    execute, run_prompts = runner.execute, runner.run_prompts

    def prompt_positions(seqs) -> int:
        return sum(int((seq.span.start + seq.span.active < seq.num_prompt_tokens).sum())
                   for seq in seqs if seq.span.exit_rounds is not None)

    def counting(seqs):
        counter[0] += prompt_positions(seqs)
        return execute(seqs)

    def counting_whole(seqs):
        counter[0] += R * prompt_positions(seqs)
        return run_prompts(seqs)
    runner.execute, runner.run_prompts = counting, counting_whole
    return counter


def completions(outs):
    return [c for o in outs for c in o.outputs]


def assert_same(group, solo):
    assert len(group) == len(solo)
    for g, s in zip(group, solo):
        assert g.token_ids == s.token_ids and g.exit_depths == s.exit_depths
        assert g.finish_reason == s.finish_reason
        assert max(abs(a - b) for a, b in zip(g.logprobs, s.logprobs)) < TOL


class PoolSpy(deque):
    """The block manager's free list, watched: every block taken and returned, no block
    returned while it is already free."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.taken, self.returned = 0, 0

    def popleft(self):
        self.taken += 1
        return super().popleft()

    def append(self, block):
        assert block not in self, f"block {block} freed twice"
        self.returned += 1
        super().append(block)


def spy_pool(llm) -> PoolSpy:
    bm = llm.llm_engine.block_manager
    bm.free_blocks = PoolSpy(bm.free_blocks)
    return bm.free_blocks


def assert_pool_whole(llm, pool: PoolSpy):
    bm = llm.llm_engine.block_manager
    assert sorted(pool) == list(range(bm.num_blocks)) and not bm.owner
    assert pool.taken == pool.returned > 0


def run_checked(llm, pool: PoolSpy, max_steps: int = 2000) -> dict:
    """Step to the end; after every step no running sequence holds a free block."""
    engine, done = llm.llm_engine, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        held = {b for seq in engine.scheduler.running for b in seq.block_table}
        assert not held & set(pool), "a running sequence holds a block of the free list"
    raise AssertionError("the engine did not finish")


# The static path with whole-token steps (fixed depth) and with round steps (q_exit).
CASES = [(name, "gather") for name in sorted(POLICY_CASES)] + [("fixed_2", "static"),
                                                              ("q_exit", "static")]


@pytest.mark.parametrize("name,path", CASES)
def test_group_equals_independent_requests_and_recompute(name, path):
    model = tiny_engine_model(5)
    params = [group_params(POLICY_CASES[name], seed=40 + i) for i in range(len(PROMPTS))]
    llm = LLM(model, decode_path=path, **ENGINE)
    pool, prompt_rounds = spy_pool(llm), count_prompt_token_rounds(llm)
    engine = llm.llm_engine
    token_steps = []   # whole-token steps and token windows (the static path's fast paths)
    for fast in (engine._whole_tokens, engine._token_window):
        if fast is not None:
            fast.step = (lambda step: lambda depth: token_steps.append(depth) or step(depth))(
                fast.step)
    outs = llm.generate(PROMPTS, params)
    if path == "static" and name == "fixed_2":
        assert token_steps and set(token_steps) == {2}
    assert prompt_rounds[0] == R * sum(map(len, PROMPTS))   # each prompt prefilled once
    assert_pool_whole(llm, pool)

    solo_llm = LLM(model, decode_path=path, **ENGINE)
    solo_rounds = count_prompt_token_rounds(solo_llm)
    solo = solo_llm.generate(*independent(params, PROMPTS))
    assert solo_rounds[0] == N * prompt_rounds[0]
    assert_same(completions(outs), completions(solo))

    for prompt, out in zip(PROMPTS, outs):
        lengths = {len(c.token_ids) for c in out.outputs}
        assert len(lengths) > 1   # the samples end at different tokens
        for c in out.outputs:
            chosen, _, _ = recompute(model, prompt, c)
            assert (chosen - torch.tensor(c.logprobs)).abs().max() < TOL
    finished = [c.finish_reason for c in completions(outs)]
    assert "stop" in finished and set(finished) <= {"stop", "length"}
    depths = {d for c in completions(outs) for d in c.exit_depths[1:]}
    if name != "fixed_R":
        assert min(depths) < R, f"{name}: no token exited early; the test is too weak"


def test_group_larger_than_the_engine_shares_per_admission():
    """n = 5 samples, 3 sequences at most: admitted as 3 + 2, each part prefills once."""
    model = tiny_engine_model(6)
    params = [group_params(POLICY_CASES["q_exit"], seed=3, n=5)]
    llm = LLM(model, **{**ENGINE, "max_num_seqs": 3})
    pool, prompt_rounds = spy_pool(llm), count_prompt_token_rounds(llm)
    outs = llm.generate(PROMPTS[2:], params)
    assert prompt_rounds[0] == 2 * R * len(PROMPTS[2])
    assert_pool_whole(llm, pool)
    assert_same(completions(outs), completions(
        LLM(model, **ENGINE).generate(*independent(params, PROMPTS[2:]))))


def test_prompt_of_whole_blocks_and_one_token_shares_every_block():
    """P % block_size == 0 and max_tokens 1: the samples hold no block of their own."""
    model = tiny_engine_model(6)
    params = [group_params(POLICY_CASES["fixed_R"], seed=4, max_tokens=1)]
    llm = LLM(model, **ENGINE)
    engine, pool = llm.llm_engine, spy_pool(llm)
    llm.add_request("g", PROMPTS[1], params[0])
    engine.step()
    tables = [s.block_table for s in engine.requests["g"].seqs]
    assert len(PROMPTS[1]) % ENGINE["block_size"] == 0 and all(t == tables[0] for t in tables)
    done = run_checked(llm, pool)
    assert_pool_whole(llm, pool)
    assert_same(done["g"].outputs, completions(
        LLM(model, **ENGINE).generate(*independent(params, PROMPTS[1:2]))))


class _FailSample(ExitPolicy):
    """Exit after round 1; fails sample 1 of a request at its second output token."""
    name = "fail_sample_test"
    reads_gates = False

    def decide(self, info):
        if any(s.index == 1 and s.num_output_tokens >= 2 for s in info.seqs):
            raise RuntimeError("sample 1 fails")
        return info.rounds.clone()


register_exit_policy("fail_sample_test", lambda cfg: _FailSample(), overwrite=True)


def test_blocks_freed_once_when_one_sample_fails_and_others_stop_early():
    model = tiny_engine_model(7)
    params = [group_params(dict(exit_policy="fail_sample_test"), seed=9, ignore_eos=True)
              for _ in PROMPTS]
    llm = LLM(model, **ENGINE)
    pool = spy_pool(llm)
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params)):
        llm.add_request(str(i), prompt, sp)
    done = run_checked(llm, pool)
    assert_pool_whole(llm, pool)
    reasons = [[c.finish_reason for c in done[str(i)].outputs] for i in range(len(PROMPTS))]
    assert all(r[1] == "error" for r in reasons), reasons
    assert all(len(done[str(i)].outputs[1].token_ids) == 2 for i in range(len(PROMPTS)))
    others = {reason for r in reasons for reason in r[:1] + r[2:]}
    assert others == {"stop", "length"}, reasons   # some stop early, some run to the end


@pytest.mark.parametrize("path", LIFECYCLE_PATHS)
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_of_the_group_frees_every_block_once(when, path):
    """Abort while the leader prefills (the others wait) or after some samples stopped."""
    model = tiny_engine_model(8)
    llm = LLM(model, decode_path=path, **ENGINE)
    engine, pool = llm.llm_engine, spy_pool(llm)
    llm.add_request("g", PROMPTS[2], group_params(POLICY_CASES["q_exit"], seed=1))
    llm.add_request("h", PROMPTS[1], group_params(POLICY_CASES["q_exit"], seed=2))
    request = engine.requests["g"]
    if when == "prefill":
        engine.step()
        assert all(not s.output_token_ids for s in request.seqs) and request.seqs[0].span
    else:
        while not any(s.is_finished for s in request.seqs):
            engine.step()
        assert not request.is_finished
    llm.abort_request("g")
    done = run_checked(llm, pool)
    assert {c.finish_reason for c in done["g"].outputs} <= {"abort", "stop", "length"}
    assert "abort" in {c.finish_reason for c in done["g"].outputs}
    assert_pool_whole(llm, pool)


@pytest.mark.parametrize("path", LIFECYCLE_PATHS)
def test_leader_leaving_before_its_prompt_is_done_hands_the_prefill_on(path):
    """Sample 0 aborted alone mid-prefill: sample 1 prefills for the rest, who still equal
    their independent requests."""
    model = tiny_engine_model(9)
    params = group_params(POLICY_CASES["trace"], seed=11)
    llm = LLM(model, decode_path=path, **ENGINE)
    engine, pool = llm.llm_engine, spy_pool(llm)
    llm.add_request("g", PROMPTS[2], params)
    engine.step()
    leader = engine.requests["g"].seqs[0]
    assert leader.span is not None and leader.num_computed < len(PROMPTS[2])
    engine._finish(leader, "abort")   # one sample ends alone (no public per-sample abort)
    done = run_checked(llm, pool)
    assert_pool_whole(llm, pool)
    outs = done["g"].outputs
    assert outs[0].finish_reason == "abort" and not outs[0].token_ids
    solo = LLM(model, decode_path=path, **ENGINE).generate(*independent([params], PROMPTS[2:]))
    assert_same(outs[1:], completions(solo)[1:])


@pytest.mark.parametrize("path", LIFECYCLE_PATHS)
def test_weight_update_recomputes_the_shared_prompt_once(path):
    """A same-weights update mid-decode: every sample drops its K/V, the leader recomputes the
    shared prompt alone, the others copy its partial block; outputs equal the run without."""
    model = tiny_engine_model(10)
    params = [group_params(POLICY_CASES["q_exit"], seed=20 + i, ignore_eos=True)
              for i in range(2)]
    prompts = PROMPTS[1:]
    reference = LLM(model, decode_path=path, **ENGINE).generate(prompts, params)
    llm = LLM(model, decode_path=path, **ENGINE)
    engine, pool = llm.llm_engine, spy_pool(llm)
    prompt_rounds = count_prompt_token_rounds(llm)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        llm.add_request(str(i), prompt, sp)
    while not all(len(s.output_token_ids) >= 3 for r in engine.requests.values()
                  for s in r.seqs):
        engine.step()
    running = [(r.request_id, s.index) for r in engine.requests.values() for s in r.seqs
               if not s.is_finished]
    engine.start_weight_update(1)
    engine.update_weights([(n, p.detach().clone()) for n, p in model.named_parameters()])
    engine.finish_weight_update()
    done = run_checked(llm, pool)
    assert_pool_whole(llm, pool)
    assert prompt_rounds[0] == 2 * R * sum(map(len, prompts))   # prefill + one recompute
    assert_same(completions([done["0"], done["1"]]), completions(reference))
    assert len(running) > 2 and all(done[rid].outputs[j].weight_versions[-1] == 1
                                    for rid, j in running)
