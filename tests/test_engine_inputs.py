"""What LLM.generate / AsyncLLM.generate are given is checked up front (rltlab.engine.inputs):
one ValueError line naming the field, not a KeyError('prompt_token_ids') or "got str" for a
dict of settings. Tiny random model, CPU."""
import asyncio

import pytest
import torch

from rltlab.engine import LLM, AsyncLLM, SamplingParams
from rltlab.engine.inputs import check_prompts, check_sampling_params
from tiny_models import tiny_engine_model

P = [3, 14, 15, 9]
SP = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.mark.parametrize("prompts", [
    "hi", P, tuple(P), torch.tensor(P), {"prompt_token_ids": P},
    {"prompt_token_ids": P, "prompt": "text"}, ["hi", P, {"prompt_token_ids": P}], [], [[1]]])
def test_good_prompts_pass(prompts):
    check_prompts(prompts)


@pytest.mark.parametrize("prompts, message", [
    ([{"prompt": "hi"}], r"^prompts\[0\]: a dict prompt needs 'prompt_token_ids'"),
    ({"prompt": "hi"}, r"^prompts: a dict prompt needs 'prompt_token_ids'"),
    ([P, {"prompt_tokens": P}], r"^prompts\[1\]: unknown key\(s\) 'prompt_tokens'"),
    ([{"prompt_token_ids": 5}], r"prompts\[0\]\['prompt_token_ids'\] must be a list of token "
                                r"ids, got int"),
    ([{"prompt_token_ids": P, "prompt": 3}], r"prompts\[0\]\['prompt'\] must be"),
    ([P, 3.5], r"^prompts\[1\] must be a str, a list of token ids .*got float"),
    (None, r"^prompts must be a prompt or a list of prompts, got NoneType"),
    (torch.tensor([P]), r"^prompts: a tensor prompt must be 1-D"),
])
def test_bad_prompts_are_named_in_one_line(prompts, message):
    with pytest.raises(ValueError, match=message) as err:
        check_prompts(prompts)
    assert "\n" not in str(err.value)


def test_sampling_params_checks_name_the_field():
    for ok in (None, SP, [SP, SP], (SP,)):
        check_sampling_params(ok)
    check_sampling_params([SP, SP], 2)
    cases = [({"max_tokens": 2}, r"^sampling_params must be SamplingParams, got a dict "
                                 r"\(max_tokens\): pass SamplingParams\(\*\*settings\)"),
             ("greedy", r"^sampling_params must be SamplingParams or a list .*got str"),
             ([SP, {"max_tokens": 2}], r"^sampling_params\[1\] must be SamplingParams, got dict"),
             ([SP, 5], r"^sampling_params\[1\] must be SamplingParams, got int$")]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            check_sampling_params(params)
    with pytest.raises(ValueError, match=r"sampling_params: 2 for 3 prompts"):
        check_sampling_params([SP, SP], 3)
    with pytest.raises(ValueError, match="one SamplingParams"):
        check_sampling_params([SP], single=True)


def test_async_generate_checks_its_prompt_and_params():
    async def main():
        llm = AsyncLLM(tiny_engine_model(0), block_size=4)
        with pytest.raises(ValueError, match=r"^prompt: a dict prompt needs 'prompt_token_ids'"):
            await llm.generate_final({"prompt": "hi"}, SP)
        with pytest.raises(ValueError, match=r"^sampling_params must be SamplingParams, got a "
                                             r"dict \(max_tokens\)"):
            await llm.generate_final(P, {"max_tokens": 2})
        out = await llm.generate_final(torch.tensor(P), SP)    # a 1-D tensor of ids is a prompt
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        await llm.shutdown()
        return out

    assert len(asyncio.run(main()).outputs[0].token_ids) == 2


def test_llm_generate_names_the_field_in_one_line():
    llm = LLM(tiny_engine_model(0), block_size=4)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: a dict prompt needs 'prompt_token_ids'"):
        llm.generate([{"prompt": "hi"}], SP)
    with pytest.raises(ValueError, match=r"^sampling_params must be SamplingParams, got a dict"):
        llm.generate([P], {"max_tokens": 2})
    assert not llm.llm_engine.has_unfinished_requests()
