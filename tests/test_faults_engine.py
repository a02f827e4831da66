"""Engine faults of the fault review (issue 18, B2-B4 and D; docs/reliability.md): the engine
owns its weights, tiny temperatures are greedy on every sampling path, exit-policy arguments and
prompt ids are checked, weight updates are staged and atomic, versions only increase, and an
AsyncLLM consumer survives a rejected update. Tiny random models, fp32, CPU."""
import asyncio
import time

import numpy as np
import pytest
import torch

from rltlab.engine import (LLM, AsyncLLM, DraftProposer, SamplingParams, WeightUpdateError)
from rltlab.engine.sampling import SAMPLING_EPS, process_logits
from rltlab.model.speculative import speculative_generate
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6, 26, 43]]
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=0, ignore_eos=True,
                         exit_policy="q_exit", exit_threshold=0.6, min_loops=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
TINY_TEMPERATURES = [1e-300, 1e-40, 1e-20]   # underflow to 0 / subnormal / overflow in fp32


def _same(outs, refs):
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids and out.exit_depths == ref.exit_depths
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def _engine_params(llm):
    return {n: p.detach().clone() for n, p in llm.llm_engine.model.named_parameters()}


def _assert_engine_params(llm, expected, what):
    for name, param in llm.llm_engine.model.named_parameters():
        assert torch.equal(param, expected[name]), f"{name} changed {what}"


def _chunks(model, size=5):
    items = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return [items[i: i + size] for i in range(0, len(items), size)]


def _full_update(llm, model, version):
    llm.start_weight_update(version)
    for chunk in _chunks(model):
        llm.update_weights(chunk)
    return llm.finish_weight_update()


def _idle(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


# ------------------------------------------------------------------- B2: engine-owned weights
def test_engine_leaves_the_callers_model_and_its_train_mode_alone():
    model = tiny_engine_model(0).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    llm = LLM(model, block_size=4)
    assert model.training, "building an engine put the caller's model in eval mode"
    assert all(p.requires_grad for p in model.parameters())
    llm.generate(PROMPTS, SAMPLED)
    assert model.training
    engine_ptrs = {p.data_ptr() for p in llm.llm_engine.model.parameters()}
    assert not engine_ptrs & {p.data_ptr() for p in model.parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])


def test_in_place_edit_of_the_callers_model_does_not_reach_the_engine():
    """A trainer editing its model in place must not change rollouts under weight version 0;
    only the update API changes the engine's weights (and then the version says so)."""
    model = tiny_engine_model(0)
    llm = LLM(model, block_size=4)
    before = llm.generate(PROMPTS, SAMPLED)
    with torch.no_grad():   # an optimizer step on the trainer's copy
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    after = llm.generate(PROMPTS, SAMPLED)
    _same(after, before)
    assert all(set(o.weight_versions) == {0} for o in after)
    assert _full_update(llm, model, 1) == 1
    pushed = llm.generate(PROMPTS, SAMPLED)
    assert all(set(o.weight_versions) == {1} for o in pushed)
    _same(pushed, LLM(model, block_size=4).generate(PROMPTS, SAMPLED))
    assert any(a.token_ids != b.token_ids for a, b in zip(pushed, before))


# --------------------------------------------------------------- B3: tiny temperatures = greedy
def test_tiny_temperature_is_greedy_in_the_sampler():
    logits = torch.randn(3, 61, generator=torch.Generator().manual_seed(0)) * 4
    for t in TINY_TEMPERATURES:
        temps = torch.tensor([t, 0.0, 1.0])
        out = process_logits(logits, temps, torch.full((3,), -1), torch.ones(3))
        assert torch.isfinite(out).all(), f"T={t}: non-finite processed logits"
        assert torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1])
    llm = LLM(tiny_engine_model(2), block_size=4, logprobs_mode="processed_logprobs")
    greedy = llm.generate(PROMPTS, GREEDY)
    for t in TINY_TEMPERATURES + [SAMPLING_EPS / 2]:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=t, max_tokens=8, logprobs=2,
                                                    seed=3, ignore_eos=True))
        _same(outs, greedy)
        assert all(o.sampling_params.temperature == 0.0 for o in outs)
        assert all(np.isfinite(o.logprobs).all() for o in outs)


