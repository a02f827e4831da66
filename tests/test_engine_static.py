"""The static decode path (fused projections, fixed buffers; CUDA graphs on a GPU) against the
gather path and the teacher-forced recompute, fp32 on CPU (torch reference kernels; the Triton
kernels themselves are checked in test_kernels.py). Tolerance 1e-5 on log-probs."""
import dataclasses

import pytest
import torch

from rltlab import kernels
from rltlab.bench.engine import main as bench_main
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.exit_policies import ExitPolicy, register_exit_policy
from rltlab.engine.static_decode import StaticDecoder
from test_engine_exactness import (MIXED, POLICIES, assert_same_rollouts,
                                   check_against_recompute, check_exit_oracle, params_list,
                                   random_prompts)
from tiny_models import tiny_engine_model, with_distinct_norms

torch.set_num_threads(1)


@pytest.mark.parametrize("name", sorted(POLICIES) + ["trace"])
def test_static_path_equals_gather_path_and_recompute(name):
    model = tiny_engine_model(5)
    prompts = random_prompts(8, seed=6)
    gen = torch.Generator().manual_seed(3)
    traces = [[4] + torch.randint(1, 5, (15,), generator=gen).tolist() for _ in prompts]
    policy = POLICIES.get(name) or (lambda i: dict(exit_policy="trace",
                                                   exit_policy_args={"depths": traces[i]}))
    params = params_list(prompts, policy, seed0=10)
    gather = LLM(model, decode_path="gather", **MIXED).generate(prompts, params)
    static_llm = LLM(model, decode_path="static", **MIXED)
    assert static_llm.llm_engine.runner.static is not None
    static = static_llm.generate(prompts, params)
    assert_same_rollouts(gather, static)
    check_against_recompute(model, prompts, static, greedy_rows=range(2, 8, 3))
    # both paths share the exit decisions' code: the exit rounds come from a separate oracle
    check_exit_oracle(model, prompts, static, name)


