"""The fused prefill (rltlab.engine.fused_prefill): prefill chunks through the static decoder's
fused layer against the gather path, whole prompts' attention through SDPA against the paged
kernel, and the SDPA backends asked per prompt shape. fp32 on CPU (Triton kernels interpreted
where marked). Tolerance 1e-5 on log-probs and outputs."""
import pytest
import torch

from rltlab import kernels
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.fused_prefill import FusedPrefill
from test_engine_exactness import (MIXED, POLICIES, assert_same_rollouts, params_list,
                                   random_prompts)
from tiny_models import tiny_engine_model

torch.set_num_threads(1)


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.slow
def test_triton_fused_prefill_equals_gather_prefill():
    """Prefill chunks through the fused layer with the Triton kernels (RoPE + K/V write, fused
    norms, causal paged prefill attention), interpreted on CPU in fp32, against the same
    engine with prefill on the gather path: chunks that start mid-prompt, rows at every round."""
    model = tiny_engine_model(8)
    # 13, 1 and 9 tokens: chunks of 5 that start mid-prompt, a one-token prompt; 12 prefill
    # steps (4 prompts of 18, 15, 4 and 11 tokens took 28, each ~50 interpreted launches)
    prompts = random_prompts(3, seed=2)
    params = params_list(prompts, POLICIES["q_exit"], seed0=30)
    gather_llm = LLM(model, decode_path="static", fused_prefill=False, **MIXED)
    assert gather_llm.llm_engine.runner.prefill is None
    gather = gather_llm.generate(prompts, params)
    llm = LLM(model, decode_path="static", **MIXED)
    runner = llm.llm_engine.runner
    runner.prefill = FusedPrefill(runner.model, runner.static.layers, runner.kv_cache,
                                  triton=True)
    chunks, run = [], runner.prefill.run
    runner.prefill.run = lambda *a: chunks.extend(a[4]) or run(*a)
    assert_same_rollouts(gather, llm.generate(prompts, params))
    assert any(start > 0 for _, _, _, start in chunks)          # a later chunk of a prompt
    assert {plane for _, _, plane, _ in chunks} == {0, 1, 2, 3}


@pytest.mark.parametrize("after", [3, None])
def test_recurring_prompt_shapes_take_cudnn_attention_after_enough_rounds(monkeypatch, after):
    """A (chunks, length) shape of whole prompts asks for cuDNN first once it has run
    cudnn_prefill_after rounds, FlashAttention-2 before; None never, nor one prompt alone.
    The rollouts are the gather path's either way (on CPU the math backend runs whatever is
    asked)."""
    from rltlab.engine import fused_prefill

    asked = []
    real = fused_prefill.sdpa_kernel
    monkeypatch.setattr(fused_prefill, "sdpa_kernel",
                        lambda backends: asked.append(list(backends)) or real(backends))
    model = tiny_engine_model(8)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 60, (12,), generator=gen).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    engine_args = dict(max_num_seqs=2, block_size=4, cudnn_prefill_after=after)
    gather = LLM(model, decode_path="static", fused_prefill=False, **engine_args).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **engine_args)
    assert_same_rollouts(gather, llm.generate(prompts, params))
    layers = model.config.num_hidden_layers
    rounds = [asked[i] for i in range(0, len(asked), layers)]   # one SDPA call per layer
    assert llm.llm_engine.runner.prefill.shape_rounds[(2, 12)] == len(rounds) > 3, rounds
    firsts = [backends[0] for backends in rounds]
    if after is None:
        assert set(firsts) == {fused_prefill.SDPBackend.FLASH_ATTENTION}
    else:
        assert firsts == [fused_prefill.SDPBackend.FLASH_ATTENTION] * after + \
            [fused_prefill.SDPBackend.CUDNN_ATTENTION] * (len(rounds) - after)
    # one prompt at a time (c = 1): FlashAttention-2 however often its shape recurs
    asked.clear()
    llm = LLM(model, decode_path="static", **dict(engine_args, max_num_seqs=1))
    llm.generate(prompts, params)
    assert llm.llm_engine.runner.prefill.shape_rounds[(1, 12)] > 3
    assert {backends[0] for backends in asked} == {fused_prefill.SDPBackend.FLASH_ATTENTION}


