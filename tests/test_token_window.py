"""Token windows (rltlab.engine.token_window): rows at one host-fixed depth run several whole
tokens per host round trip. They must give the one-token whole-token steps' rollouts exactly
(tokens, exit depths, finish reasons; log-probs within 1e-5) and the teacher-forced
recompute's. fp32, CPU, torch reference kernels."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.config import ExecutionConfig
from test_engine_exactness import MIXED, check_against_recompute, random_prompts, record_finished
from test_round_window import assert_same_rollouts, stepped_outputs
from tiny_models import tiny_engine_model

torch.set_num_threads(1)

IN_PHASE = dict(block_size=4, prefill_chunk=64, max_num_seqs=8, max_num_batched_tokens=256)
CONFIGS = {"mixed": MIXED, "in_phase": IN_PHASE}


def fixed_params(n: int, depth: int, **overrides) -> list[SamplingParams]:
    """Greedy and sampled rows, with and without chosen-token log-probs, different lengths."""
    return [SamplingParams(**{**dict(temperature=(1.0, 0.0)[i % 2], top_k=(0, 7)[i % 3 == 1],
                                     seed=30 + i, max_tokens=5 + i % 4, ignore_eos=True,
                                     logprobs=(0, None)[i % 3 == 2], exit_policy="fixed",
                                     exit_policy_args={"depth": depth}), **overrides})
            for i in range(n)]


def one_token_and_window_runs(model, prompts, params, engine_args, stats=None):
    """-> (one-token whole-token outputs, token-window outputs, each window's (rows, tokens));
    stats: a dict that receives the token windows' stats (windows, prepared_used)."""
    single = LLM(model, decode_path="static", **{**engine_args, "token_window": 0}).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **engine_args)
    window, calls = llm.llm_engine._token_window, []
    launch = window._launch

    def spy(seqs, plan, pending):
        calls.append((len(seqs), len(plan.live)))
        return launch(seqs, plan, pending)
    window._launch = spy
    windowed = llm.generate(prompts, params)
    if stats is not None:
        stats.update(window.stats)
    return single, windowed, calls


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("depth", [1, 3, 4])
def test_windows_equal_one_token_steps_and_recompute(config, depth):
    model = tiny_engine_model(7)
    prompts = random_prompts(7, seed=12)
    params = fixed_params(len(prompts), depth)
    stats = {}
    single, windowed, calls = one_token_and_window_runs(
        model, prompts, params, dict(CONFIGS[config], token_window=3), stats)
    assert calls and max(tokens for _, tokens in calls) > 1, calls
    assert stats["windows"] == len(calls) and stats["prepared_used"] > 0, stats
    if config == "in_phase":   # the same rows go on: windows launched before a read-back
        assert stats["chained"] > 0, stats
    assert_same_rollouts(single, windowed)
    assert all(out.exit_depths[1:] == [depth] * (len(out.token_ids) - 1) for out in windowed)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0 and p.logprobs is not None]
    check_against_recompute(model, [prompts[i] for i in greedy], [windowed[i] for i in greedy],
                            greedy_rows=range(len(greedy)))


def test_a_shared_trace_runs_windows_up_to_each_change_of_depth():
    """Replayed rows whose depths agree token by token take token windows, cut where the depth
    changes; tokens after a shallow stretch read the LAST_EXITED copies it left."""
    model = tiny_engine_model(7)
    prompts = random_prompts(5, seed=8)
    depths = [4] + [2] * 4 + [4] * 3 + [1] * 3 + [3] * 4
    params = [SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, logprobs=0,
                             exit_policy="trace", exit_policy_args={"depths": depths})] * 5
    single, windowed, calls = one_token_and_window_runs(model, prompts, params, IN_PHASE)
    assert [tokens for _, tokens in calls] == [4, 3, 3, 4], calls
    assert_same_rollouts(single, windowed)
    assert all(out.exit_depths == depths for out in windowed)
    check_against_recompute(model, prompts, windowed, greedy_rows=range(5))


def test_window_length_caps_its_tokens_and_rows_at_their_limit_sit_out():
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=3)
    params = fixed_params(4, 2)
    for i, p in enumerate(params):
        p.max_tokens = 3 + 4 * i          # 3 .. 15: rows reach their limits in different windows
    single, windowed, calls = one_token_and_window_runs(
        model, prompts, params, dict(IN_PHASE, token_window=3))
    assert calls and all(tokens <= 3 for _, tokens in calls) and len(calls) >= 4
    assert_same_rollouts(single, windowed)
    assert [len(out.token_ids) for out in windowed] == [3, 7, 11, 15]


@pytest.mark.parametrize("max_num_seqs", [8, 3])
def test_stop_token_inside_a_window_drops_the_tokens_after_it(max_num_seqs):
    """With 3 rows for 9 requests, rows that stop inside a window are replaced by waiting
    requests: a later window has as many rows as the one planned ahead, but not the same."""
    model = tiny_engine_model(7)
    prompts = random_prompts(9, seed=21)
    args = dict(IN_PHASE, max_num_seqs=max_num_seqs, token_window=3)

    def params(stop_token_ids):
        return [SamplingParams(**{**vars(p), "max_tokens": 6 + 3 * (i % 3)}) for i, p in
                enumerate(fixed_params(9, 3, temperature=0.0, ignore_eos=False,
                                       stop_token_ids=stop_token_ids))]
    free = LLM(model, decode_path="static", **{**args, "token_window": 0}).generate(
        prompts, params([]))
    stop = free[1].token_ids[1]   # a token some rollouts sample mid-way
    single = LLM(model, decode_path="static", **{**args, "token_window": 0}).generate(
        prompts, params([stop]))
    llm = LLM(model, decode_path="static", **args)
    finished = record_finished(llm.llm_engine)
    windowed = llm.generate(prompts, params([stop]))
    assert_same_rollouts(single, windowed)
    # nothing sampled after the stop token reaches the sequence either
    assert sorted(seq.output_token_ids for seq in finished) == sorted(
        out.token_ids for out in windowed)
    stopped = [out for out, f in zip(windowed, free) if stop in f.token_ids]
    assert len(stopped) >= 2 and any(1 < len(out.token_ids) < 6 for out in stopped)
    for out in stopped:
        assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
        assert out.outputs[0].finish_reason == "stop"


