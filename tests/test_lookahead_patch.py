"""engine_patches/lookahead_exit: checkpoint checks and exactness of the N+2 lookahead exit in
real generation (engine == teacher-forced LAST_EXITED recompute with the chosen exits)."""
import pytest
import torch

from rltlab.checkpoint import model_hash
from rltlab.config import OuroConfig
from rltlab.engine import LLM, SamplingParams
from rltlab.engine_patches.lookahead_exit import (PredictorMismatchError, install,
                                                  load_policy)
from rltlab.exit_predictor.model import ExitPredictor, save_predictor
from rltlab.model import OuroForCausalLM

torch.set_num_threads(1)
R, H = 4, 32


def _model(hidden=H, rounds=R, seed=0):
    cfg = OuroConfig(vocab_size=61, hidden_size=hidden, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     total_ut_steps=rounds, max_position_embeddings=256)
    return OuroForCausalLM(cfg).init_weights(seed, std=0.2).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _checkpoint(path, model, **override):
    torch.manual_seed(0)
    pred = ExitPredictor(H + 1 + 3, "mlp", 16)
    pred.set_normalization(torch.randn(64, H + 4))
    manifest = {"base_model_hash": model_hash(model), "hidden_size": H, "num_rounds": R,
                "decision_round": 1, "k": 2, "exit_round": 3, "temperature": 1.5,
                "threshold": 0.5, "label": {"kind": "argmax"}, **override}
    return save_predictor(pred, path, manifest)


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33]]


def test_engine_matches_teacher_forced_recompute(model, tmp_path):
    ckpt = _checkpoint(tmp_path / "p", model)
    policy = load_policy(ckpt, model)
    with torch.no_grad():      # threshold = median round-1 score, so both 3 and 4 occur
        ids = torch.tensor([list(range(1, 41))])
        out = model(ids)
        scores = policy.score(out.hidden_states[0][0], out.gate_logits[0, :, :1])
    thr = float(scores.median())
    name = install(model, ckpt, name="n_plus_2_test")
    llm = LLM(model, max_num_seqs=3)       # 5 requests, 3 slots: refill mid-run
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11 + i,
                             logprobs=0, exit_policy=name,
                             exit_policy_args={"threshold": thr}) for i in range(5)]
    outs = llm.generate(PROMPTS, params)
    seen = set()
    for prompt, res in zip(PROMPTS, outs):
        o = res.outputs[0]
        assert o.exit_depths[0] == R and set(o.exit_depths[1:]) <= {3, 4}
        seen |= set(o.exit_depths[1:])
        seq = prompt + o.token_ids[:-1]
        exits = [R] * len(prompt) + o.exit_depths[1:]
        with torch.no_grad():
            rec = model(torch.tensor([seq]), exit_rounds=torch.tensor([exits]))
            logp = torch.log_softmax(rec.final_logits[0].float(), -1)[len(prompt) - 1:]
            recomputed = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert torch.allclose(recomputed, torch.tensor(o.logprobs), atol=1e-5)
            # the decision itself: the score of h_1 at each decode position picks its exit
            pos = slice(len(prompt), len(seq))
            s = policy.score(rec.hidden_states[0][0, pos], rec.gate_logits[0, pos, :1])
            expect = torch.where(s >= thr, 3, 4).tolist()
            assert expect == o.exit_depths[1:]
    assert seen == {3, 4}


def test_mismatched_checkpoint_is_rejected(model, tmp_path):
    bad_hash = _checkpoint(tmp_path / "h", model, base_model_hash="0123456789abcdef")
    with pytest.raises(PredictorMismatchError, match="base model hash"):
        install(model, bad_hash, name="n_plus_2_bad")
    other = _model(seed=1)        # same shapes, other weights
    with pytest.raises(PredictorMismatchError, match="hash"):
        install(other, _checkpoint(tmp_path / "o", model), name="n_plus_2_bad")
    wide = _model(hidden=64)
    with pytest.raises(PredictorMismatchError, match="hidden size 32 != the model's 64"):
        install(wide, _checkpoint(tmp_path / "w", model), name="n_plus_2_bad")
    deep = _model(rounds=3)
    with pytest.raises(PredictorMismatchError, match="R = 4 rounds != the model's 3"):
        install(deep, _checkpoint(tmp_path / "d", model), name="n_plus_2_bad")
    assert issubclass(PredictorMismatchError, ValueError)