@pytest.mark.parametrize("pad", [False, True])
def test_from_start_chunks_through_sdpa_equal_paged_attention(pad):
    """FusedPrefill._attend: chunks from position 0 go through SDPA in length groups on their
    fresh keys and values (two of one length apart in the step: an index; one alone: a slice),
    a chunk that starts mid-prompt through the paged kernel; every chunk's output equals
    paged_prefill_attention_ref's over the cache, which holds those same fresh keys (fp32,
    1e-5). pad: the three whole prompts (lengths 6, 5, 6) in one length bucket, one padded
    launch."""
    llm = LLM(tiny_engine_model(8), decode_path="static", max_num_seqs=4, block_size=4)
    runner = llm.llm_engine.runner
    prefill, cache = runner.prefill, runner.kv_cache
    gen = torch.Generator().manual_seed(4)
    cache.normal_(generator=gen)
    cfg = runner.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 6, 4], [8, 9, 10, 11], [12, 13, 14, 15]],
                          dtype=torch.int32)
    chunks = [(0, 6, 1, 0), (6, 5, 0, 0), (11, 6, 3, 0), (17, 3, 2, 6)]   # lo, n, plane, start
    q = torch.randn(20, heads, dim, generator=gen)
    k_fresh, v_fresh = (torch.randn(20, kv_heads, dim, generator=gen) for _ in range(2))
    for row, (lo, n, plane, start) in enumerate(chunks):   # the cache holds the fresh keys
        for pos in range(n * (start == 0)):
            block, offset = int(tables[row, pos // 4]), pos % 4
            cache[1, 0, plane, block, offset] = k_fresh[lo + pos]
            cache[1, 1, plane, block, offset] = v_fresh[lo + pos]
    plan = prefill._from_start_plan(chunks, torch.device("cpu"), pad)
    if pad:
        assert [(batch, padded is not None) for batch, _, padded in plan] == [((3, 6), True)]
    else:
        assert sorted(batch for batch, _, _ in plan) == [(1, 5), (2, 6)]
        assert {batch: isinstance(tokens, slice) for batch, tokens, _ in plan} == {
            (1, 5): True, (2, 6): False}
    got = prefill._attend(1, q, k_fresh, v_fresh, chunks, tables, 0.3, plan)
    for row, (lo, n, plane, start) in enumerate(chunks):
        want = kernels.paged_prefill_attention_ref(q[lo: lo + n], cache[1, 0], cache[1, 1],
                                                   plane, tables[row], start, 0.3)
        torch.testing.assert_close(got[lo: lo + n], want, rtol=1e-5, atol=1e-5)


# MIXED: chunked prefill and 3 slots for 7 requests, so admissions interleave with decoding and
# sequences drift out of phase (whole-token steps need every running sequence at a token
# boundary: only some steps qualify). IN_PHASE: every prompt prefilled in one step, so every
# decode token after the first takes a whole-token step.


def test_padded_prefill_attention_equals_one_launch_per_length(monkeypatch):
    """ExecutionConfig.pad_prefill_attention: whole prompts of different lengths (1-19 tokens,
    admitted three at a time) padded within their length bucket give the rollouts and the KV
    cache of one attention launch per length (fp32, 1e-5), and padded groups did run."""
    plan_of = FusedPrefill._from_start_plan
    padded_groups = []

    def spy(chunks, device, pad_lengths=False):
        plan = plan_of(chunks, device, pad_lengths)
        padded_groups.extend(batch for batch, _, padded in plan if padded is not None)
        return plan
    monkeypatch.setattr(FusedPrefill, "_from_start_plan", staticmethod(spy))
    model = tiny_engine_model(8)
    prompts = random_prompts(14, seed=21)
    params = params_list(prompts, POLICIES["q_exit"], seed0=50)
    engine_args = dict(decode_path="static", block_size=4, max_num_seqs=3,
                       max_num_batched_tokens=64, prefill_chunk=32)
    plain = LLM(model, **engine_args)
    want = plain.generate(prompts, params)
    assert not padded_groups
    padded = LLM(model, pad_prefill_attention=True, **engine_args)
    assert_same_rollouts(want, padded.generate(prompts, params))
    assert len(padded_groups) >= 4, padded_groups
    assert torch.allclose(plain.llm_engine.runner.kv_cache, padded.llm_engine.runner.kv_cache,
                          atol=1e-5, rtol=0)


def test_pad_prefill_attention_must_be_a_bool():
    from rltlab.engine import ExecutionConfig
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="pad_prefill_attention"):
            ExecutionConfig(pad_prefill_attention=bad)