def test_tiny_temperature_is_greedy_in_the_speculative_host_loop():
    model = tiny_engine_model(4)
    want = speculative_generate(model, PROMPTS, 8, k=3, draft_rounds=1).token_ids
    for t in TINY_TEMPERATURES:
        got = speculative_generate(model, PROMPTS, 8, k=3, draft_rounds=1, temperature=t,
                                   seed=5).token_ids
        assert got == want, f"T={t}"


@pytest.mark.parametrize("path", ["spec_decode", "spec_graph"])
def test_tiny_temperature_is_greedy_in_engine_speculation(path):
    engine = dict(block_size=4, logprobs_mode="processed_logprobs")
    if path == "spec_graph":
        engine.update(decode_path="static", fused_spec=True)
    else:
        engine.update(decode_path="gather")
    model = tiny_engine_model(5)
    llm = LLM(model, **engine)
    llm.set_proposer(DraftProposer(3, 1))
    assert (llm.llm_engine._spec._graph is not None) == (path == "spec_graph")
    greedy = llm.generate(PROMPTS, GREEDY)
    assert all(o.spec_stats is not None for o in greedy)
    for t in TINY_TEMPERATURES:
        sp = SamplingParams(temperature=t, max_tokens=8, logprobs=0, seed=1, ignore_eos=True)
        _same(llm.generate(PROMPTS, sp), greedy)


# ----------------------------------------------------- B4: exit-policy arguments, prompt ids
@pytest.mark.parametrize("policy,args,bad,valid", [
    ("fixed", {"dept": 2}, "dept", "depth"),
    ("trace", {"depths": [R, 1], "fallbak": 2}, "fallbak", "fallback"),
    ("lookahead", {"treshold": 0.3}, "treshold", "threshold"),
    ("q_exit", {"depth": 2}, "depth", "no per-request arguments"),
])
def test_unknown_exit_policy_args_are_refused_by_name(policy, args, bad, valid):
    llm = LLM(tiny_engine_model(0), block_size=4)
    sp = SamplingParams(max_tokens=4, exit_policy=policy, exit_policy_args=args)
    with pytest.raises(ValueError, match=f"'{bad}'") as err:
        llm.generate([PROMPTS[0]], sp)
    assert valid in str(err.value) and "exit_policy_args" in str(err.value)
    with pytest.raises(ValueError, match=f"'{bad}'"):
        llm.add_request("r", PROMPTS[0], sp)
    assert _idle(llm)


@pytest.mark.parametrize("policy,args,field", [
    ("fixed", {"depth": True}, "depth"),                 # ran at depth 1
    ("trace", {"depths": [R, True]}, "depths"),          # replayed [4, 1]
    ("trace", {"depths": [R, 2], "fallback": True}, "fallback"),
    ("lookahead", {"round": True}, "round"),
    ("lookahead", {"k": True}, "k"),
    ("lookahead", {"threshold": True}, "threshold"),
])
def test_bools_in_exit_policy_args_are_refused(policy, args, field):
    """B4: a bool passed as an int (True == 1) in exit_policy_args; prompt ids refuse bools."""
    llm = LLM(tiny_engine_model(0), block_size=4)
    sp = SamplingParams(max_tokens=4, exit_policy=policy, exit_policy_args=args)
    with pytest.raises(ValueError, match=rf"exit_policy_args\['{field}'\].*got True"):
        llm.generate([PROMPTS[0]], sp)
    assert _idle(llm)


@pytest.mark.parametrize("n", [10 ** 8, 2 ** 16 + 1, 10 ** 30])
def test_huge_n_is_refused_at_once_naming_the_limit(n):
    """B4: SamplingParams(n=10**8) hung add_request (2*10^5 samples: 5.8 s, 667 MB): each
    sample is a sequence with its own generator from add_request on."""
    from rltlab.engine.sampling import MAX_N
    assert MAX_N == 2 ** 16
    with pytest.raises(ValueError, match=rf"SamplingParams.n must be .*<= {MAX_N}.*got {n}"):
        SamplingParams(n=n)
    llm = LLM(tiny_engine_model(0), block_size=4)
    sp = SamplingParams(n=2, max_tokens=2)
    sp.n = n                            # set after construction: checked again on the way in
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"SamplingParams.n must be .*<= {MAX_N}"):
        llm.llm_engine.add_request("r", PROMPTS[0], sp)
    assert time.perf_counter() - t0 < 1.0
    assert _idle(llm)


