"""engine_patches/lookahead_exit: checkpoint checks and exactness of the N+2 lookahead exit in
real generation (engine == teacher-forced LAST_EXITED recompute with the chosen exits)."""
import pytest
import torch

from rltlab.model.checkpoint import model_hash
from rltlab.model.config import OuroConfig
from rltlab.engine import LLM, SamplingParams
from rltlab.engine_patches.lookahead_exit import (PredictorMismatchError, install,
                                                  load_policy)
from rltlab.exit_predictor.model import ExitPredictor, save_predictor
from rltlab.model.architecture import OuroForCausalLM

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
    seen = set()
    for prompt, o in _rollouts(model, name, {"threshold": thr}, seed0=11):
        assert o.exit_depths[0] == R and set(o.exit_depths[1:]) <= {3, 4}
        seen |= set(o.exit_depths[1:])
        seq, exits, rec = _recompute(model, prompt, o)
        _assert_logprobs_match(rec, prompt, o)
        with torch.no_grad():   # the decision: the score of h_1 at each decode position
            pos = slice(len(prompt), len(seq))
            s = policy.score(rec.hidden_states[0][0, pos], rec.gate_logits[0, pos, :1])
        assert torch.where(s >= thr, 3, 4).tolist() == o.exit_depths[1:]
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


# ----------------------------------------------------------------------------- round 0 (N = 0)

def _checkpoint0(path, model, blocks=("embed", "prev_stats"), **override):
    torch.manual_seed(1)
    dim = {"embed": H, "prev_stats": 3, "prev_hidden": H}
    in_dim = sum(dim[b] for b in blocks)
    pred = ExitPredictor(in_dim, "mlp", 16)
    pred.set_normalization(torch.randn(64, in_dim) * 2)
    manifest = {"base_model_hash": model_hash(model), "hidden_size": H, "num_rounds": R,
                "decision_round": 0, "k": 2, "exit_round": 2, "temperature": 1.3,
                "threshold": 0.5, "label": {"kind": "argmax"},
                "features": {"set": "round0", "blocks": list(blocks), "dim": in_dim},
                **override}
    return save_predictor(pred, path, manifest)


def _rollouts(model, name, policy_args, *, seed0, max_num_seqs=3, max_tokens=12):
    """5 sampled requests under the installed policy `name` (fewer slots than requests, so
    slots are refilled mid-run) -> [(prompt, first output)]."""
    llm = LLM(model, max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                             seed=seed0 + i, logprobs=0, exit_policy=name,
                             exit_policy_args=policy_args) for i in range(len(PROMPTS))]
    return [(prompt, res.outputs[0]) for prompt, res in zip(PROMPTS, llm.generate(PROMPTS, params))]


def _assert_logprobs_match(rec, prompt, o):
    """The engine's log-probs equal the teacher-forced recompute's (fp32, atol 1e-5)."""
    logp = torch.log_softmax(rec.final_logits[0].float(), -1)[len(prompt) - 1:]
    recomputed = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
    assert torch.allclose(recomputed, torch.tensor(o.logprobs), atol=1e-5)


def _recompute(model, prompt, o):
    seq = prompt + o.token_ids[:-1]
    exits = [R] * len(prompt) + o.exit_depths[1:]
    with torch.no_grad():
        return seq, exits, model(torch.tensor([seq]), exit_rounds=torch.tensor([exits]))


def _round0_scores(policy, model, prompt, seq, exits, rec):
    """Score of every decode position from round-0 information of the recompute: embed(its
    token) and the state the previous position exited from (h at that position's exit)."""
    pos = list(range(len(prompt), len(seq)))
    prev = torch.stack([rec.hidden_states[exits[p - 1] - 1][0, p - 1] for p in pos])
    emb = model.model.embed_tokens(torch.tensor([seq[p] for p in pos])).float()
    prev = prev.float()   # features rebuilt here by hand (not with the policy's own code)
    probs = torch.softmax(prev @ model.lm_head.weight.float().T, -1)
    top = probs.topk(2, -1).values
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    parts = {"embed": emb, "prev_stats": torch.stack([top[:, 0], top[:, 0] - top[:, 1],
                                                      entropy], -1), "prev_hidden": prev}
    x = torch.cat([parts[b] for b in policy.manifest["features"]["blocks"]], -1)
    return torch.sigmoid(policy.predictor(x) / policy.temperature)


def _threshold0(policy, model):
    with torch.no_grad():      # median over a full-depth pass: both exits (2 and R) occur
        ids = list(range(1, 41))
        out = model(torch.tensor([ids]))
        s = _round0_scores(policy, model, [ids[0]], ids, [R] * len(ids), out)
    return float(s.median())


@pytest.mark.parametrize("blocks", [("embed", "prev_stats"), ("embed", "prev_stats",
                                                              "prev_hidden")])
