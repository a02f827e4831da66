"""The loop's deployment (rltlab.loop.deploy, rltlab.loop.relabel) and its gate labels
(rltlab.loop.stage2), tested without running the notebook: on-policy traces reproduce the
engine's own states of a rollout whose tokens exit early, and their counterfactual rounds are the
rounds that token alone would have run; the Stage II label kinds; the gate training on
the model's device; the resume check for fields an older iteration did not record."""
import pytest
import torch

from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)


def _early_exit_rollout(model, n=6, threshold=0.3):
    """A LAST_EXITED rollout whose decode tokens exit at mixed rounds (q_exit, min_loops 1)."""
    from rltlab.engine import LLM, SamplingParams

    prompts = random_prompts(n, seed=3, min_len=3, max_len=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_loops=1, exit_policy="q_exit",
                            exit_threshold=threshold)
    llm = LLM(model)
    outs = llm.generate(prompts, params)
    return llm, prompts, params, outs


def test_on_policy_records_reproduce_the_rollout_and_its_counterfactual_rounds(tmp_path):
    from rltlab.loop.relabel import all_round_states, on_policy_records
    from rltlab.traces import TraceCollector, load_traces, stats_from_logprobs

    model = tiny_engine_model(0)
    R = model.config.num_rounds
    llm, prompts, params, outs = _early_exit_rollout(model)
    depths = [d for o in outs for d in o.outputs[0].exit_depths[1:]]
    assert min(depths) < R and max(depths) == R, depths     # the rollout does exit early
    recs = on_policy_records(model, outs, list(range(len(prompts))))
    assert len(recs) == len(depths)
    # statistics in chunks of 3 tokens' logits (the 1.4B shape's bound on memory) change nothing
    chunked = on_policy_records(model, outs, list(range(len(prompts))),
                                stats_chunk_bytes=3 * R * model.config.vocab_size * 4)
    for a, b in zip(recs, chunked):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(b[key], value, atol=1e-6, rtol=1e-6)
            else:
                assert b[key] == value
    # the engine's own (non-teacher) trace of the same rollout: its executed rounds
    with TraceCollector(llm, tmp_path / "engine", teacher=False) as col:
        again = col.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    eng = load_traces(tmp_path / "engine")
    order = sorted(range(len(eng["token"])), key=lambda j: (int(eng["prompt_id"][j]),
                                                            int(eng["position"][j])))
    eng = {k: v[order] for k, v in eng.items()}
    assert len(eng["token"]) == len(recs)
    for i, rec in enumerate(recs):       # both sorted by (prompt id, position)
        e = int(eng["executed"][i])
        assert rec["position"] == int(eng["position"][i]) and rec["selected"] == e
        assert rec["token"] == int(eng["token"][i]) and rec["executed"] == R
        torch.testing.assert_close(rec["hidden"][:e], eng["hidden"][i, :e].float(),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(rec["gate_logit"][:e], eng["gate_logit"][i, :e],
                                   atol=2e-5, rtol=1e-4)
        assert bool(rec["round_mask"].all())
    # a counterfactual round = that one position running on, everything before it as rolled out
    out = next(o for o in outs if min(o.outputs[0].exit_depths[1:]) < R)
    comp = out.outputs[0]
    ids = list(out.prompt_token_ids) + comp.token_ids[:-1]
    exits = [R] * len(out.prompt_token_ids) + comp.exit_depths[1:]
    i = next(p for p in range(len(out.prompt_token_ids), len(ids)) if exits[p] < R)
    brute = model(torch.tensor([ids[:i + 1]]), exit_rounds=torch.tensor([exits[:i] + [R]]),
                  logits=False)
    h, g = all_round_states(model, torch.tensor([ids]), torch.tensor([exits]),
                            torch.ones(1, len(ids), dtype=torch.bool))
    for r in range(R):
        torch.testing.assert_close(h[0, i, r], brute.hidden_states[r][0, i], atol=2e-5,
                                   rtol=1e-4)
    torch.testing.assert_close(g[0, i], brute.gate_logits[0, i], atol=2e-5, rtol=1e-4)
    # the per-round statistics are the collector's (rltlab.traces.stats)
    rec = next(r for r in recs if r["selected"] < R)
    logp = torch.log_softmax(model.lm_head(rec["hidden"]).float(), -1)
    ref = stats_from_logprobs(logp, rec["gate_logit"])
    for key in ("top1_id", "top1_prob", "margin", "entropy", "logprob_ref", "kl_ref", "cdf"):
        torch.testing.assert_close(rec[key], ref[key], atol=1e-5, rtol=1e-4)
    assert rec["ref_token"] == int(ref["ref_token"])


def test_on_policy_traces_are_read_as_teacher_traces(tmp_path):
    """The predictor's data loader and Stage II take them: every round of every token, the
    deployed policy's exit round in `selected`."""
    from rltlab.exit_predictor.train import load_training_data
    from rltlab.loop.relabel import write_on_policy_traces
    from rltlab.model.checkpoint import model_hash

    model = tiny_engine_model(0)
    _, prompts, _, outs = _early_exit_rollout(model)
    manifest = write_on_policy_traces(model, outs, list(range(len(prompts))), tmp_path / "t",
                                      policy="q_exit t=0.3")
    assert manifest["info"]["teacher"] is True and manifest["info"]["on_policy"]["policy"]
    assert manifest["info"]["model_hashes"] == {"0": model_hash(model)}
    tr, info = load_training_data(tmp_path / "t")
    assert info["model_hash"] == model_hash(model)
    depths = sorted(d for o in outs for d in o.outputs[0].exit_depths[1:])
    assert sorted(tr["executed"].tolist()) == [4] * len(depths)
    from rltlab.traces import load_traces
    assert sorted(load_traces(tmp_path / "t", fields=["selected"])["selected"].tolist()) == depths


def test_gate_labels():
    """The paper's label credits round r with the gain round r made; "remaining" labels the
    decision after round r with what the rounds after it can still gain; the default takes the
    larger of the two. A token whose rounds 1-2 are equally wrong and round 3 right: the
    paper's labels say exit after rounds 1 and 2."""
    from rltlab.loop.stage2 import stage2_targets

    ce = torch.tensor([[2.0, 2.0, 0.5, 0.1],     # rounds 3 and 4 still gain
                       [0.1, 0.1, 0.1, 0.1],     # nothing to gain anywhere
                       [1.0, 2.0, 0.5, 3.0]])    # round 3 is the best
    paper = stage2_targets(ce, label="stage2")
    remaining = stage2_targets(ce, label="remaining")
    low, high = torch.sigmoid(torch.tensor(-0.25)), torch.sigmoid(torch.tensor(50 * 1.495))
    assert paper[0, :2].tolist() == pytest.approx([float(low)] * 2)       # "exit" after r1, r2
    assert remaining[0].tolist() == pytest.approx([1.0, 1.0, 1.0, float(low)], abs=1e-6)
    assert remaining[1].tolist() == pytest.approx([float(low)] * 4)
    assert remaining[2].tolist() == pytest.approx([float(high), 1.0, float(low), float(low)],
                                                  abs=1e-6)
    either = stage2_targets(ce, label="stage2_or_remaining")
    torch.testing.assert_close(either, torch.maximum(paper, remaining))
    assert either[0, :2].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)   # the digit stays
    with pytest.raises(ValueError, match="gate label"):
        stage2_targets(ce, label="paper")


