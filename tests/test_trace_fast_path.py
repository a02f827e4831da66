"""Teacher-mode trace collection through the engine's decode capture (rltlab/traces/capture.py):
its traces equal the round observer's record by record, and it is taken exactly where it applies.
"""
import dataclasses

import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.model import gates
from rltlab.traces import TraceCollector, collection_overhead, load_traces
from rltlab.traces.storage import ALL_FIELDS, TraceWriter, stack_records
from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)
R = 4
KEY = ("prompt_id", "sample_index", "position")
STAT_FIELDS = ("gate_logit", "hazard", "cdf", "top1_prob", "margin", "entropy", "logprob_ref",
               "kl_ref")
# Requests stop at these tokens too: some stop inside a token window, whose later tokens
# (computed and captured) must not become records.
STOPS = [30, 51]


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(3)


def requests(count: int, **kw) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` prompts of mixed lengths, each request with its own output length."""
    prompts = random_prompts(count, seed=11, min_len=2, max_len=20)
    base = dict(temperature=0.0, exit_threshold=0.35, min_loops=1, seed=5,
                stop_token_ids=STOPS)
    params = [SamplingParams(**{**base, "max_tokens": 4 + 3 * (i % 4), **kw}) for i in range(count)]
    return prompts, params


def collect(model, out_dir, prompts, params, *, observer_path=False, engine_args=None,
            **collector_kwargs):
    """-> (outputs, traces, collector, what the engine ran: the observer counts seen by its
    steps, whole-token launches with capture, round steps with capture, token windows)."""
    llm = LLM(model, decode_path="static", **{"max_num_seqs": 3, **(engine_args or {})})
    engine = llm.llm_engine
    collector = TraceCollector(llm, out_dir, teacher=True, **collector_kwargs)
    if observer_path:   # what every call takes where the fast path does not apply
        collector.fast_path_applies = lambda params: False
    ran = {"observers": set(), "captured_launches": 0, "captured_rounds": 0}
    step, run_token, capture_round = engine.step, engine.runner.run_token, engine._capture_round

    def counted_step():
        ran["observers"].add(len(engine.observers))
        return step()

    def counted_run_token(seqs, depth, capture=False):
        ran["captured_launches"] += capture
        return run_token(seqs, depth, capture)

    def counted_capture_round(seqs, *args):
        ran["captured_rounds"] += sum(seq.span.exit_rounds is None for seq in seqs)   # decode
        return capture_round(seqs, *args)

    engine.step, engine.runner.run_token = counted_step, counted_run_token
    engine._capture_round = counted_capture_round
    outs = collector.generate(prompts, params)
    collector.close()
    ran["windows"] = engine._token_window.stats["windows"] if engine._token_window else 0
    return outs, load_traces(out_dir), collector, ran


def by_key(traces: dict) -> dict:
    keys = list(zip(*(traces[k].tolist() for k in KEY)))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return {k: v[order] for k, v in traces.items()}


def assert_same_records(fast: dict, slow: dict) -> None:
    """Every field of every record: integers equal, hidden states within fp32 1e-5,
    statistics within 1e-4."""
    fast, slow = by_key(fast), by_key(slow)
    assert set(fast) == set(slow) == set(ALL_FIELDS)
    for name in ALL_FIELDS:
        if name == "hidden":
            torch.testing.assert_close(fast[name], slow[name], atol=1e-5, rtol=0)
        elif name in STAT_FIELDS:
            torch.testing.assert_close(fast[name], slow[name], atol=1e-4, rtol=0)
        else:
            assert torch.equal(fast[name], slow[name]), name


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine_args", [{}, {"token_window": 1, "round_window": 0}],
                         ids=["token_windows", "whole_tokens_and_round_steps"])
def test_fast_path_records_equal_the_observer_path(model, tmp_path, engine_args):
    """Greedy q_exit rollouts, 8 requests through 3 slots (refilled as requests end), mixed
    prompt and output lengths, stop tokens. token_windows: the default engine; the other: one
    token per step, and decode rows beside admitted prompts stepped round by round."""
    prompts, params = requests(8)
    fast_outs, fast, collector, ran = collect(model, tmp_path / "fast", prompts, params,
                                              engine_args=engine_args, shard_tokens=7)
    slow_outs, slow, _, slow_ran = collect(model, tmp_path / "slow", prompts, params,
                                           engine_args=engine_args, shard_tokens=7,
                                           observer_path=True)
    assert collector.fast_path_applies(params)
    assert ran["observers"] == {0} and slow_ran["observers"] == {1}
    if engine_args:   # one-token whole steps, and round steps beside the admitted prompts
        assert ran["captured_launches"] > 0 and ran["captured_rounds"] > 0
    else:
        assert ran["windows"] > 0
    assert slow_ran["windows"] == slow_ran["captured_launches"] == 0
    assert tokens(fast_outs) == tokens(slow_outs)
    assert [o.outputs[0].finish_reason for o in fast_outs].count("stop") >= 2   # not vacuous
    assert_same_records(fast, slow)
    assert fast["token"].shape[0] == sum(len(o.token_ids) - 1 for o in fast_outs)
    # `selected`: the stock Q-exit on the recorded gate logits, several rounds of it
    expected = gates.q_exit_rounds(fast["gate_logit"], 0.35, 1)
    assert torch.equal(fast["selected"].long(), expected)
    assert len(set(fast["selected"].tolist())) >= 3


def test_samples_projection_and_mixed_policies(model, tmp_path):
    """n = 2 sampled at T = 0.9, each request under q_exit, q_exit_delayed or fixed depth 2
    (all replayable: the fast path), hidden states through a random projection."""
    prompts, params = requests(5, n=2, temperature=0.9)
    policies = [("q_exit", {}), ("q_exit_delayed", {}), ("fixed", {"depth": 2})]
    params = [dataclasses.replace(p, exit_policy=policies[i % 3][0],
                                  exit_policy_args=policies[i % 3][1])
              for i, p in enumerate(params)]
    kwargs = dict(projection_dim=6, projection_seed=2, shard_tokens=16)
    fast_outs, fast, collector, ran = collect(model, tmp_path / "fast", prompts, params,
                                              **kwargs)
    slow_outs, slow, _, _ = collect(model, tmp_path / "slow", prompts, params,
                                    observer_path=True, **kwargs)
    assert collector.fast_path_applies(params) and ran["observers"] == {0}
    assert tokens(fast_outs) == tokens(slow_outs)
    assert_same_records(fast, slow)
    assert fast["hidden"].shape[1:] == (R, 6) and set(fast["sample_index"].tolist()) == {0, 1}
    assert (fast["selected"][fast["prompt_id"] % 3 == 2] == 2).all()   # fixed depth 2


def test_shard_groups_are_the_same_shards(model, tmp_path):
    prompts, params = requests(4)
    written = {}
    for path, observer in (("fast", False), ("slow", True)):
        llm = LLM(model, decode_path="static", max_num_seqs=3)
        collector = TraceCollector(llm, tmp_path / path, teacher=True, shard_tokens=6)
        if observer:
            collector.fast_path_applies = lambda params: False
        collector.generate(prompts, params, shard_group="g0")
        written[path] = collector.close()
    names = [[s["file"] for s in written[p]["shards"]] for p in ("fast", "slow")]
    assert names[0] == names[1] and names[0][0] == "shard-g0-000.safetensors"
    fast, slow = load_traces(tmp_path / "fast"), load_traces(tmp_path / "slow")
    assert torch.equal(fast["position"], slow["position"])   # sorted alike
    assert_same_records(fast, slow)


def test_columns_make_the_bytes_records_make(tmp_path):
    """TraceWriter.add_columns (the fast path's) writes the shards add(records) writes."""
    gen = torch.Generator().manual_seed(0)
    records = [{**{k: torch.rand(R, generator=gen) for k in STAT_FIELDS},
                "hidden": torch.randn(R, 5, generator=gen), "round_mask": torch.ones(R, dtype=bool),
                "top1_id": torch.randint(0, 9, (R,), generator=gen), "executed": R, "selected": 2,
                "ref_round": R, "ref_token": i, "token": i, "position": 9 + i,
                "output_index": i + 1, "prompt_id": i // 4, "sample_index": i % 2,
                "weight_version": 3, "seed": 2 ** 40 + i} for i in range(11)]
    shards = []
    for name, add in (("records", lambda w: (w.add(records[:7]), w.add(records[7:]))),
                      ("columns", lambda w: w.add_columns(stack_records(records, torch.bfloat16)))):
        writer = TraceWriter(tmp_path / name, num_rounds=R, hidden_dim=5, dtype="bfloat16",
                             shard_tokens=4)
        add(writer)
        shards.append([(e["file"], e["sha256"]) for e in writer.close()["shards"]])
    assert shards[0] == shards[1] and len(shards[0]) == 3


def test_other_configurations_take_the_observer_path(model, tmp_path):
    """A policy that is not replayed, max_loops < R, a user's round observer, not teacher mode,
    an engine without whole-token steps: the observer path, whose records are the fast
    path's where both apply."""
    prompts, params = requests(3)
    llm = LLM(model, decode_path="static", max_num_seqs=3)
    engine = llm.llm_engine
    with TraceCollector(llm, tmp_path / "observed", teacher=True) as collector:
        assert collector.fast_path_applies(params)
        for changed in (dict(exit_policy="lookahead"), dict(max_loops=3)):
            assert not collector.fast_path_applies([dataclasses.replace(params[0], **changed)])
        seen = []
        handle = engine.add_round_observer(lambda event: seen.append(bool(event.is_decode.any())))
        assert not collector.fast_path_applies(params)
        observed_outs = collector.generate(prompts, params)
        engine.remove_round_observer(handle)
        assert any(seen)   # the user's observer saw the decode rounds
        collector.generate(prompts, [dataclasses.replace(p, max_loops=3) for p in params],
                           prompt_ids=[10, 11, 12])
    with TraceCollector(llm, tmp_path / "plain") as collector:
        assert not collector.fast_path_applies(params)
    with TraceCollector(LLM(model, decode_path="gather"), tmp_path / "gather",
                        teacher=True) as collector:
        assert not collector.fast_path_applies(params)

    traces = load_traces(tmp_path / "observed")
    capped = traces["prompt_id"] >= 10
    assert (traces["executed"][capped] == 3).all() and not traces["round_mask"][capped, 3].any()
    fast_outs, fast, _, ran = collect(model, tmp_path / "fast", prompts, params)
    assert ran["observers"] == {0} and tokens(fast_outs) == tokens(observed_outs)
    assert_same_records(fast, {k: v[~capped] for k, v in traces.items()})


def test_collection_overhead_times_the_fast_path(model, tmp_path):
    llm = LLM(model, decode_path="static", max_num_seqs=3)
    prompts, params = requests(3)
    report = collection_overhead(llm, prompts, params[0], tmp_path / "ovh", teacher=True)
    assert report["fast_path"] is True and report["same_tokens"] is True
    assert report["traced_output_tokens"] == report["output_tokens"] > 0
    split = report["traced_split_s"]
    assert split["observe"] > 0 and split["write"] > 0
    assert split["observe"] + split["write"] <= split["generate"] <= report["traced_s"]
