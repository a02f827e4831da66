"""The loop on GSM8K (LoopConfig.tasks "gsm8k", notebook 10's TASKS): rollouts from the JSONL's
training split, a fresh window of it each iteration, the held-out split evaluated, gsm8k_cot
prompts and stop strings everywhere the loop generates (rollout, evaluation, the gate's
generation check, the deployed components), scored by strict match."""
from __future__ import annotations

from pathlib import Path

import pytest

from rltlab.loop import LoopConfig, rollout_problems
from tiny_models import write_tiny_checkpoint

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k_mini.jsonl"   # 9 train, 9 held out


def test_gsm8k_config_needs_its_file():
    with pytest.raises(ValueError, match="tasks 'gsm8k' needs gsm8k_path"):
        LoopConfig(tasks="gsm8k")
    with pytest.raises(ValueError, match="tasks must be 'embedded' or 'gsm8k'"):
        LoopConfig(tasks="gsm8", gsm8k_path=str(GSM8K))


def test_each_iteration_rolls_out_the_next_window_of_the_training_split():
    from rltlab.eval.gsm8k import gsm8k_cot_prompt, gsm8k_problems
    from rltlab.eval.problems import encode
    from rltlab.common.paths import embedded_model_dir
    from rltlab.model.checkpoint import load_tokenizer

    tok = load_tokenizer(embedded_model_dir())
    cfg = LoopConfig(tasks="gsm8k", gsm8k_path=str(GSM8K), gsm8k_fewshot=2, rollout_prompts=4)
    train = [p["question"] for p in gsm8k_problems(GSM8K, "train")]
    windows = [rollout_problems(tok, cfg, k) for k in range(3)]
    assert [[p["question"] for p in w[1]] for w in windows] == \
        [train[0:4], train[4:8], [train[8]] + train[0:3]]      # cycling past the file's end
    prompts, problems = windows[1]
    assert prompts[0] == encode(tok, gsm8k_cot_prompt(problems[0]["question"], 2))
    with pytest.raises(ValueError, match="holds 9 training-split GSM8K problems"):
        rollout_problems(tok, LoopConfig(tasks="gsm8k", gsm8k_path=str(GSM8K),
                                         rollout_prompts=10), 0)


@pytest.mark.slow
def test_two_iterations_on_gsm8k_with_the_deployed_components(tmp_path, monkeypatch):
    from rltlab.engine import LLM
    from rltlab.eval.gsm8k import GSM8K_STOP, gsm8k_problems
    from rltlab.loop import run_iteration, setup
    from rltlab.model.checkpoint import load_model

    sent = []   # every generation's stop strings
    real_generate = LLM.generate

    def generate(self, prompts, params=None, *args, **kwargs):
        many = params if isinstance(params, (list, tuple)) else [params]
        sent.extend(tuple(p.stop) for p in many if p is not None)
        return real_generate(self, prompts, params, *args, **kwargs)
    monkeypatch.setattr(LLM, "generate", generate)

    model_dir = write_tiny_checkpoint(tmp_path / "model")
    model, tok, _ = load_model(model_dir, threads=1)
    cfg = LoopConfig(tasks="gsm8k", gsm8k_path=str(GSM8K), gsm8k_fewshot=1, iterations=2,
                     rollout_prompts=3, max_tokens=6, eval_problems=3, thresholds=(0.3, 1.0),
                     gate_steps=4, train_exit_predictor=True, predictor_epochs=2,
                     train_draft_head=True, draft_steps=2, draft_prompts=2, draft_k=2,
                     draft_max_tokens=6)
    state = setup(tmp_path / "run", model, tok, cfg, model_dir=model_dir)
    held = {p["question"] for p in gsm8k_problems(GSM8K, "heldout")}
    assert {p["question"] for p in state.problems} <= held and len(state.problems) == 3
    results = [run_iteration(state, k) for k in range(2)]
    for res in results:
        assert res["rollout_kinds"] == {"gsm8k": 3} and res["heldout_overlap_with_rollouts"] == 0
        for row in res["after"]["rows"]:
            assert set(row["quality_by_kind"]) == {"gsm8k"}
    assert "deployed" in results[1]                        # iteration 0's parts, deployed
    assert sent and all(stop == tuple(GSM8K_STOP) for stop in sent)