def test_static_engine_owns_fused_weights_and_updates_reach_them():
    model, other = tiny_engine_model(1), tiny_engine_model(2)
    prompts = random_prompts(4, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, exit_policy="q_exit",
                        exit_threshold=0.6, min_loops=1)
    llm = LLM(model, decode_path="static", max_num_seqs=4)
    engine = llm.llm_engine
    assert engine.model is not model    # the user's model keeps its own storage
    attn = engine.model.model.layers[0].self_attn
    storages = {p.weight.untyped_storage().data_ptr()
                for p in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(storages) == 1           # q/k/v are views of one fused weight
    engine.start_weight_update(1)
    engine.update_weights(list(other.named_parameters()))
    engine.finish_weight_update()
    after = llm.generate(prompts, sp)
    expected = LLM(other, decode_path="gather", max_num_seqs=4).generate(prompts, sp)
    assert_same_rollouts(expected, after)
    assert all(v == 1 for o in after for v in o.weight_versions)


def test_gate_free_policies_leave_the_gate_history_alone():
    """fixed / trace decide on the host: the engine never gathers gates for them."""
    model = tiny_engine_model(3)
    llm = LLM(model, decode_path="static", max_num_seqs=2)
    llm.generate(random_prompts(3, seed=4), SamplingParams(max_tokens=5, exit_policy="fixed"))
    assert not llm.llm_engine.exit_decider.gate_history.any()
    # seeded and without EOS: an unseeded draw could end all three rows at their first token
    llm.generate(random_prompts(3, seed=4), SamplingParams(max_tokens=5, exit_policy="q_exit",
                                                           seed=0, ignore_eos=True))
    assert llm.llm_engine.exit_decider.gate_history.any()


class _TooEager(ExitPolicy):
    """Breaks its lag promise: answers 'exit now' while claiming decision_lag 1."""
    name = "too_eager"
    decision_lag = 1

    def decide(self, info):
        return info.rounds.clone()


def test_lagged_policy_breaking_its_promise_fails_only_its_request():
    register_exit_policy("too_eager", lambda cfg: _TooEager(), overwrite=True)
    model = tiny_engine_model(4)
    llm = LLM(model, decode_path="static", max_num_seqs=4)
    prompts = random_prompts(2, seed=5)
    # Seeded, eos ignored: the outcome must not hinge on the global RNG (an unseeded draw of
    # eos once ended request 0 with "stop" before its broken promise was seen).
    outs = llm.generate(prompts, [SamplingParams(max_tokens=4, exit_policy="too_eager",
                                                 min_loops=1, seed=1, ignore_eos=True),
                                  SamplingParams(max_tokens=4, exit_policy="fixed", seed=2,
                                                 ignore_eos=True)])
    assert outs[0].finish_reason == "error" and "decision_lag" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


def test_static_decoder_rejects_more_rows_than_it_holds():
    llm = LLM(tiny_engine_model(0), decode_path="static", max_num_seqs=2)
    decoder: StaticDecoder = llm.llm_engine.runner.static
    with pytest.raises(ValueError, match="decode rows"):
        decoder.stage([1, 2, 3], [0, 0, 0], [5, 6, 7], [[0], [1], [2]])


def test_engine_benchmark_reports_every_mode_and_the_w4_gain():
    res = bench_main(["--preset", "tiny", "--device", "cpu", "--workload", "W1", "W3", "W4",
                      "--scale", "0.03", "--modes", "plain,gather,eager", "--kv-gib", "0.05"])
    w1 = res["workloads"]["W1"]["modes"]
    assert set(w1) == {"plain", "gather", "eager"}
    assert all(m["decode"]["decode_tok_s"] > 0 for m in w1.values())
    gain = res["w4_gain"]["eager"]
    assert gain["mean_executed_rounds"] < 4 and gain["ideal"] == round(
        4 / gain["mean_executed_rounds"], 3)
    w3, w4 = (res["workloads"][w]["modes"]["eager"]["decode"] for w in ("W3", "W4"))
    ratio = w4["decode_tok_s"] / w3["decode_tok_s"]   # formulas on known inputs:
    assert gain["gain"] == pytest.approx(ratio, abs=5e-4)   # test_bench_formulas
    assert gain["pct_of_ideal"] == pytest.approx(
        100 * ratio * w4["mean_executed_rounds"] / 4, abs=0.05 + 1e-9)
    assert res["workloads"]["W3"]["modes"]["eager"]["closed_loop"]["tokens"] > 0


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("fused_qkv_rope", [True, False])
@pytest.mark.parametrize("gemv_rows", [3])
@pytest.mark.slow
def test_triton_small_batch_rounds_equal_the_reference_rounds(fused_qkv_rope, gemv_rows,
                                                              monkeypatch):
    """The small-batch kernels (Triton GEMVs, RoPE + K/V write in the q/k/v GEMV or after it,
    paged attention) wired into the static decoder, interpreted on CPU in fp32, against the
    torch-reference decoder (every norm weight distinct); with gemv_rows = 3, rounds of 1..3
    rows (padding rows included) take them. (gemv_rows = GEMV_ROWS = 1 with max_num_seqs 1
    ran rounds of one row only, which these cases run too.)"""
    model = with_distinct_norms(tiny_engine_model(6))
    prompts = random_prompts(3, seed=8)
    params = [dataclasses.replace(p, max_tokens=m) for p, m in
              zip(params_list(prompts, POLICIES["q_exit"], seed0=20), (3, 4, 5))]
    engine_args = {**MIXED, "max_num_seqs": gemv_rows}
    reference = LLM(model, decode_path="static", **engine_args).generate(prompts, params)
    llm = LLM(model, decode_path="static", **engine_args)
    runner = llm.llm_engine.runner
    runner.static = StaticDecoder(runner.model, max_batch=runner.static.max_batch, triton=True,
                                  **{**runner._static_args, "fused_qkv_rope": fused_qkv_rope,
                                     "gemv_rows": gemv_rows})
    rows = []
    for name in ("small_m_linear", "rope_kv_linear"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda x, *a, _k=kernel, **kw:
                            rows.append(x.shape[0]) or _k(x, *a, **kw))
    assert_same_rollouts(reference, llm.generate(prompts, params))
    assert set(rows) == ({1} if gemv_rows == 1 else {1, 2, 3})


def test_gemv_rows_is_validated_and_reaches_the_decoder():
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="gemv_rows must be an int in 1..64"):
            LLM(tiny_engine_model(1), decode_path="static", gemv_rows=bad)
    llm = LLM(tiny_engine_model(1), decode_path="static", max_num_seqs=2, gemv_rows=5)
    runner = llm.llm_engine.runner
    # with the Triton kernels (CUDA, or forced as here) rounds of up to 5 rows take the GEMVs
    decoder = StaticDecoder(runner.model, max_batch=8, **{**runner._static_args, "triton": True})
    assert decoder._small_rows == 5
    off = StaticDecoder(runner.model, max_batch=8, **{**runner._static_args, "triton": True,
                                                      "small_batch_kernels": False})
    assert off._small_rows == 0


