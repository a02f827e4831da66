"""Round windows (rltlab.engine.round_window): decode rows at mixed host-fixed depths stepped one
round at a time, planned and read back once per window. They must give the round-per-step
engine's rollouts exactly (tokens, exit depths; log-probs within 1e-5) and the teacher-forced
recompute's. fp32, CPU, torch reference kernels."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.config import ExecutionConfig
from test_engine_exactness import (MIXED, TOL, check_against_recompute, random_prompts,
                                   record_finished)
from tiny_models import tiny_engine_model

torch.set_num_threads(1)

IN_PHASE = dict(block_size=4, prefill_chunk=64, max_num_seqs=8, max_num_batched_tokens=256)
CONFIGS = {"mixed": MIXED, "in_phase": IN_PHASE}


def replay_params(n: int, trace_seed: int, **overrides) -> list[SamplingParams]:
    gen = torch.Generator().manual_seed(trace_seed)
    traces = [[4] + torch.randint(1, 5, (16,), generator=gen).tolist() for _ in range(n)]
    return [SamplingParams(**{**dict(temperature=0.0, max_tokens=5 + i % 4, ignore_eos=True,
                                     logprobs=0, exit_policy="trace",
                                     exit_policy_args={"depths": traces[i], "fallback": 2}),
                              **overrides})
            for i in range(n)]


def assert_same_rollouts(a, b):
    """Tokens, exit depths and finish reasons equal; log-probs within TOL (or both absent)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.token_ids, x.exit_depths, x.outputs[0].finish_reason) == \
            (y.token_ids, y.exit_depths, y.outputs[0].finish_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < TOL


def stepped_outputs(engine, prompts, params, stream: bool = False) -> list:
    """Add every prompt as request r<i> (streaming or not) and step the engine until all are
    done -> each request's final output, in prompt order."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p, stream=stream)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def round_and_window_runs(model, prompts, params, engine_args):
    """-> (round-per-step outputs, windowed outputs, each window's (rows, steps))."""
    rounds = LLM(model, decode_path="static", fused_tokens=False, **engine_args).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **engine_args)
    window, calls = llm.llm_engine._round_window, []
    launch = window._launch
    window._launch = lambda plan, pending: calls.append((len(plan.seqs), plan.num_steps)) or \
        launch(plan, pending)
    return rounds, llm.generate(prompts, params), calls


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("policy", ["trace", "fixed"])
def test_windows_equal_round_steps_and_recompute(config, policy):
    """Exit replay, or requests at different fixed depths, with and without log-probs: the
    windowed engine takes multi-step windows and gives the round-step engine's rollouts."""
    model = tiny_engine_model(7)
    prompts = random_prompts(7, seed=12)
    params = replay_params(len(prompts), trace_seed=5)
    for i, p in enumerate(params):
        p.logprobs = (0, None)[i % 3 == 2]
        if policy == "fixed":
            p.exit_policy, p.exit_policy_args = "fixed", {"depth": 1 + i % 4}
    rounds, windowed, calls = round_and_window_runs(model, prompts, params, CONFIGS[config])
    assert calls and max(steps for _, steps in calls) > 1, calls
    assert_same_rollouts(rounds, windowed)
    if policy == "trace":
        for out, p in zip(windowed, params):
            assert out.exit_depths == p.exit_policy_args["depths"][: len(out.exit_depths)]
    scored = [i for i, p in enumerate(params) if p.logprobs is not None]
    check_against_recompute(model, [prompts[i] for i in scored], [windowed[i] for i in scored],
                            greedy_rows=range(len(scored)))


def test_window_length_caps_its_steps():
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=3)
    params = replay_params(4, trace_seed=8, max_tokens=12)
    rounds, windowed, calls = round_and_window_runs(
        model, prompts, params, dict(IN_PHASE, round_window=3))
    assert calls and all(steps <= 3 for _, steps in calls)
    assert_same_rollouts(rounds, windowed)


