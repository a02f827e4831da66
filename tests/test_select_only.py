"""Select-only exit (issue 18 A3; docs/ouro.md, KV semantics, "How the public Hugging Face Ouro code
behaves") against a dense reference written from that description, fp32, CPU.

Select-only: every token computes all R rounds with full-depth K/V; the output of each position
comes from the first round whose CDF_r = 1 - prod_{j<=r} (1 - sigmoid(g_j)) reaches the
threshold (else round R), at every position, the last prompt position included.

The dense reference runs a plain full-depth forward (every round, no exits) over the whole
sequence, computes hazard / survival / CDF with torch ops here (not rltlab.model.gates), picks the
round per position and, for generation, recomputes the whole sequence at every step.
"""
import pytest
import torch

from rltlab.engine import LLM, EngineConfig, SamplingParams
from rltlab.model.generate import make_exit_fn
from tiny_models import ROUNDS as R, tiny_engine_model

torch.set_num_threads(1)
TOL = 1e-5
THRESHOLD = 0.6
EARLY_BIAS = -1.0   # gate bias: about 40-60% of positions select a round in 1..3 at THRESHOLD
# small blocks and chunks: prompts span several blocks and prefill chunks; the batch refills
MIXED = dict(block_size=4, prefill_chunk=5, max_num_seqs=3, max_num_batched_tokens=12)
PROMPTS = [[5, 17, 3, 40, 22, 9, 1], [33], [8, 8, 51, 2, 60, 14, 27, 36, 11, 4, 19, 45, 7],
           [12, 30], [59, 0, 23, 41, 16, 6, 28, 50, 3]]
MAX_TOKENS = 10


def gated_model(bias: float, seed: int = 3):
    model = tiny_engine_model(seed)
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(bias)
    return model