IN_PHASE = dict(block_size=4, prefill_chunk=64, max_num_seqs=8, max_num_batched_tokens=256)


def round_and_whole_token_runs(model, prompts, params, engine_args):
    """The same requests through the round-per-step engine and the whole-token one (one token per
    step: token windows, tests/test_token_window.py, off) -> (round-step outputs, whole-token
    outputs, the whole-token engine's run_token calls as (rows, depth): one int, or one depth
    per row)."""
    rounds = LLM(model, decode_path="static", fused_tokens=False, **engine_args).generate(
        prompts, params)
    llm = LLM(model, decode_path="static", **{"token_window": 0, **engine_args})
    runner, calls = llm.llm_engine.runner, []
    run_token = runner.run_token
    runner.run_token = lambda seqs, d, **kw: (calls.append((len(seqs), d))
                                              or run_token(seqs, d, **kw))
    return rounds, llm.generate(prompts, params), calls


@pytest.mark.parametrize("depth", [4, 3, 2])
@pytest.mark.parametrize("config", ["mixed", "in_phase"])
def test_whole_token_steps_equal_round_steps_and_recompute(depth, config):
    """Fixed-depth decoding through FusedTokenStep (every round of a token in one launch,
    LAST_EXITED copies when depth < R) equals the round-per-step engine and the recompute."""
    model = tiny_engine_model(7)
    prompts = random_prompts(7, seed=9)
    params = [SamplingParams(temperature=(0.0, 0.8)[i % 2], seed=i, max_tokens=4 + i % 5,
                             logprobs=1, exit_policy="fixed", exit_policy_args={"depth": depth})
              for i in range(len(prompts))]
    rounds, whole, calls = round_and_whole_token_runs(
        model, prompts, params, MIXED if config == "mixed" else IN_PHASE)
    assert calls and all(d == depth for _, d in calls)
    if config == "in_phase":   # every decode token (all but the first of each request)
        assert sum(n for n, _ in calls) == sum(len(o.outputs[0].token_ids) - 1 for o in whole)
    assert_same_rollouts(rounds, whole)
    assert all(d == depth for o in whole for d in o.exit_depths[1:])
    check_against_recompute(model, prompts, whole, greedy_rows=range(0, 7, 2))


@pytest.mark.parametrize("config", ["mixed", "in_phase"])
@pytest.mark.parametrize("policy", ["trace", "fixed"])
def test_whole_token_steps_with_mixed_depths_equal_round_steps(config, policy):
    """Rows at different host-fixed depths (an exit replay, or requests at different fixed
    depths) take whole-token steps too, deepest first with each round over the rows still
    going; tokens, log-probs and exit depths equal the round-per-step engine's and the
    recompute."""
    model = tiny_engine_model(7)
    prompts = random_prompts(7, seed=12)
    gen = torch.Generator().manual_seed(5)
    traces = [[4] + torch.randint(1, 5, (12,), generator=gen).tolist() for _ in prompts]
    params = [SamplingParams(temperature=(0.0, 0.8)[i % 2], seed=i, max_tokens=5 + i % 4,
                             logprobs=1, ignore_eos=True, **(
                                 dict(exit_policy="trace", exit_policy_args={
                                     "depths": traces[i], "fallback": 2}) if policy == "trace"
                                 else dict(exit_policy="fixed",
                                           exit_policy_args={"depth": 1 + i % 4})))
              for i in range(len(prompts))]
    rounds, whole, calls = round_and_whole_token_runs(
        model, prompts, params, MIXED if config == "mixed" else IN_PHASE)
    assert_same_rollouts(rounds, whole)
    assert any(isinstance(d, list) and len(set(d)) > 1 for _, d in calls), calls
    for i, out in enumerate(whole):
        expected = (traces[i] + [2] * 20 if policy == "trace" else [4] + [1 + i % 4] * 20)
        assert out.exit_depths[1:] == expected[1: len(out.exit_depths)]
    check_against_recompute(model, prompts, whole, greedy_rows=range(0, 7, 2))


