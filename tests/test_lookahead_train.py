"""lookahead_train's time limit: a run stopped by the clock ends its learning-rate schedule as a
run of its steps would, saves the heads of its best checks, and says what stopped it."""
import itertools

import pytest
import torch

from rltlab.draft_heads import lookahead_train
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

torch.set_num_threads(1)
VOCAB, LR = 64, 1e-3
ADAMW_STEP = torch.optim.AdamW.step   # unwrapped, however often _run wraps it


@pytest.fixture(scope="module")
def model():
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     total_ut_steps=4, max_position_embeddings=128)
    return OuroForCausalLM(cfg).init_weights(0, std=0.3).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def rollouts(model):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (10,), generator=gen),
             torch.randn(10, model.config.hidden_size, generator=gen)) for _ in range(12)]


def _run(model, rollouts, monkeypatch, steps: int, time_limit):
    """-> (record, the learning rate of every optimiser step); clock() ticks 1 s a call."""
    rates = []

    def recording_step(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return ADAMW_STEP(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    ticks = itertools.count()
    heads, cal, record = lookahead_train.train(model, rollouts, 2, 16, steps, 8, LR,
                                               time_limit=time_limit,
                                               clock=lambda: float(next(ticks)))
    assert len(cal) == 2 and heads.depth == 2
    return record, rates


def test_time_limit_stops_the_steps_with_the_rate_decayed_by_time(model, rollouts,
                                                                  monkeypatch, capsys):
    record, rates = _run(model, rollouts, monkeypatch, steps=1000, time_limit=20)
    # the bar counts 20 of 1000 steps; its postfix says the schedule (time) is done
    last_render = capsys.readouterr().err.split("\r")[-1]
    assert "20/1000" in last_render and "schedule 100%" in last_render, last_render
    # the clock reads 1, 2, ... at steps 1, 2, ...: 20 s are up at step 20 of 1000
    assert record["stopped_by"] == "time limit" and record["steps_run"] == 20 == len(rates)
    assert record["steps"] == 1000 and record["time_limit"] == 20
    expected = [LR * min(1.0, s / 100) * max(0.02, 1 - s / 20) for s in range(1, 21)]
    assert rates == pytest.approx(expected, rel=1e-12)
    # no regular check fell inside 20 steps (every 125th): the last step was checked
    assert record["best_step"] == [20, 20]


def test_without_a_time_limit_the_steps_run_out(model, rollouts, monkeypatch):
    record, rates = _run(model, rollouts, monkeypatch, steps=16, time_limit=None)
    assert record["stopped_by"] == "steps" and record["steps_run"] == 16 == len(rates)
    assert rates == pytest.approx([LR * (s / 100) * max(0.02, 1 - s / 16)
                                   for s in range(1, 17)], rel=1e-12)
    # a limit the steps never reach changes nothing
    timed, timed_rates = _run(model, rollouts, monkeypatch, steps=16, time_limit=1e6)
    assert timed["stopped_by"] == "steps" and timed_rates == pytest.approx(rates, rel=1e-4)


@pytest.mark.parametrize("limit", [0, -5, float("nan")])
def test_bad_time_limits_are_refused_before_anything_runs(model, rollouts, tmp_path, limit):
    with pytest.raises(ValueError, match="time_limit must be > 0"):
        lookahead_train.train(model, rollouts, 2, 16, 10, 8, LR, time_limit=limit)
    with pytest.raises(SystemExit):
        lookahead_train.main(["--device", "cpu", "--out", str(tmp_path / "bad"),
                              "--time-limit", str(limit)])
    assert not (tmp_path / "bad").exists()


def test_the_command_ends_with_its_record_as_json(tmp_path, capsys):
    """The command's last line is its training record as JSON (it was a Python dict). So
    small a run leaves a head without calibration targets: it must still be saved (its
    accuracy was NaN, never "best", and loading its best state failed)."""
    import json
    lookahead_train.main(["--device", "cpu", "--out", str(tmp_path / "heads"), "--n-arith", "4",
                          "--n-text", "4", "--max-new", "6", "--inner", "16", "--steps", "3",
                          "--batch", "8", "--rollout-batch", "8"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["steps_run"] == 3 and record["arith_prompts"] == 4
    assert (tmp_path / "heads" / "lookahead.json").is_file()
