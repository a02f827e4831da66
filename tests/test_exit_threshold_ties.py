"""A CDF exactly on the threshold exits (`CDF_r >= threshold`), in the three places that compare
them: the gates module, the engine's exit decision (q_exit) and select-only.

With a zeroed gate every hazard is sigmoid(0) = 0.5 exactly, so CDF_1..3 = 0.5, 0.75, 0.875
exactly in fp32: thresholds there must exit at rounds 1, 2, 3 (a `>` exits one round later).
Tiny random model, fp32, CPU."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.select_only import selected_rounds
from rltlab.model import gates
from tiny_models import ROUNDS, tiny_engine_model

torch.set_num_threads(1)
TIES = [(0.5, 1), (0.75, 2), (0.875, 3)]     # threshold = CDF_r exactly -> exit round r
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8]]


def test_zeroed_gate_puts_the_cdf_exactly_on_the_thresholds():
    cdf = gates.exit_cdf(torch.zeros(ROUNDS))
    assert cdf.dtype == torch.float32
    assert cdf.tolist() == [0.5, 0.75, 0.875, 0.9375]     # exact, not approximately


@pytest.mark.parametrize("threshold, exit_round", TIES)
def test_gates_module_exits_on_a_tie(threshold, exit_round):
    logits = torch.zeros(3, ROUNDS)
    assert gates.q_exit_rounds(logits, threshold).tolist() == [exit_round] * 3
    cdf = gates.exit_cdf(logits)
    assert gates.q_exit_now(cdf[:, exit_round - 1], exit_round, threshold, 1, ROUNDS).all()


def _zero_gate_model():
    model = tiny_engine_model(0)
    with torch.no_grad():
        model.model.early_exit_gate.weight.zero_()
        model.model.early_exit_gate.bias.zero_()
    return model


@pytest.fixture(scope="module")
def zero_gate():
    return _zero_gate_model()


@pytest.mark.parametrize("semantics", ["last_exited", "select_only"])
def test_engine_exits_on_a_tie(zero_gate, semantics):
    """The engine's q_exit (exit_policies._q_fire) and select-only's rule, through generation:
    every decode token (select-only: every output token, the first included) exits at r."""
    llm = LLM(zero_gate, block_size=4, exit_semantics=semantics)
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, min_loops=1,
                             exit_policy="q_exit", exit_threshold=t) for t, _ in TIES]
    for (threshold, exit_round), out in zip(TIES, llm.generate([PROMPTS[0]] * 3, params)):
        depths = out.outputs[0].exit_depths
        if semantics == "last_exited":
            assert depths == [ROUNDS] + [exit_round] * 3, (threshold, depths)
        else:
            assert depths == [exit_round] * 4, (threshold, depths)


@pytest.mark.parametrize("threshold, exit_round", TIES)
def test_select_only_rule_exits_on_a_tie(threshold, exit_round):
    params = SamplingParams(exit_threshold=threshold, min_loops=1, max_loops=ROUNDS)
    assert selected_rounds(torch.zeros(2, ROUNDS), [params, params], [False, False]) == \
        [exit_round] * 2