def test_ragged_whole_token_equals_one_depth_at_a_time():
    """StaticDecoder.run_token_ragged over rows at depths 4, 3, 3, 1 gives each row the state
    (and, after the LAST_EXITED copies, the K/V planes) that run_token at its own depth gives."""
    llm = LLM(tiny_engine_model(9), decode_path="static", max_num_seqs=4, block_size=4)
    runner = llm.llm_engine.runner
    decoder: StaticDecoder = runner.static
    gen = torch.Generator().manual_seed(2)
    embeddings = torch.randn(4, decoder.config.hidden_size, generator=gen)
    positions, slots = [5, 2, 7, 3], [5, 10, 31, 19]   # block_table[pos // 4] * 4 + pos % 4
    tables = [[0, 1], [2, 3], [6, 7], [4, 5]]
    depths = [4, 3, 3, 1]
    decoder.kv_cache.normal_(generator=gen)   # context K/V for every position
    start = decoder.kv_cache.clone()
    decoder.stage(positions, [0] * 4, slots, tables)
    ragged = decoder.run_token_ragged(embeddings, depths)
    runner.last_exited_copy([19], [1])
    runner.last_exited_copy([10, 31], [3, 3])
    ragged_cache = decoder.kv_cache.clone()
    for i, d in enumerate(depths):
        decoder.kv_cache.copy_(start)
        decoder.stage([positions[i]], [0], [slots[i]], [tables[i]])
        alone = decoder.run_token(embeddings[i: i + 1], d)
        if d < 4:
            runner.last_exited_copy([slots[i]], [d])
        torch.testing.assert_close(ragged[i: i + 1], alone, rtol=1e-5, atol=1e-5)
        flat = decoder.kv_cache.view(*decoder.kv_cache.shape[:3], -1, *decoder.kv_cache.shape[-2:])
        ragged_flat = ragged_cache.view_as(flat)
        torch.testing.assert_close(ragged_flat[:, :, :, slots[i]], flat[:, :, :, slots[i]],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="deepest first"):
        decoder.run_token_ragged(embeddings, [1, 3, 3, 4])


def test_whole_token_steps_wait_for_observers_and_gate_policies():
    model = tiny_engine_model(8)
    llm = LLM(model, decode_path="static", max_num_seqs=2)
    engine = llm.llm_engine
    run_token, calls = engine.runner.run_token, []
    engine.runner.run_token = lambda seqs, d, **kw: calls.append(d) or run_token(seqs, d, **kw)
    prompts = random_prompts(2, seed=3)
    handle = engine.add_round_observer(lambda event: None)
    llm.generate(prompts, SamplingParams(max_tokens=5, exit_policy="fixed",
                                         exit_policy_args={"depth": 4}))
    engine.remove_round_observer(handle)
    llm.generate(prompts, SamplingParams(max_tokens=5, exit_policy="q_exit"))
    assert calls == []
    mixed = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_policy=name,
                            **({"exit_policy_args": {"depth": 3}} if name == "fixed" else {}))
             for name in ("fixed", "q_exit")]
    llm.generate(prompts, mixed)   # one row's depth is the gate's: the pair steps round by round
    assert all(d == 3 for d in calls), calls   # whole tokens only once the q_exit row is done