def test_round0_engine_matches_teacher_forced_recompute(model, tmp_path, blocks):
    ckpt = _checkpoint0(tmp_path / "p0", model, blocks)
    policy = load_policy(ckpt, model)
    assert policy.asks_before_round1 and policy.decision_lag == 2
    thr = _threshold0(policy, model)
    name = install(model, ckpt, name="n0_test")
    seen = set()
    for prompt, o in _rollouts(model, name, {"threshold": thr}, seed0=21):
        assert o.exit_depths[0] == R and set(o.exit_depths[1:]) <= {2, R}
        assert o.executed_depths == o.exit_depths
        seen |= set(o.exit_depths[1:])
        seq, exits, rec = _recompute(model, prompt, o)
        _assert_logprobs_match(rec, prompt, o)
        # the decision used only round-0 information: it is reproduced from the recompute
        s = _round0_scores(policy, model, prompt, seq, exits, rec)
        assert torch.where(s >= thr, 2, R).tolist() == o.exit_depths[1:]
    assert seen == {2, R}


def test_round0_then_n1_exit_semantics(model, tmp_path):
    ckpt0, ckpt1 = _checkpoint0(tmp_path / "a", model), _checkpoint(tmp_path / "b", model)
    p0, p1 = load_policy(ckpt0, model), load_policy(ckpt1, model)
    thr0 = _threshold0(p0, model)
    with torch.no_grad():
        out = model(torch.tensor([list(range(1, 41))]))
        thr1 = float(p1.score(out.hidden_states[0][0], out.gate_logits[0, :, :1]).median())
    name = install(model, ckpt0, name="n0_n1_test", then=ckpt1)
    seen = set()
    for prompt, o in _rollouts(model, name, {"threshold": thr0, "then_threshold": thr1},
                               seed0=5, max_num_seqs=4, max_tokens=14):
        seen |= set(o.exit_depths[1:])
        seq, exits, rec = _recompute(model, prompt, o)
        _assert_logprobs_match(rec, prompt, o)
        s0 = _round0_scores(p0, model, prompt, seq, exits, rec)
        pos = slice(len(prompt), len(seq))
        s1 = p1.score(rec.hidden_states[0][0, pos], rec.gate_logits[0, pos, :1])
        want = torch.where(s0 >= thr0, 2, torch.where(s1 >= thr1, 3, R))
        assert want.tolist() == o.exit_depths[1:]
    assert seen == {2, 3, R}


def test_round0_checkpoint_compatibility(model, tmp_path):
    name = install(model, _checkpoint0(tmp_path / "ok", model), name="n0_ok")
    assert name == "n0_ok"
    with pytest.raises(PredictorMismatchError, match="base model hash"):
        install(_model(seed=1), _checkpoint0(tmp_path / "h", model), name="n0_bad")
    with pytest.raises(PredictorMismatchError, match="hidden size 32 != the model's 64"):
        install(_model(hidden=64), _checkpoint0(tmp_path / "w", model), name="n0_bad")
    with pytest.raises(PredictorMismatchError, match="must exit at round 2"):
        install(model, _checkpoint0(tmp_path / "e", model, exit_round=3, k=3), name="n0_bad")
    with pytest.raises(PredictorMismatchError, match="blocks"):
        install(model, _checkpoint0(tmp_path / "b", model, features={"blocks": ["gates"],
                                                                       "dim": 35}),
                name="n0_bad")
    with pytest.raises(PredictorMismatchError, match="have 67 inputs"):   # wrong block list
        install(model, _checkpoint0(tmp_path / "d", model, features={
            "blocks": ["embed", "prev_stats", "prev_hidden"], "dim": 35}), name="n0_bad")
    with pytest.raises(ValueError, match="then= needs"):       # N = 1 first, N = 0 second
        install(model, _checkpoint(tmp_path / "n1", model), name="n0_bad",
                then=_checkpoint0(tmp_path / "n0", model))


def test_policies_never_copy_pageable_memory_to_the_device(model, tmp_path, monkeypatch):
    """Policies send host values to the device only through rltlab.common.device (pinned,
    non-blocking on CUDA): a non-blocking .to() of pageable memory still waits for the stream to
    drain, the very host sync that lagged policies (N+2, q_exit_delayed) exist to avoid. On the
    CPU the guard names the caller: another module's non-blocking .to() of a host tensor fails."""
    import sys

    real_to = torch.Tensor.to

    def guarded_to(self, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__")
        if kwargs.get("non_blocking") and self.device.type == "cpu" and \
                caller != "rltlab.common.device":
            raise AssertionError(f"a non-blocking .to() of a host tensor in {caller}")
        return real_to(self, *args, **kwargs)

    name = install(model, _checkpoint(tmp_path / "p", model), name="n_plus_2_copies")
    name0 = install(model, _checkpoint0(tmp_path / "p0", model), name="n0_copies")
    monkeypatch.setattr(torch.Tensor, "to", guarded_to)
    for policy, args in ((name, {"threshold": 0.5}), (name0, {"threshold": 0.5}),
                         ("q_exit_delayed", {}), ("q_exit", {})):
        outs = _rollouts(model, policy, args, seed0=3, max_tokens=6)
        assert all(len(o.token_ids) == 6 for _, o in outs)