def test_unknown_engine_level_exit_policy_args_are_refused_by_name():
    model = tiny_engine_model(0)
    with pytest.raises(ValueError, match="'depth'") as err:
        LLM(model, exit_policy="fixed", exit_policy_args={"depth": 2})
    assert "EngineConfig.exit_policy_args" in str(err.value)
    assert "SamplingParams.exit_policy_args" in str(err.value)   # where per-request ones go
    with pytest.raises(ValueError, match="'predictr'") as err:
        LLM(model, exit_policy="lookahead", exit_policy_args={"predictr": None})
    assert "'predictor'" in str(err.value)
    LLM(model, exit_policy="lookahead", exit_policy_args={"predictor": None})   # valid


@pytest.mark.parametrize("tokens,index", [
    ([0, 1.7], 1), ([2, 3.0], 1), (["1"], 0), ([True], 0), ([4, np.float32(2)], 1),
    ([5, -1], 1), ([5, 6, 61], 2), ([torch.tensor(1.5)], 0),
])
def test_bad_prompt_ids_are_refused_by_position_before_scheduling(tokens, index):
    llm = LLM(tiny_engine_model(0), block_size=4)
    with pytest.raises(ValueError, match=rf"prompt_token_ids\[{index}\]"):
        llm.llm_engine.add_request("r", tokens, GREEDY)
    assert _idle(llm)
    with pytest.raises(ValueError, match=rf"prompt_token_ids\[{index}\]"):   # rolled back
        llm.generate([PROMPTS[0], tokens], GREEDY)
    assert _idle(llm)

    async def via_async():
        engine = AsyncLLM(engine=llm.llm_engine)
        with pytest.raises(ValueError, match=rf"prompt_token_ids\[{index}\]"):
            await engine.generate_final(tokens, GREEDY)
    asyncio.run(via_async())
    assert _idle(llm)
    ok = [np.int64(5), torch.tensor(9), 3]   # integer types other than int are ids too
    assert llm.generate([ok], GREEDY)[0].prompt_token_ids == [5, 9, 3]


# ------------------------------------------------------------------------ D: weight updates
def _bad_chunk(model):
    name, param = next((n, p) for n, p in model.named_parameters() if "up_proj" in n)
    return [(name, param.detach().clone().fill_(float("nan")))]


def test_rejected_chunk_keeps_the_previous_version_serving():
    llm = LLM(tiny_engine_model(0), block_size=4)
    served = llm.generate(PROMPTS, SAMPLED)
    weights = _engine_params(llm)
    new = tiny_engine_model(1)
    llm.start_weight_update(1)
    with pytest.raises(WeightUpdateError, match="NaN"):
        llm.update_weights(_bad_chunk(new))
    _assert_engine_params(llm, weights, "after a rejected chunk")
    outs = llm.generate(PROMPTS, SAMPLED)   # still serving version 0
    _same(outs, served)
    assert llm.get_weight_version() == 0 and all(set(o.weight_versions) == {0} for o in outs)
    with pytest.raises(RuntimeError, match="abandoned"):   # the rejected update is over
        llm.finish_weight_update()
    assert _full_update(llm, new, 1) == 1
    _same(llm.generate(PROMPTS, SAMPLED), LLM(new, block_size=4).generate(PROMPTS, SAMPLED))