def test_closed_loop_admits_after_windows_and_top_logprob_rows_take_none():
    model = tiny_engine_model(9)
    prompts = random_prompts(9, seed=4)
    params = fixed_params(9, 2)
    for i, p in enumerate(params):
        p.max_tokens = 8 + 3 * (i % 4)
    stats = {}
    single, windowed, calls = one_token_and_window_runs(
        model, prompts, params, dict(IN_PHASE, max_num_seqs=4), stats)
    assert len(calls) >= 4
    # plans made ahead run, and admissions (new rows) make fresh ones
    assert 0 < stats["prepared_used"] < stats["windows"] == len(calls), stats
    assert_same_rollouts(single, windowed)
    top = fixed_params(4, 2, logprobs=2)
    single, windowed, calls = one_token_and_window_runs(model, prompts[:4], top, IN_PHASE)
    assert calls == []
    assert_same_rollouts(single, windowed)


def test_windows_chain_only_without_streaming_rows_and_when_asked():
    """window_chain=1 and streaming rows each turn chaining off; the rollouts stay the same."""
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=5)
    params = fixed_params(4, 3, max_tokens=13, temperature=0.0)
    runs = {}
    for name, chain, stream in (("chained", 8, False), ("off", 1, False), ("stream", 8, True)):
        llm = LLM(model, decode_path="static", **dict(IN_PHASE, token_window=3,
                                                       window_chain=chain))
        engine = llm.llm_engine
        runs[name] = (stepped_outputs(engine, prompts, params, stream),
                      engine._token_window.stats)
    for name in ("off", "stream"):
        assert_same_rollouts(runs["chained"][0], runs[name][0])
    assert runs["chained"][1]["chained"] > 0
    assert runs["off"][1]["chained"] == runs["stream"][1]["chained"] == 0
    assert runs["chained"][1]["windows"] == runs["off"][1]["windows"]


def test_a_stop_ends_the_chain_after_the_window_launched_ahead():
    """A stop token is learnt from a chained window's read-back, while the next window already
    runs: the chain ends there. The rollouts stay the unchained engine's, and each stopped
    rollout costs at most that one window launched ahead."""
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=5)
    greedy = dict(max_tokens=13, temperature=0.0)
    free = LLM(model, decode_path="static", **dict(IN_PHASE, token_window=3)).generate(
        prompts, fixed_params(4, 3, **greedy))
    stop = free[1].token_ids[4]   # a token the second rollout samples in its second window
    params = fixed_params(4, 3, **greedy, ignore_eos=False, stop_token_ids=[stop])
    runs = {}
    for name, chain in (("chained", 8), ("off", 1)):
        engine = LLM(model, decode_path="static", **dict(IN_PHASE, token_window=3,
                                                          window_chain=chain)).llm_engine
        runs[name] = (stepped_outputs(engine, prompts, params), engine._token_window.stats)
    assert_same_rollouts(runs["off"][0], runs["chained"][0])
    stops = sum(len(out.token_ids) < 13 for out in runs["off"][0])
    assert stops and runs["chained"][1]["chained"] > 0
    assert runs["chained"][1]["windows"] <= runs["off"][1]["windows"] + stops


@pytest.mark.parametrize("kind", ["token", "round"])
def test_each_windows_read_back_is_queued_before_the_next_window(monkeypatch, kind):
    """A window's copy to the host is queued right behind its own work: queued after a chained
    window, the host would wait for that window too, and chaining would overlap nothing (it
    made W7's decode phase 7% slower)."""
    from rltlab.engine import round_window, token_window

    module = token_window if kind == "token" else round_window
    events = []
    queue, read = module.queue_read_back, module.read_back
    monkeypatch.setattr(module, "queue_read_back", lambda outs: events.append("queued") or
                        queue(outs))
    monkeypatch.setattr(module, "read_back", lambda sampled: events.append("read") or
                        read(sampled))
    model = tiny_engine_model(7)
    prompts = random_prompts(4, seed=5)
    params = fixed_params(4, 3, max_tokens=13, temperature=0.0)
    if kind == "round":
        for i, p in enumerate(params):
            p.exit_policy_args = {"depth": 1 + i % 4}
    llm = LLM(model, decode_path="static", **dict(IN_PHASE, token_window=3, round_window=3))
    window = llm.llm_engine._token_window if kind == "token" else llm.llm_engine._round_window
    launch = window._launch
    monkeypatch.setattr(window, "_launch", lambda *args: events.append("launch") or
                        launch(*args))
    llm.generate(prompts, params)
    assert window.stats["chained"] > 0
    launches = [i for i, e in enumerate(events) if e == "launch"]
    assert len(launches) == events.count("queued") == events.count("read") > 1
    for i in launches:   # launch, its copy queued, and only then anything else
        assert events[i + 1] == "queued", events


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8"])
def test_token_window_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="token_window"):
        ExecutionConfig(token_window=bad)
    with pytest.raises(ValueError, match="window_chain"):
        ExecutionConfig(window_chain=bad if bad != -1 else 0)
    assert LLM(tiny_engine_model(0), decode_path="static", token_window=1).llm_engine \
        ._token_window is None