def dense_select(model, ids: list[int], threshold: float, depth: int | None = None):
    """-> (selected logits [T, V] fp32, selected rounds [T]) of the whole sequence ids.
    depth: the fixed rule (HF exit_at_step = depth - 1) instead of the threshold."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), all_logits=True)   # all R rounds, full depth
    logits = torch.stack(out.logits, dim=2)[0].float()     # [T, R, V]
    hazard = torch.sigmoid(out.gate_logits[0].float())      # [T, R]
    cdf = 1.0 - torch.cumprod(1.0 - hazard, dim=-1)
    rounds = []
    for t in range(len(ids)):
        chosen = R
        if depth is not None:
            chosen = depth
        elif threshold < 1.0:
            chosen = next((r for r in range(1, R) if cdf[t, r - 1] >= threshold), R)
        rounds.append(chosen)
    picked = logits[torch.arange(len(ids)), torch.tensor(rounds) - 1]
    return picked, rounds


def dense_greedy(model, prompt, max_tokens, threshold, depth=None):
    """Greedy decoding by recomputing the full sequence each step -> (tokens, logprobs, rounds)."""
    ids, tokens, logprobs, rounds = list(prompt), [], [], []
    for _ in range(max_tokens):
        logits, chosen = dense_select(model, ids, threshold, depth)
        logp = torch.log_softmax(logits[-1], -1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        rounds.append(chosen[-1])
        ids.append(token)
    return tokens, logprobs, rounds


def greedy_params(threshold=THRESHOLD, **kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True,
                          exit_threshold=threshold, **kw)


def select_only_llm(model, **kw):
    return LLM(model, exit_semantics="select_only", **{**MIXED, **kw})


@pytest.mark.parametrize("decode_path", ["gather", "static"])
def test_engine_greedy_equals_dense_reference_with_early_exits(decode_path):
    model = gated_model(EARLY_BIAS)
    outs = select_only_llm(model, decode_path=decode_path).generate(PROMPTS, greedy_params())
    early = total = 0
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs, rounds = dense_greedy(model, prompt, MAX_TOKENS, THRESHOLD)
        assert out.token_ids == tokens
        assert out.exit_depths == rounds            # the selected round, token 0 included
        assert out.executed_depths == [R] * MAX_TOKENS
        assert torch.tensor(out.logprobs).sub(torch.tensor(logprobs)).abs().max() < TOL
        early += sum(r < R for r in rounds)
        total += len(rounds)
    assert early / total > 0.2, (early, total)     # tokens really exit early
    assert any(out.exit_depths[0] < R for out in outs)   # ... the first token too


def test_fixed_rule_selects_its_depth_everywhere():
    model = gated_model(EARLY_BIAS)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True,
                            exit_policy="fixed", exit_policy_args={"depth": 2})
    outs = select_only_llm(model).generate(PROMPTS[:3], params)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs, rounds = dense_greedy(model, prompt, 6, 1.0, depth=2)
        assert out.token_ids == tokens and out.exit_depths == rounds == [2] * 6
        assert torch.tensor(out.logprobs).sub(torch.tensor(logprobs)).abs().max() < TOL


def test_teacher_forced_forward_equals_dense_reference():
    """The model's forward under select_only, with the threshold rule and with a rollout's
    recorded rounds (the recompute of a rollout), against the dense reference."""
    model = gated_model(EARLY_BIAS)
    outs = select_only_llm(model).generate(PROMPTS, greedy_params())
    for prompt, out in zip(PROMPTS, outs):
        ids = prompt + out.token_ids[:-1]
        logits, rounds = dense_select(model, ids, THRESHOLD)
        rule = make_exit_fn(R, threshold=THRESHOLD, min_loops=1)
        with torch.no_grad():
            res = model(torch.tensor([ids]), exit_fn=rule, exit_semantics="select_only")
        assert res.exit_rounds[0].tolist() == rounds
        assert (res.final_logits[0].float() - logits).abs().max() < TOL
        # recompute of the rollout: position P-1+i selects exit_depths[i]
        selected = [R] * (len(prompt) - 1) + out.exit_depths
        with torch.no_grad():
            res = model(torch.tensor([ids]), exit_rounds=torch.tensor([selected]),
                        exit_semantics="select_only")
        logp = torch.log_softmax(res.final_logits[0].float(), -1)[len(prompt) - 1:]
        chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (chosen - torch.tensor(out.logprobs)).abs().max() < TOL


def test_select_only_differs_from_last_exited_when_tokens_exit_early():
    model = gated_model(EARLY_BIAS)
    params = greedy_params(min_loops=1)
    select = select_only_llm(model).generate(PROMPTS, params)
    last = LLM(model, **MIXED).generate(PROMPTS, params)
    assert all(out.exit_depths[0] == R for out in last)    # LAST_EXITED: prefill at depth R
    assert any(out.exit_depths[0] < R for out in select)
    differs = 0
    for a, b in zip(select, last):
        differs += a.token_ids != b.token_ids or a.exit_depths != b.exit_depths or \
            max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
    assert differs >= 3, differs


@pytest.mark.parametrize("bias, threshold", [(30.0, 1.0), (-30.0, THRESHOLD)])
def test_select_only_equals_last_exited_when_no_token_exits_early(bias, threshold):
    """bias +30: survival underflows and the fp32 CDF is 1.0 from round 1, yet threshold 1.0
    never exits (rltlab's rule; the HF code in bf16 would select round 1). bias -30: the CDF
    never reaches the threshold."""
    model = gated_model(bias)
    params = greedy_params(threshold, min_loops=1)
    select = select_only_llm(model).generate(PROMPTS, params)
    last = LLM(model, **MIXED).generate(PROMPTS, params)
    for a, b, prompt in zip(select, last, PROMPTS):
        assert a.exit_depths == b.exit_depths == [R] * MAX_TOKENS
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        tokens, _, _ = dense_greedy(model, prompt, MAX_TOKENS, threshold)
        assert a.token_ids == tokens


def test_weight_update_mid_rollout_recomputes_at_full_depth():
    """After an update the generated tokens are recomputed with all R rounds (not at their
    selected rounds with last-exited copies): every token's log-prob is the select-only
    teacher-forced one under the weights of its version."""
    old, new = gated_model(EARLY_BIAS, seed=3), gated_model(EARLY_BIAS, seed=4)
    llm = select_only_llm(gated_model(EARLY_BIAS, seed=3))
    for i, prompt in enumerate(PROMPTS):
        llm.llm_engine.add_request(f"r{i}", prompt, greedy_params())
    outs = {}
    for _ in range(40):
        outs.update({o.request_id: o for o in llm.llm_engine.step()})
    llm.start_weight_update(1)
    llm.update_weights((n, p.detach()) for n, p in new.named_parameters())
    llm.finish_weight_update()
    while llm.llm_engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.llm_engine.step()})
    mixed = 0
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"r{i}"]
        mixed += len(set(out.weight_versions)) == 2
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        selected = torch.tensor([[R] * (len(prompt) - 1) + out.exit_depths])
        for version, model in ((0, old), (1, new)):
            with torch.no_grad():
                res = model(ids, exit_rounds=selected, exit_semantics="select_only")
            logp = torch.log_softmax(res.final_logits[0].float(), -1)[len(prompt) - 1:]
            ref = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            mine = [j for j, v in enumerate(out.weight_versions) if v == version]
            if mine:
                assert (ref[mine] - torch.tensor(out.logprobs)[mine]).abs().max() < TOL
    assert mixed >= 2, mixed


def test_policies_select_only_cannot_apply_are_refused():
    with pytest.raises(ValueError, match="exit_semantics"):
        EngineConfig(exit_semantics="select")
    with pytest.raises(ValueError, match="EngineConfig.exit_policy.*'lookahead'.*select_only"):
        LLM(tiny_engine_model(0), exit_semantics="select_only", exit_policy="lookahead")
    llm = select_only_llm(tiny_engine_model(0))
    engine = llm.llm_engine
    for name in ("trace", "q_exit_delayed", "lookahead"):
        with pytest.raises(ValueError, match=f"request 'bad'.*{name!r}.*select_only"):
            engine.add_request("bad", [1, 2], SamplingParams(
                exit_policy=name, exit_policy_args={"depths": [R]} if name == "trace" else {}))
        assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()


def test_model_forward_rejects_unknown_exit_semantics():
    model = tiny_engine_model(0)
    with pytest.raises(ValueError, match="exit_semantics"):
        model(torch.tensor([[1, 2]]), exit_semantics="hf")


def test_speculation_runs_only_where_select_only_outputs_are_full_depth():
    """A proposer speculates for threshold-1.0 requests (their selected round is R: the
    speculation target) and leaves early-selecting requests to the ordinary steps."""
    from rltlab.engine import DraftProposer
    model = gated_model(EARLY_BIAS)
    plain = select_only_llm(model).generate(PROMPTS[:3], greedy_params(1.0))
    llm = select_only_llm(model)
    llm.llm_engine.set_proposer(DraftProposer(2, 1))
    spec = llm.generate(PROMPTS[:3], greedy_params(1.0))
    assert all(out.spec_stats is not None for out in spec)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths == [R] * MAX_TOKENS
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOL)
    early = llm.generate(PROMPTS[:3], greedy_params())
    for prompt, out in zip(PROMPTS, early):
        assert out.spec_stats is None
        tokens, logprobs, rounds = dense_greedy(model, prompt, MAX_TOKENS, THRESHOLD)
        assert out.token_ids == tokens and out.exit_depths == rounds