def test_whole_token_run_is_idempotent_as_graph_capture_needs():
    """A CUDA-graph capture first runs the token twice as a warm-up: running it again must
    give the same state and leave the same K/V (the token reads only its own input buffer)."""
    llm = LLM(tiny_engine_model(9), decode_path="static", max_num_seqs=2, block_size=4)
    decoder: StaticDecoder = llm.llm_engine.runner.static
    decoder.stage([5, 2], [0, 0], [5, 10], [[0, 1], [2, 3]])
    gen = torch.Generator().manual_seed(0)
    embeddings = torch.randn(2, decoder.config.hidden_size, generator=gen)
    first = decoder.run_token(embeddings, 3)
    cache = decoder.kv_cache.clone()
    decoder._token(2, 3)   # what the warm-up does, without copying the input in again
    again = decoder.run_token(embeddings, 3)
    assert torch.equal(first, decoder.hidden_out[:2]) and torch.equal(first, again)
    assert torch.equal(cache, decoder.kv_cache)
    assert cache[:, :, :3].abs().sum() > 0 and not cache[:, :, 3].any()   # planes 1..3 only


def test_sequences_out_of_phase_are_held_until_whole_tokens_line_up():
    """Prefills finish 4 rounds apart; at depth 3 the decoding sequences would never all sit at
    a token boundary together. Holding the ones at a boundary (fewer than 3 steps) lines them
    up, so most tokens still take whole-token steps, with the round-step engine's tokens."""
    model = tiny_engine_model(10)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 30, (12,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0,
                            exit_policy="fixed", exit_policy_args={"depth": 3})
    staggered = dict(block_size=4, prefill_chunk=12, max_num_seqs=4, max_num_batched_tokens=24)
    rounds, whole, calls = round_and_whole_token_runs(model, prompts, params, staggered)
    rows = [n for n, _ in calls]
    assert_same_rollouts(rounds, whole)
    assert sum(rows) >= 0.75 * 4 * 9 and max(rows) == 4


@pytest.mark.parametrize("fused_prefill", [True, False])
def test_step_batches_reach_the_device_without_blocking_copies(monkeypatch, fused_prefill):
    """ModelRunner.prepare sends a step's index tensors with tensor_to_device / to_device
    (pinned, non-blocking on CUDA): a plain .to(cuda) of pageable memory blocks the host until
    the device has run everything queued, and the host then builds the next step while the
    device idles (11% of a W3 prefill on the H200). Here, on the CPU, the runner is told its
    device is CUDA: any other host -> device copy fails."""
    from rltlab.engine import model_runner

    llm = LLM(tiny_engine_model(3), decode_path="static", fused_prefill=fused_prefill,
              max_num_seqs=4, block_size=4, max_num_batched_tokens=64, prefill_chunk=8)
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(3, seed=5)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2))
    seqs = engine.scheduler.schedule()
    copies = []
    monkeypatch.setattr(model_runner, "tensor_to_device",
                        lambda tensor, device: copies.append(device) or tensor)
    monkeypatch.setattr(model_runner, "to_device", lambda values, dtype, device:
                        copies.append(device) or torch.tensor(values, dtype=dtype))
    monkeypatch.setattr(engine.runner, "device", torch.device("cuda"))
    batch = engine.runner.prepare(seqs)
    assert (batch.chunks is not None) == fused_prefill
    assert len(copies) >= 6 and {device.type for device in copies} == {"cuda"}


def test_the_exit_gate_runs_only_where_its_logits_are_read():
    """Fixed-depth decoding (token windows, whole tokens) reads no gate logits, and a whole
    prompt step reads only its last round's: the gate runs once a prompt whatever the output
    length. A policy that reads the gates (q_exit) still gets one per decode round."""
    llm = LLM(tiny_engine_model(4), decode_path="static", max_num_seqs=1)
    calls = []
    llm.llm_engine.runner.model.model.early_exit_gate.register_forward_hook(
        lambda *_: calls.append(1))
    prompt = random_prompts(1, seed=5)
    counts = {}
    for tokens in (2, 9):
        for policy in ("fixed", "q_exit"):
            calls.clear()
            llm.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                exit_policy=policy))
            counts[policy, tokens] = len(calls)
    assert counts["fixed", 2] == counts["fixed", 9] == 1, counts
    assert counts["q_exit", 9] > counts["q_exit", 2] + 7, counts