def test_gate_trains_on_the_given_device_with_the_same_steps():
    """train_gate draws its minibatches on the CPU, so the steps are the device's own only in
    the arithmetic; the returned state is on the CPU (saved and pushed as it is)."""
    from rltlab.loop import train_gate

    gen = torch.Generator().manual_seed(0)
    gate = torch.nn.Linear(8, 1)
    h = torch.randn(64, 4, 8, generator=gen)
    ce = torch.rand(64, 4, generator=gen) * torch.tensor([2.0, 1.0, 0.9, 0.9])
    a = train_gate(gate, h, ce, steps=20, lr=0.05, batch=16, label="remaining", device="cpu")
    b = train_gate(gate, h.double(), ce, steps=20, lr=0.05, batch=16, label="remaining",
                   device=torch.device("cpu"))
    assert a["label"] == "remaining" and all(v.device.type == "cpu" for v in a["state"].values())
    for name in a["state"]:
        torch.testing.assert_close(a["state"][name], b["state"][name])
    if torch.cuda.is_available():
        c = train_gate(gate, h, ce, steps=20, lr=0.05, batch=16, label="remaining",
                       device="cuda")
        for name in a["state"]:
            torch.testing.assert_close(a["state"][name], c["state"][name], atol=1e-4,
                                       rtol=1e-3)