def test_multi_chunk_update_is_atomic_and_applied_only_on_finish():
    llm = LLM(tiny_engine_model(0), block_size=4)
    served = llm.generate(PROMPTS, SAMPLED)
    weights = _engine_params(llm)
    new = tiny_engine_model(1)
    chunks = _chunks(new)
    llm.start_weight_update(1)   # good chunk, then bad chunk: no mixed weights
    llm.update_weights(chunks[0])
    _assert_engine_params(llm, weights, "before finish_weight_update")
    with pytest.raises(WeightUpdateError):
        llm.update_weights(chunks[1][:1] + _bad_chunk(new))
    _assert_engine_params(llm, weights, "by a good chunk followed by a bad one")
    llm.start_weight_update(2)   # every chunk sent, no finish: nothing changes
    for chunk in chunks:
        llm.update_weights(chunk)
    _assert_engine_params(llm, weights, "by an update that was never finished")
    _same(llm.generate(PROMPTS, SAMPLED), served)
    assert llm.get_weight_version() == 0
    llm.start_weight_update(3)   # an incomplete finish is refused and changes nothing
    llm.update_weights(chunks[0])
    with pytest.raises(WeightUpdateError, match="missing"):
        llm.finish_weight_update()
    _assert_engine_params(llm, weights, "by an incomplete finish")
    _same(llm.generate(PROMPTS, SAMPLED), served)
    assert _full_update(llm, new, 4) == 4
    _same(llm.generate(PROMPTS, SAMPLED), LLM(new, block_size=4).generate(PROMPTS, SAMPLED))


def test_weight_versions_only_increase():
    llm = LLM(tiny_engine_model(0), block_size=4)
    assert _full_update(llm, tiny_engine_model(1), 26) == 26
    for stale in (0, 25, 26):
        with pytest.raises(WeightUpdateError, match="26"):
            llm.start_weight_update(stale)
    assert llm.get_weight_version() == 26
    with pytest.raises(RuntimeError):   # the refused start began nothing
        llm.update_weights(_chunks(tiny_engine_model(2))[0])
    assert all(o.weight_version == 26 for o in llm.generate(PROMPTS, SAMPLED))
    assert _full_update(llm, tiny_engine_model(2), 27) == 27


def test_async_shutdown_ends_every_consumer_and_frees_every_block():
    """AsyncLLM.shutdown() with consumers mid-generation: their generate never finished nor
    raised, and their requests kept their KV blocks. Now each raises, naming the shutdown, the
    block pool is full again, and the AsyncLLM refuses new requests."""
    from rltlab.engine.async_engine import EngineShutdown
    long = SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True)

    async def main():
        llm = AsyncLLM(tiny_engine_model(6), block_size=4)
        bm = llm.engine.block_manager

        async def stream(rid):
            return [out async for out in llm.generate(PROMPTS[0], long, rid)]

        tasks = [asyncio.create_task(llm.generate_final(PROMPTS[2], long, "final")),
                 asyncio.create_task(stream("streamed")),
                 asyncio.create_task(llm.generate_final(
                     PROMPTS[1], SamplingParams(n=3, max_tokens=200, ignore_eos=True), "n3"))]
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(t.done() for t in tasks) and bm.num_free_blocks < bm.num_blocks
        await llm.shutdown()
        done, pending = await asyncio.wait(tasks, timeout=10)
        assert not pending, "a consumer was stranded by shutdown"
        for task in tasks:
            with pytest.raises(EngineShutdown, match="shut down.*aborted"):
                task.result()
        assert bm.num_free_blocks == bm.num_blocks
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(EngineShutdown, match="shut down"):
            await llm.generate_final(PROMPTS[0], GREEDY)
        assert llm._task is None and bm.num_free_blocks == bm.num_blocks
        await llm.shutdown()                    # twice: nothing left to do

    asyncio.run(main())


def test_async_generate_in_flight_survives_a_rejected_chunk():
    model = tiny_engine_model(6)
    long = SamplingParams(temperature=1.0, seed=3, max_tokens=40, logprobs=0, ignore_eos=True)
    sync = LLM(model, block_size=4).generate([PROMPTS[2]], long)[0]

    async def main():
        llm = AsyncLLM(model, block_size=4)
        task = asyncio.create_task(llm.generate_final(PROMPTS[2], long, "in-flight"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()
        await llm.start_weight_update(1)
        with pytest.raises(WeightUpdateError):
            await llm.update_weights(_bad_chunk(tiny_engine_model(7)))
        out = await asyncio.wait_for(task, timeout=60)
        await llm.shutdown()
        return out

    out = asyncio.run(main())
    assert out.finish_reason == "length" and out.token_ids == sync.token_ids
    assert set(out.weight_versions) == {0}
