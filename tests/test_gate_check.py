"""The gate candidate's check in generation (rltlab.loop.gate_check) on the embedded model: a
candidate equal to the current gate passes with identical curves; a gate that ignores the
hidden state (constant exit probability 0.3 per round) generates worse at equal mean rounds
and is rejected; the caller's model and the check's own engine stay apart. The judge's tests
reuse the blind gate's check (same gate, candidate, problems and settings: generated once)."""
import pytest
import torch

from rltlab.eval.problems import rollout_prompts
from rltlab.loop import GATE_BIAS, GATE_WEIGHT, LoopConfig
from rltlab.loop import gate_check
from rltlab.loop.gate_check import check_in_generation, judge_in_generation
from rltlab.loop.stage2 import gate_state_of
from rltlab.model.checkpoint import load_model_and_tokenizer

torch.set_num_threads(1)
# 0.3: the stock gate runs ~3.1 rounds there, the blind gate 1: the worst point, 15 pp below
# at z = -2.7 on these 40 problems (z grows as sqrt(n): 23 problems would reach -2 only on
# average); 0.7: the blind gate reaches round 4, so its Pareto curve spans the stock gate's
# (0.1 and 0.2, checked before, only added points where the blind gate is not worse, 0.5 one
# off its Pareto front). 1.0 is left out of the check (it takes the thresholds below 1).
# The judge checks all 40 problems too (where LoopConfig caps them, gate_check_problems): the
# same check as the blind gate's below, and 24 would leave z near -2.
_ALL = {"gate_check_problems": None} if "gate_check_problems" in LoopConfig.__dataclass_fields__ \
    else {}
CFG = LoopConfig(thresholds=(0.3, 0.7, 1.0), max_tokens=6, **_ALL)


@pytest.fixture(scope="module")
def embedded():
    model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    _, problems = rollout_prompts(tok, 40, seed=7, kinds=("hops",))
    return model, tok, problems


_CHECKS: dict = {}


def _key(model, candidate, problems, cfg):
    gates = (gate_state_of(model.model.early_exit_gate), candidate)
    return (tuple(t.numpy().tobytes() for g in gates for t in (g[GATE_WEIGHT], g[GATE_BIAS])),
            tuple(p["question"] for p in problems), tuple(cfg.thresholds), cfg.max_tokens,
            cfg.min_loops, cfg.curve_z)


def _checked(model, tokenizer, candidate, problems, cfg, llm=None, **kwargs):
    """check_in_generation, its result kept for the same model gate, candidate, problems and
    settings (generation is greedy and deterministic): the blind gate is generated once for
    this module, whichever test asks first."""
    key = _key(model, candidate, problems, cfg)
    if key not in _CHECKS:
        if llm is not None:
            kwargs["llm"] = llm
        _CHECKS[key] = check_in_generation(model, tokenizer, candidate, problems, cfg, **kwargs)
    return _CHECKS[key]


def _constant_gate(current, exit_probability=0.3):
    logit = torch.logit(torch.tensor(exit_probability))
    return {GATE_WEIGHT: torch.zeros_like(current[GATE_WEIGHT]),
            GATE_BIAS: torch.full_like(current[GATE_BIAS], float(logit))}


@pytest.mark.slow
def test_same_gate_passes_and_a_blind_gate_is_rejected(embedded):
    model, tok, problems = embedded
    current = gate_state_of(model.model.early_exit_gate)
    same = check_in_generation(model, tok, current, problems,    # one threshold is enough here
                               LoopConfig(**{**CFG.__dict__, "thresholds": (0.3, 1.0)}))
    assert same["no_worse"] is True and same["curves"]["current"] == same["curves"]["candidate"]
    assert same["thresholds"] == [0.3] and same["n"] == len(problems)

    blind = _checked(model, tok, _constant_gate(current), problems, CFG)
    assert blind["no_worse"] is False
    w = blind["worst_point"]
    assert w["diff_pp"] < -2 * w["se_pp"] < 0
    # the caller's model still holds the current gate
    assert torch.equal(gate_state_of(model.model.early_exit_gate)[GATE_BIAS], current[GATE_BIAS])


@pytest.mark.slow
def test_judge_rejects_and_keeps_the_current_gate_unless_told_otherwise(embedded, monkeypatch):
    model, tok, problems = embedded
    current = gate_state_of(model.model.early_exit_gate)
    monkeypatch.setattr(gate_check, "check_in_generation", _checked)

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