def test_stop_token_inside_a_window_drops_the_tokens_after_it():
    """A row that samples a stop token mid-window keeps computing to the window's end; what
    it sampled after the stop token is dropped, as if it had stopped there."""
    model = tiny_engine_model(7)
    prompts = random_prompts(5, seed=21)
    free = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, replay_params(5, trace_seed=2, max_tokens=10))
    stop = free[0].token_ids[4]   # a token the first rollout samples mid-way
    params = replay_params(5, trace_seed=2, max_tokens=10, ignore_eos=False, stop_token_ids=[stop])
    rounds = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **IN_PHASE)
    engine, windows = llm.llm_engine, []
    finished, step = record_finished(engine), engine._round_window.step
    engine._round_window.step = lambda plan: windows.append(plan.num_steps) or step(plan)
    windowed = llm.generate(prompts, params)
    assert windows
    assert_same_rollouts(rounds, windowed)
    # nothing sampled after the stop token reaches the sequence either
    assert sorted(seq.output_token_ids for seq in finished) == sorted(
        out.token_ids for out in windowed)
    assert windowed[0].token_ids[-1] == stop and len(windowed[0].token_ids) <= 5
    assert windowed[0].outputs[0].finish_reason == "stop"


def test_windows_chain_only_without_streaming_rows_and_when_asked():
    """Windows of the same rows run chained (each launched before the one ahead of it is read
    back); window_chain=1 or streaming rows turn that off. A stop token inside a chained
    window ends the chain. The rollouts are the round-step engine's either way."""
    model = tiny_engine_model(7)
    prompts = random_prompts(5, seed=21)
    free = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, replay_params(5, trace_seed=2, max_tokens=14))
    stop = free[1].token_ids[6]   # a token the second rollout samples mid-way
    params = replay_params(5, trace_seed=2, max_tokens=14, ignore_eos=False,
                           stop_token_ids=[stop])
    rounds = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, params)
    stats = {}
    for name, chain, stream in (("chained", 8, False), ("off", 1, False), ("stream", 8, True)):
        engine = LLM(model, decode_path="static", **dict(IN_PHASE, round_window=3,
                                                         window_chain=chain)).llm_engine
        assert_same_rollouts(rounds, stepped_outputs(engine, prompts, params, stream))
        stats[name] = engine._round_window.stats
    assert any(stop in out.token_ids[:-1] for out in free)   # some rollout stops early
    assert stats["chained"]["chained"] > 0
    assert stats["off"]["chained"] == stats["stream"]["chained"] == 0
    # A stop ends its chain: at most the one window launched before the stop was read back
    # runs beyond what the unchained engine runs, per stopped rollout.
    stops = sum(len(out.token_ids) < 14 for out in rounds)
    assert 0 < stops and stats["chained"]["windows"] <= stats["off"]["windows"] + stops


def test_the_next_window_is_planned_during_the_last_and_used_only_for_the_same_rows():
    """While a window runs, the host plans the next one for the rows it will leave; plan() runs
    it only for exactly those rows and states. After an abort between windows it plans afresh,
    and the other rollouts stay the round-step engine's."""
    model = tiny_engine_model(7)
    prompts = random_prompts(5, seed=3)
    params = replay_params(5, trace_seed=8, max_tokens=14)
    rounds = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, params)
    # one window per step (no chaining): each step's window shows whether it was planned ahead
    engine = LLM(model, decode_path="static", **dict(IN_PHASE, round_window=3,
                                                     window_chain=1)).llm_engine
    window, prepared = engine._round_window, []
    step = window.step
    window.step = lambda plan: prepared.append(plan.uploaded is not None) or step(plan)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, sp)
    outs, aborted_after = {}, None
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
        if aborted_after is None and sum(prepared) >= 2:
            engine.abort_request("r0")
            aborted_after = len(prepared)
    assert aborted_after is not None and len(prepared) > aborted_after + 1, prepared
    assert prepared[aborted_after] is False            # made for rows that include r0
    assert any(prepared[aborted_after + 1:]), prepared  # and then again for the four left
    assert window.stats == {"windows": len(prepared), "prepared_used": sum(prepared),
                            "chained": 0}
    assert outs["r0"].outputs[0].finish_reason == "abort"
    assert_same_rollouts(rounds[1:], [outs[f"r{i}"] for i in range(1, 5)])


