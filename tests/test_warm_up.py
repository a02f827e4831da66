"""LLM.warm_up(): synthetic loops that leave the engine idle with every block free and change
no later output; nothing to do off CUDA; bad sizes refused."""
from __future__ import annotations

import pytest

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.static_decode import StaticDecoder
from rltlab.engine.warm_up import bucket_sweeps, decode_phases, prompt_lengths, warm_up
from tiny_models import random_prompts, tiny_engine_model


def test_prompt_lengths_cover_each_length_bucket_once():
    assert prompt_lengths(10) == [10]
    assert prompt_lengths(16) == [16]
    assert prompt_lengths(200) == [16, 32, 64, 128, 200]
    assert prompt_lengths(300) == [16, 32, 64, 128, 256, 300]
    # a list: only its lengths' buckets, each at the longest length given in it
    assert prompt_lengths([1024]) == [1024]
    assert prompt_lengths([20, 30, 1000, 5, 1024]) == [5, 30, 1024]


def test_decode_phases_cover_every_depth_mixed_depths_and_the_gate():
    names = [name for name, _ in decode_phases(4)]
    assert names == [f"fixed depth {d}" for d in (1, 2, 3, 4)] + ["mixed depths", "q_exit"]
    assert all(fields["temperature"] == 0.0 for _, fields in decode_phases(4))
    # groups: every regime again as sampled groups of n
    grouped = decode_phases(4, group_size=8)
    assert [name for name, _ in grouped] == names + [f"{n}, groups of 8" for n in names]
    assert all(fields.get("n", 1) == 1 and fields["temperature"] == 0.0
               for _, fields in grouped[:6])
    assert all(fields["n"] == 8 and fields["temperature"] == 1.0 and fields["logprobs"] == 0
               for _, fields in grouped[6:])


def test_bucket_sweeps_cover_every_bucket_and_depth_grouped_too():
    assert bucket_sweeps([1, 2, 4, 8, 16], concurrency=8, num_rounds=2, group_size=4) == [
        (1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 4),
        (4, 2, 1), (4, 2, 4), (8, 1, 1), (8, 1, 4), (8, 2, 1), (8, 2, 4)]
    assert bucket_sweeps([1, 2, 4], concurrency=4, num_rounds=1) == [(1, 1, 1), (2, 1, 1),
                                                                      (4, 1, 1)]
    assert bucket_sweeps([], concurrency=4, num_rounds=4) == []   # no static decoder


@pytest.mark.slow
def test_a_loop_draining_row_by_row_meets_no_decode_graph_the_warm_up_missed(monkeypatch):
    """W5's first closed loop after warm_up(group_size=8) still captured 7 graphs on an H100
    (0.9 s of a 12 s loop): a token window keeps its batch to its end, so the warm-up's loops
    met whole-token graphs only at the batch sizes their windows started at, while a loop whose
    rows end one by one (EOS-terminated samples) passes through every bucket."""
    asked = []
    launch = StaticDecoder._launch
    monkeypatch.setattr(StaticDecoder, "_launch", lambda self, key, fn: asked.append(
        (key, self._grouped())) or launch(self, key, fn))
    llm = LLM(tiny_engine_model(3), max_num_seqs=32, decode_path="static", cuda_graphs=False,
              cudnn_prefill_after=None)
    prompts = random_prompts(40, seed=2, min_len=4, max_len=12)
    warm_up(llm.llm_engine, concurrency=32, prompt_len=[len(p) for p in prompts], max_tokens=8,
            progress=False, off_cuda=True)
    warmed, asked[:] = set(asked), []
    # 40 requests, 32 at a time, ending one by one: the batch drains through 32, 31, ..., 1
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True,
                                          exit_policy="fixed") for i in range(40)])
    assert {key for key in asked if isinstance(key[0], tuple)} <= warmed


@pytest.mark.slow
def test_a_grouped_warm_up_runs_sampled_groups_and_changes_no_output():
    """group_size 2: the grouped phases add requests of n = 2 at T = 1 (the same number of
    sequences as a greedy phase), leave every block free and change no later output, sampled
    ones included."""
    model = tiny_engine_model(3)
    prompts = random_prompts(2, seed=6, min_len=3, max_len=9)
    params = SamplingParams(temperature=1.0, n=2, max_tokens=5, ignore_eos=True, seed=3)
    llm = LLM(model, max_num_seqs=4, cudnn_prefill_after=None)
    before = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    engine = llm.llm_engine
    free, added = engine.block_manager.num_free_blocks, []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, p, *a, **k: added.append(p) or add(rid, prompt, p,
                                                                               *a, **k)
    result = warm_up(engine, concurrency=2, prompt_len=8, max_tokens=3, group_size=2,
                     progress=False, off_cuda=True)
    engine.add_request = add
    assert result["loops"] == 12 + 2 * 2 and not engine.has_unfinished_requests()
    grouped = [p for p in added if p.n == 2]
    assert len(grouped) == 6 * 2 and all(p.temperature == 1.0 for p in grouped)
    assert len([p for p in added if p.n == 1 and p.max_tokens > 2]) == 6 * 4
    assert engine.block_manager.num_free_blocks == free
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == before


def test_warm_up_leaves_the_engine_idle_and_outputs_unchanged():
    model = tiny_engine_model(3)
    prompts = random_prompts(3, seed=5, min_len=3, max_len=9)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 3
    before = [o.token_ids for o in LLM(model, max_num_seqs=4).generate(prompts, params)]
    llm = LLM(model, max_num_seqs=4, cudnn_prefill_after=None)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    assert llm.warm_up()["loops"] == 0                       # the CPU: nothing to warm
    result = warm_up(engine, concurrency=2, prompt_len=8, max_tokens=3, progress=False,
                     off_cuda=True)
    assert result["loops"] == 6 + 2 * 2 and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    # the prompts' own lengths (3-9 tokens: one bucket, warmed at the longest of them)
    result = warm_up(engine, concurrency=2, prompt_len=[len(p) for p in prompts], max_tokens=3,
                     progress=False, off_cuda=True)
    assert result["loops"] == 6 + 1 * 2 * 2 and not engine.has_unfinished_requests()
    assert [o.token_ids for o in llm.generate(prompts, params)] == before


def test_bad_sizes_and_a_busy_engine_are_refused():
    llm = LLM(tiny_engine_model(3), max_num_seqs=4)
    with pytest.raises(ValueError, match="concurrency must lie in 1..max_num_seqs=4"):
        warm_up(llm.llm_engine, concurrency=5, off_cuda=True)
    for bad in (10 ** 6, [8, 10 ** 6], [], [True], 0):
        with pytest.raises(ValueError, match="prompt_len must lie"):
            warm_up(llm.llm_engine, prompt_len=bad, off_cuda=True)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="group_size must be an int in 1..concurrency=4"):
            warm_up(llm.llm_engine, group_size=bad, off_cuda=True)
    llm.llm_engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.warm_up()