def test_resume_reads_a_missing_field_as_what_the_iteration_ran_with(tmp_path):
    """An iteration recorded before gate_label / deploy_components existed ran the paper's
    labels without deployment: resuming it with the new defaults is refused by name."""
    import json
    from dataclasses import asdict
    from rltlab.loop import LoopConfig, ResumeMismatch, check_resume

    old = {k: v for k, v in json.loads(json.dumps(asdict(LoopConfig()))).items()
           if k not in ("gate_label", "deploy_components")}
    res = [{"iteration": 0, "config": old}]
    with pytest.raises(ResumeMismatch) as err:
        check_resume(tmp_path, LoopConfig(), res)
    assert "GATE_LABEL: 'stage2'" in str(err.value) and "DEPLOY_COMPONENTS: False" in str(err.value)
    check_resume(tmp_path, LoopConfig(gate_label="stage2", deploy_components=False), res)


@pytest.mark.slow
def test_default_gate_label_passes_where_the_papers_fails(tmp_path):
    """On the embedded model's k-hop rollout (teacher mode, version 0), the paper's Stage II
    candidate fails the validation curve check (it sends the answer digit out at round 2) and
    the default labels' candidate passes it: the main job's gate update, in miniature."""
    from rltlab.engine import LLM
    from rltlab.loop import LoopConfig, rollout_problems, train_gate_on_traces
    from rltlab.model.checkpoint import load_model
    from rltlab.traces.rollout import collect_rollout_traces

    model, tok, _ = load_model(None, device="cpu", threads=1)
    cfg = LoopConfig(rollout_prompts=64, rollout_hops_share=1.0, max_tokens=4,
                     thresholds=(0.1, 0.2, 0.3, 0.5, 0.7, 1.0), gate_generation_check=False)
    assert cfg.gate_label == "stage2_or_remaining"
    prompts, _ = rollout_problems(tok, cfg, 0)
    collect_rollout_traces(LLM(model, tok, max_model_len=256), prompts, tmp_path / "t",
                           threshold=0.5, max_tokens=4, teacher=True, min_loops=1)
    default = train_gate_on_traces(model, tmp_path / "t", cfg)
    assert default["accepted"] and not default["reasons"], default["reasons"]
    ref = default["stage2_reference"]          # the paper's labels on the same split
    assert ref["no_worse"] is False and ref["worst_point"]["diff_pp"] < -5
    cfg.gate_label = "stage2"
    paper = train_gate_on_traces(model, tmp_path / "t", cfg)
    assert not paper["accepted"] and "curve worse" in paper["reasons"][0]
    assert "stage2_reference" not in paper


def test_generation_check_takes_at_most_gate_check_problems(monkeypatch):
    """The candidate's check in generation runs on the lowest validation prompt ids, at most
    LoopConfig.gate_check_problems of them (None: all), through the engine it is given."""
    from rltlab.loop import LoopConfig, gate_check

    seen = {}

    def fake(model, tokenizer, candidate, problems, cfg, llm=None):
        seen.update(problems=list(problems), llm=llm)
        return {"no_worse": True, "worst_point": None, "points": [], "n": len(problems), "z": 2}
    monkeypatch.setattr(gate_check, "check_in_generation", fake)
    rolled = [{"question": f"q{i}"} for i in range(50)]
    trained = {"validation_passed": True, "accepted": True, "reasons": [], "state": {},
               "candidate_state": {}, "val_prompt_ids": list(range(0, 50, 2))}
    gate_check.judge_in_generation(trained, None, None, rolled, LoopConfig(gate_check_problems=4),
                                   llm=lambda: "engine")
    assert [p["question"] for p in seen["problems"]] == ["q0", "q2", "q4", "q6"]
    assert seen["llm"] == "engine" and trained["accepted"]
    gate_check.judge_in_generation(trained, None, None, rolled,
                                   LoopConfig(gate_check_problems=None))
    assert len(seen["problems"]) == 25 and seen["llm"] is None
    with pytest.raises(ValueError, match="gate_check_problems"):
        LoopConfig(gate_check_problems=0)