def test_closed_loop_admits_new_requests_after_windows():
    """More requests than rows: a window ends where a row reaches its length, the next step
    admits a waiting request (a prefill among decode rows), and windows resume."""
    model = tiny_engine_model(9)
    prompts = random_prompts(9, seed=4)
    params = replay_params(9, trace_seed=6)
    for i, p in enumerate(params):
        p.max_tokens = 8 + 3 * (i % 4)
    rounds, windowed, calls = round_and_window_runs(
        model, prompts, params, dict(IN_PHASE, max_num_seqs=4, round_window=4))
    assert len(calls) >= 6
    assert_same_rollouts(rounds, windowed)
    check_against_recompute(model, prompts, windowed, greedy_rows=range(9))


def test_admission_at_window_boundaries_keeps_the_rollouts():
    """A freed slot admits the waiting requests at the next window boundary; rows at their
    length limit sit out the rest of a window. Neither changes what any request computes."""
    model = tiny_engine_model(9)
    prompts = random_prompts(10, seed=4)
    params = replay_params(10, trace_seed=6)
    for i, p in enumerate(params):
        p.max_tokens = 8 + 3 * (i % 4)
    engine_args = dict(IN_PHASE, max_num_seqs=4, round_window=4)
    rounds = LLM(model, decode_path="static", fused_tokens=False, **engine_args).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **engine_args)
    engine = llm.llm_engine
    window, seen = engine._round_window, []
    step = window.step

    def spy(plan):
        sch = engine.scheduler
        seen.append((len(sch.running), bool(sch.waiting), plan.num_steps))
        return step(plan)
    window.step = spy
    assert_same_rollouts(rounds, llm.generate(prompts, params))
    assert not any(running < 4 and waiting for running, waiting, _ in seen), seen
    assert max(steps for _, _, steps in seen) == 4


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_rows_draw_what_round_steps_draw(config, logprobs_mode):
    """Temperature, top-k and top-p rows next to greedy ones: every row draws from its own
    generator once per token, on the device inside the window, exactly as the round-per-step
    engine's sampler does (same tokens, log-probs within 1e-5)."""
    model = tiny_engine_model(7)
    prompts = random_prompts(7, seed=13)
    params = replay_params(len(prompts), trace_seed=9)
    for i, p in enumerate(params):
        p.temperature = (0.0, 0.8, 1.0, 1.3)[i % 4]
        p.top_k, p.top_p, p.seed = (0, 5, 0, 20)[i % 4], (1.0, 1.0, 0.9, 0.7)[i % 4], 100 + i
    engine_args = dict(CONFIGS[config], logprobs_mode=logprobs_mode)
    rounds, windowed, calls = round_and_window_runs(model, prompts, params, engine_args)
    assert calls and max(steps for _, steps in calls) > 1, calls
    assert_same_rollouts(rounds, windowed)
    assert len({tuple(o.token_ids) for o in windowed}) == len(prompts)


@pytest.mark.parametrize("config", ["mixed", "in_phase"])
def test_groups_of_samples_in_windows_equal_round_steps(config):
    """n = 1..3 samples per prompt (one shared prefill, groups.py), temperature 1: the samples
    join windows once forked and draw what the round-per-step engine draws."""
    model = tiny_engine_model(7)
    prompts = random_prompts(5, seed=31)
    params = replay_params(len(prompts), trace_seed=11)
    for i, p in enumerate(params):
        p.n, p.temperature, p.seed, p.max_tokens = 1 + i % 3, 1.0, 50 + i, 9 + i
    rounds, windowed, calls = round_and_window_runs(model, prompts, params, CONFIGS[config])
    assert calls
    for a, b in zip(rounds, windowed):
        assert len(a.outputs) == len(b.outputs) == a.sampling_params.n
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.exit_depths) == (y.token_ids, y.exit_depths)
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < TOL


def test_gate_driven_or_top_logprob_rows_take_no_window():
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=1)
    gated = [SamplingParams(temperature=0.0, max_tokens=6, exit_policy="q_exit")] * 4
    top_logprobs = replay_params(4, trace_seed=3, logprobs=2)
    for params in (gated, top_logprobs):
        rounds, windowed, calls = round_and_window_runs(model, prompts, params, IN_PHASE)
        assert calls == []
        assert_same_rollouts(rounds, windowed)


