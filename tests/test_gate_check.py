"""The gate candidate's check in generation (rltlab.loop.gate_check) on the embedded model: a
candidate equal to the current gate passes with identical curves; a gate that ignores the
hidden state (constant exit probability 0.3 per round) generates worse at equal mean rounds
and is rejected; the caller's model and the check's own engine stay apart."""
import torch

from rltlab.eval.problems import rollout_prompts
from rltlab.loop import GATE_BIAS, GATE_WEIGHT, LoopConfig
from rltlab.loop.gate_check import check_in_generation, judge_in_generation
from rltlab.loop.stage2 import gate_state_of
from rltlab.model.checkpoint import load_model_and_tokenizer

torch.set_num_threads(1)
CFG = LoopConfig(thresholds=(0.1, 0.2, 0.3, 0.5, 0.7, 1.0), max_tokens=6)


def _setup(n=40):
    model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    _, problems = rollout_prompts(tok, n, seed=7, kinds=("hops",))
    return model, tok, problems


def _constant_gate(current, exit_probability=0.3):
    logit = torch.logit(torch.tensor(exit_probability))
    return {GATE_WEIGHT: torch.zeros_like(current[GATE_WEIGHT]),
            GATE_BIAS: torch.full_like(current[GATE_BIAS], float(logit))}


def test_same_gate_passes_and_a_blind_gate_is_rejected():
    model, tok, problems = _setup()
    current = gate_state_of(model.model.early_exit_gate)
    same = check_in_generation(model, tok, current, problems, CFG)
    assert same["no_worse"] is True and same["curves"]["current"] == same["curves"]["candidate"]
    assert same["thresholds"] == [0.1, 0.2, 0.3, 0.5, 0.7] and same["n"] == len(problems)

    blind = check_in_generation(model, tok, _constant_gate(current), problems, CFG)
    assert blind["no_worse"] is False
    w = blind["worst_point"]
    assert w["diff_pp"] < -2 * w["se_pp"] < 0
    # the caller's model still holds the current gate
    assert torch.equal(gate_state_of(model.model.early_exit_gate)[GATE_BIAS], current[GATE_BIAS])


def test_judge_rejects_and_keeps_the_current_gate_unless_told_otherwise():
    model, tok, problems = _setup()
    current = gate_state_of(model.model.early_exit_gate)

    def trained(candidate):
        return {"validation_passed": True, "accepted": True, "reasons": [], "state": candidate,
                "candidate_state": candidate, "val_prompt_ids": list(range(len(problems)))}

    res = trained(_constant_gate(current))
    judge_in_generation(res, model, tok, problems, CFG)
    assert res["accepted"] is False and res["validation_passed"] is False
    assert "in generation worse" in res["reasons"][0]
    assert torch.equal(res["state"][GATE_BIAS], current[GATE_BIAS])

    res = trained(_constant_gate(current))
    judge_in_generation(res, model, tok, problems, LoopConfig(**{**CFG.__dict__,
                                                                 "gate_keep_worse": True}))
    assert res["accepted"] is True and res["validation_passed"] is False
    assert not torch.equal(res["state"][GATE_BIAS], current[GATE_BIAS])

    res = trained(_constant_gate(current))
    off = LoopConfig(**{**CFG.__dict__, "gate_generation_check": False})
    judge_in_generation(res, model, tok, problems, off)
    assert res["accepted"] is True and res["generation_check"] is None
