"""Versioned weight updates: validation before mutation, staged chunks applied only on finish
(a failed update leaves the previous version serving), no stale K/V."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams, WeightUpdateError
from rltlab.model.architecture import OuroForCausalLM
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4


def tiny_model(seed: int = 0) -> OuroForCausalLM:
    return tiny_engine_model(seed)


PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6, 26, 43]]
PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=0, ignore_eos=True,
                        exit_policy="q_exit", exit_threshold=0.6, min_loops=1)


def snapshot(llm):
    return {n: p.detach().clone() for n, p in llm.llm_engine.model.named_parameters()}


def full_update(llm, new_model, version, chunk=5):
    items = list(new_model.named_parameters())
    llm.start_weight_update(version)
    for i in range(0, len(items), chunk):
        llm.update_weights((n, p.detach()) for n, p in items[i: i + chunk])
    return llm.finish_weight_update()


def same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.exit_depths == y.exit_depths
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_update_equals_fresh_engine_and_keeps_addresses():
    llm = LLM(tiny_model(0), block_size=4)
    before = llm.generate(PROMPTS, PARAMS)
    assert all(o.weight_version == 0 for o in before)
    ptrs = {n: p.data_ptr() for n, p in llm.llm_engine.model.named_parameters()}
    new = tiny_model(1)
    assert full_update(llm, new, 5) == 5 and llm.get_weight_version() == 5
    assert {n: p.data_ptr() for n, p in llm.llm_engine.model.named_parameters()} == ptrs
    after = llm.generate(PROMPTS, PARAMS)
    fresh = LLM(tiny_model(1), block_size=4, weight_version=5).generate(PROMPTS, PARAMS)
    same(after, fresh)
    assert all(o.weight_version == 5 and set(o.weight_versions) == {5} for o in after)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before))
    assert llm.reset_prefix_cache() is True


@pytest.mark.parametrize("bad", ["unknown", "shape", "nan", "inf", "int", "dup"])
def test_bad_chunk_rejected_nothing_mutated_previous_version_keeps_serving(bad):
    llm = LLM(tiny_model(0), block_size=4)
    served = llm.generate(PROMPTS, PARAMS)
    new = dict(tiny_model(1).named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    good = new[name].detach()
    chunk = [("lm_head.weight", new["lm_head.weight"].detach())]
    chunk.append({"unknown": ("model.nope.weight", good), "shape": (name, good[:, :3]),
                  "nan": (name, good.clone().fill_(float("nan"))),
                  "inf": (name, good.clone().fill_(float("inf"))),
                  "int": (name, good.long()), "dup": ("lm_head.weight", good)}[bad])
    before = snapshot(llm)
    llm.start_weight_update(1)
    with pytest.raises(WeightUpdateError):
        llm.update_weights(chunk)
    for n, p in llm.llm_engine.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} was mutated by a rejected chunk"
    same(llm.generate(PROMPTS, PARAMS), served)   # version 0 keeps serving
    with pytest.raises(RuntimeError, match="abandoned"):
        llm.update_weights([chunk[0]])   # a rejected chunk ends the update
    assert llm.get_weight_version() == 0
    full_update(llm, tiny_model(1), 2)
    same(llm.generate(PROMPTS, PARAMS), LLM(tiny_model(1), block_size=4).generate(PROMPTS, PARAMS))


def test_incomplete_update_changes_nothing():
    llm = LLM(tiny_model(0), block_size=4)
    served = llm.generate(PROMPTS, PARAMS)
    items = list(tiny_model(1).named_parameters())
    llm.start_weight_update(3)
    llm.update_weights((n, p.detach()) for n, p in items[:-1])
    same(llm.generate(PROMPTS, PARAMS), served)   # staged, not applied: version 0 serves
    with pytest.raises(WeightUpdateError, match="missing"):
        llm.finish_weight_update()
    outs = llm.generate(PROMPTS, PARAMS)
    same(outs, served)
    assert llm.get_weight_version() == 0 and all(o.weight_version == 0 for o in outs)
    with pytest.raises(RuntimeError, match="missing"):   # the abandoned update is over
        llm.finish_weight_update()
    full_update(llm, tiny_model(1), 4)
    assert llm.generate(PROMPTS, PARAMS)[0].weight_version == 4


@pytest.mark.parametrize("decode_path", ["gather", "static"])
def test_update_mid_rollout_recomputes_kv_under_new_weights(decode_path):
    """Tokens after an in-flight update are exactly what the new weights give on the same
    prefix (teacher-forced recompute): no K/V from the old version is reused. The recomputed
    spans hold outputs at mixed exit depths, so their rows lose positions from round 2 on:
    on the static path they leave the fused prefill for the gather path."""
    old, new = tiny_model(0), tiny_model(1)
    llm = LLM(tiny_model(0), block_size=4, prefill_chunk=4, decode_path=decode_path)
    for i, p in enumerate(PROMPTS):
        llm.add_request(f"r{i}", p, PARAMS)
    for _ in range(14):
        llm.step()
    llm.pause_generation()
    full_update(llm, new, 9)
    llm.resume_generation()
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    mixed = 0
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"r{i}"]
        versions = out.weight_versions
        assert versions == sorted(versions) and set(versions) <= {0, 9}
        mixed += len(set(versions)) == 2
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        exits = torch.tensor([[R] * len(prompt) + out.exit_depths[1:]])
        for version, model in ((0, old), (9, new)):
            with torch.no_grad():
                logits = model(ids, exit_rounds=exits).final_logits[0].float()
            logp = torch.log_softmax(logits, -1)[len(prompt) - 1:]
            ref = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
            mine = [j for j, v in enumerate(versions) if v == version]
            if mine:
                got = torch.tensor([out.logprobs[j] for j in mine])
                assert (ref[mine] - got).abs().max() < 1e-5
    assert mixed >= 2
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_update_with_dtype_conversion_bf16_engine():
    trainer = tiny_model(1)
    llm = LLM(tiny_model(0), block_size=4, dtype="bfloat16")
    full_update(llm, trainer, 1)     # fp32 tensors copied into bf16 parameters
    engine_w = llm.llm_engine.model.lm_head.weight
    assert engine_w.dtype == torch.bfloat16
    assert torch.equal(engine_w, trainer.lm_head.weight.detach().to(torch.bfloat16))