def test_one_fixed_depth_keeps_whole_tokens_and_round_window_0_turns_windows_off():
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=1)
    fixed = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_policy="fixed",
                            exit_policy_args={"depth": 3})] * 4
    _, _, calls = round_and_window_runs(model, prompts, fixed, IN_PHASE)
    assert calls == []
    llm = LLM(model, decode_path="static", round_window=0, **IN_PHASE)
    assert llm.llm_engine._round_window is None


@pytest.mark.parametrize("bad", [-1, 2.0, True, "16"])
def test_round_window_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="round_window"):
        ExecutionConfig(round_window=bad)


@pytest.mark.parametrize("policy", ["trace", "fixed"])
def test_prefill_first_keeps_decode_rows_out_of_prefill_steps(policy):
    """A closed loop with more requests than rows. prefill_first=False: decode rows run a round
    in prefill steps. prefill_first=True (default): no step mixes them, and no window runs
    while any row prefills. In neither does a window run while a waiting request could be
    admitted. Rollouts equal the round-step engine's and the recompute's."""
    model = tiny_engine_model(9)
    prompts = random_prompts(9, seed=4)
    params = replay_params(9, trace_seed=6)
    for i, p in enumerate(params):
        p.max_tokens = 8 + 3 * (i % 4)
        if policy == "fixed":   # one depth for every row: windows only beside prefills
            p.exit_policy, p.exit_policy_args = "fixed", {"depth": 3}
    engine_args = dict(IN_PHASE, max_num_seqs=4, round_window=4, prefill_chunk=8)
    rounds = LLM(model, decode_path="static", fused_tokens=False, **engine_args).generate(
        prompts, params)
    mixed, aside, skipped = {}, {}, {}
    for first in (False, True):
        llm = LLM(model, decode_path="static", prefill_first=first, **engine_args)
        engine = llm.llm_engine
        runner, window = engine.runner, engine._round_window
        mixed[first], aside[first], skipped[first] = 0, 0, 0
        execute, step = runner.execute, window.step

        def spy_execute(seqs, first=first):
            decoding = [s for s in seqs if s.output_token_ids]
            mixed[first] += bool(decoding) and len(decoding) < len(seqs)
            return execute(seqs)

        def spy_window(plan, first=first, engine=engine):
            aside[first] += len(plan.seqs) < len(engine.scheduler.running)
            skipped[first] += engine.scheduler.can_admit()
            return step(plan)
        runner.execute, window.step = spy_execute, spy_window
        outs = llm.generate(prompts, params)
        assert_same_rollouts(rounds, outs)
    check_against_recompute(model, prompts, outs, greedy_rows=range(9))
    assert mixed[False] > 0 and mixed[True] == 0
    assert aside[False] == 0 and aside[True] == 0
    assert not any(skipped.values()), skipped


def test_prefill_first_must_be_a_bool():
    with pytest.raises(ValueError, match="prefill_first must be a bool"):
        ExecutionConfig(prefill_first="yes")


@pytest.mark.parametrize("policy", ["trace", "fixed"])
def test_greedy_rows_without_logprobs_take_the_one_pass_argmax(policy):
    """Windows whose rows are all greedy, unfiltered and without log-probs sample through
    runner.greedy (kernels/greedy.py) instead of the general sampler; round windows (trace) and
    token windows (one fixed depth) still give the round-step engine's rollouts. Rows with
    log-probs keep the general sampler."""
    model = tiny_engine_model(7)
    prompts = random_prompts(6, seed=21)
    params = replay_params(len(prompts), trace_seed=9, logprobs=None, max_tokens=9)
    if policy == "fixed":
        for p in params:
            p.exit_policy, p.exit_policy_args = "fixed", {"depth": 3}
    rounds = LLM(model, decode_path="static", fused_tokens=False, **IN_PHASE).generate(
        prompts, params)
    for logprobs, takes_it in [(None, True), (0, False)]:
        for p in params:
            p.logprobs = logprobs
        llm = LLM(model, decode_path="static", **IN_PHASE)
        runner, calls = llm.llm_engine.runner, []
        greedy = runner.greedy
        runner.greedy = lambda hidden: calls.append(len(hidden)) or greedy(hidden)
        windowed = llm.generate(prompts, params)
        assert bool(calls) == takes_it
        got = [(o.token_ids, o.exit_depths) for o in windowed]
        assert got == [(o.token_ids, o.exit_depths) for o in rounds]
