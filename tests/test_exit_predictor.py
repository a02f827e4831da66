"""Exit predictor: labels, features, calibration, training through accelerate, checkpoints,
the CLI on teacher-mode traces of a tiny random model."""
import json

import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.exit_predictor import features as feat
from rltlab.exit_predictor.model import ExitPredictor, load_predictor, save_predictor
from rltlab.exit_predictor.train import (binary_metrics, choose_threshold, fit_temperature,
                                         load_training_data, main, roc_auc, split_by_prompt)
from rltlab.traces import collect_traces
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(0)


@pytest.fixture(scope="module")
def trace_dir(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "t"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 61, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 9, (24,), generator=gen)]
    params = SamplingParams(temperature=1.0, max_tokens=10, exit_threshold=0.5, min_loops=1,
                            ignore_eos=True, seed=3)
    collect_traces(LLM(model), prompts, params, out, teacher=True, shard_tokens=64)
    return out


def _fake_traces():
    top1 = torch.tensor([[1, 2, 2, 2], [5, 5, 5, 5], [3, 4, 5, 6], [7, 8, 9, 9]])
    kl = torch.tensor([[2.0, 0.5, 0.05, 0.0], [0.01, 0.0, 0.0, 0.0], [3.0, 2.0, 1.0, 0.0],
                       [1.0, 0.3, 0.2, 0.0]])
    logp = torch.tensor([[-3.0, -1.0, -0.5, -0.4], [-0.1, -0.1, -0.1, -0.1],
                         [-3.0, -2.0, -1.0, -0.5], [-2.0, -1.0, -1.0, -0.999]])
    return {"top1_id": top1, "kl_ref": kl, "logprob_ref": logp,
            "round_mask": torch.ones(4, 4, dtype=torch.bool)}


def test_labels_and_oracle():
    tr = _fake_traces()
    assert feat.make_labels(tr, 3, feat.label_spec("argmax")).tolist() == [1, 1, 0, 1]
    assert feat.make_labels(tr, 3, feat.label_spec("kl", eps=0.1)).tolist() == [1, 1, 0, 0]
    # stage2 at exit 3: only round 4 could still improve: I_4 = CE_3 - CE_4
    assert feat.make_labels(tr, 3, feat.label_spec("stage2")).tolist() == [0, 1, 0, 1]
    assert feat.make_labels(tr, 4, feat.label_spec("stage2")).tolist() == [1, 1, 1, 1]
    assert feat.oracle_rounds(tr).tolist() == [2, 1, 4, 3]
    with pytest.raises(ValueError):
        feat.label_spec("nope")



def test_stage2_label_sees_non_adjacent_later_rounds():
    """Only a round two or more after the exit round improves: the label must be 0. (In
    _fake_traces every improving round is also the next one, so a label that looked only at
    the next round passed there.) CE_r = -logprob_ref[r - 1]; margin 0.005 nats."""
    ce = torch.tensor([[2.0, 1.0, 1.0, 0.5],     # round 4 improves by 0.5 after a flat round 3
                       [1.0, 1.0, 1.0, 0.9],     # flat, flat, then 0.1 better at round 4
                       [1.0, 1.0, 1.0, 1.0],     # never improves
                       [1.0, 1.0, 1.0, 0.996],   # a later gain within the margin
                       [1.0, 0.5, 0.5, 0.5]])    # only the next round (2) improves
    tr = {"logprob_ref": -ce, "round_mask": torch.ones(5, R, dtype=torch.bool)}
    spec = feat.label_spec("stage2")
    # N = 0 -> exit 2: rounds 3 and 4 must not improve (round 4 is non-adjacent)
    assert feat.make_labels(tr, 2, spec).tolist() == [0, 0, 1, 1, 1]
    # exit 1: rounds 2, 3, 4 (rows 0, 1: the gain sits two or three rounds later)
    assert feat.make_labels(tr, 1, spec).tolist() == [0, 0, 1, 1, 0]
    # N = 1 -> exit 3: round 4 is the only later round
    assert feat.make_labels(tr, 3, spec).tolist() == [0, 0, 1, 1, 1]

def test_metrics_calibration_threshold():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5
    probs = torch.tensor([0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    labels = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0.])
    thr, ok = choose_threshold(probs, labels, 1.0, min_fires=2)
    assert ok and thr == pytest.approx(0.7)
    m = binary_metrics(probs, labels, thr)
    assert m["precision"] == 1.0 and m["recall"] == pytest.approx(5 / 6)
    assert choose_threshold(probs, labels, 1.01)[1] is False
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4000, generator=gen)
    y = (torch.rand(4000, generator=gen) < torch.sigmoid(z)).float()
    assert fit_temperature(3 * z, y) == pytest.approx(3.0, rel=0.15)   # overconfident by 3x
    masks = split_by_prompt(torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9]))
    assert sum(int(m.sum()) for m in masks) == 12
    assert not any(bool((a & b).any()) for i, a in enumerate(masks) for b in masks[i + 1:])


def test_checkpoint_round_trip(tmp_path):
    p = ExitPredictor(7, "mlp", 8)
    p.set_normalization(torch.randn(20, 7))
    save_predictor(p, tmp_path, {"num_rounds": 4, "hidden_size": 4, "decision_round": 1,
                                 "exit_round": 3, "temperature": 1.0, "threshold": 0.5})
    q, manifest = load_predictor(tmp_path)
    x = torch.randn(3, 7)
    assert torch.equal(p(x), q(x)) and manifest["model"]["kind"] == "mlp"
    (tmp_path / "predictor.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="sha256"):
        load_predictor(tmp_path)


def test_ensemble_is_the_mean_of_its_members_and_round_trips(tmp_path):
    """members > 1: the logit equals the mean of the separately computed member logits (fp32,
    1e-6), through a checkpoint round trip; a checkpoint without `members` is one network."""
    from rltlab.exit_predictor.fit import train_predictor

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=gen)
    y = (x[:, 0] + 0.3 * torch.randn(64, generator=gen) > 0).float()
    parts = [train_predictor(x, y, kind="mlp", hidden=6, epochs=2, seed=s, cpu=True)[0]
             for s in (3, 4, 5)]
    ens, log = train_predictor(x, y, kind="mlp", hidden=6, epochs=2, seed=3, cpu=True,
                               members=3)
    probe = torch.randn(9, 5, generator=gen)
    want = torch.stack([p(probe) for p in parts]).mean(0)
    assert torch.allclose(ens(probe), want, atol=1e-6, rtol=0)
    assert not torch.allclose(parts[0](probe), parts[1](probe))   # the seeds differ
    assert log["members"] == 3 and len(log["loss_last"]) == 3
    meta = {"num_rounds": 4, "hidden_size": 4, "decision_round": 1, "exit_round": 3,
            "temperature": 1.0, "threshold": 0.5}
    save_predictor(ens, tmp_path / "e", meta)
    back, manifest = load_predictor(tmp_path / "e")
    assert manifest["model"]["members"] == 3 and torch.equal(back(probe), ens(probe))
    save_predictor(parts[0], tmp_path / "one", meta)   # an earlier checkpoint: no members field
    file = tmp_path / "one" / "manifest.json"
    old = json.loads(file.read_text())
    del old["model"]["members"]
    file.write_text(json.dumps(old))
    assert torch.equal(load_predictor(tmp_path / "one")[0](probe), parts[0](probe))


def test_ensemble_refuses_parts_that_do_not_fit_together():
    a, b = ExitPredictor(5, "mlp", 6), ExitPredictor(5, "mlp", 6)
    a.set_normalization(torch.randn(10, 5, generator=torch.Generator().manual_seed(1)))
    b.set_normalization(torch.randn(10, 5, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="share their feature normalization"):
        ExitPredictor.ensemble([a, b])
    with pytest.raises(ValueError, match="one kind and size"):
        ExitPredictor.ensemble([a, ExitPredictor(5, "mlp", 7)])
    with pytest.raises(ValueError, match="at least one"):
        ExitPredictor.ensemble([])


@pytest.mark.parametrize("members", [0, -2, 1.5, True])
def test_bad_member_counts_are_refused(members, tmp_path):
    from rltlab.exit_predictor.train import train_from_traces

    with pytest.raises(ValueError, match="members must be an int >= 1"):
        ExitPredictor(4, "mlp", 4, members=members)
    with pytest.raises(ValueError, match="members must be an int >= 1"):   # before any reading
        train_from_traces(tmp_path / "no-such-traces", tmp_path / "out", members=members)
    assert not (tmp_path / "out").exists()


def test_train_cli_on_teacher_traces(trace_dir, tmp_path, model):
    from rltlab.model.checkpoint import model_hash
    tr, info = load_training_data(trace_dir)
    x = feat.trace_features(tr, 1)
    assert x.shape == (info["num_tokens"], 32 + 1 + 3)
    metrics = main(["--traces", str(trace_dir), "--out", str(tmp_path / "p"), "--rounds", "1",
                    "2", "--model", "mlp", "--hidden", "8", "--epochs", "3", "--threads", "1",
                    "--target-precision", "0.5"])
    assert [e["decision_round"] for e in metrics["per_round"]] == [1, 2]
    for e in metrics["per_round"]:
        t = e["test"]
        assert e["temperature"] > 0
        fired = t["fire_rate"] * t["tokens"]       # a fraction of the test tokens
        assert fired == pytest.approx(round(fired))
        # fired tokens exit at N + 2, the others run all R rounds
        assert t["expected_rounds"] == pytest.approx(
            t["fire_rate"] * e["exit_round"] + (1 - t["fire_rate"]) * R)
    _, manifest = load_predictor(tmp_path / "p" / "n1")
    assert manifest["base_model_hash"] == model_hash(model)
    assert manifest["hidden_size"] == 32 and manifest["num_rounds"] == R
    assert manifest["exit_round"] == 3 and manifest["label"]["kind"] == "argmax"
    assert manifest["training_data"]["manifest_sha256"] == info["manifest_sha256"]
    assert json.loads((tmp_path / "p" / "metrics.json").read_text())["tokens"] > 0


def test_refuses_non_teacher_traces(model, tmp_path):
    collect_traces(LLM(model), [[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),
                   tmp_path / "nt", teacher=False)
    with pytest.raises(ValueError, match="teacher"):
        load_training_data(tmp_path / "nt")


def test_oracle_generation_is_last_exited_consistent(model):
    from rltlab.exit_predictor.baselines import oracle_generate
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    outs = oracle_generate(model, prompts, 8, eos_token_id=None)
    depths = set()
    for prompt, o in zip(prompts, outs):
        assert len(o.token_ids) == 8 and o.exit_depths[0] == R
        depths |= set(o.exit_depths[1:])
        seq = prompt + o.token_ids[:-1]
        exits = [R] * len(prompt) + o.exit_depths[1:]
        with torch.no_grad():
            rec = model(torch.tensor([seq]), exit_rounds=torch.tensor([exits]))
        assert rec.final_logits[0, len(prompt) - 1:].argmax(-1).tolist() == o.token_ids
    assert depths <= {1, 2, 3, 4} and len(depths) > 1


def test_rule_policies_in_the_engine(model):
    from rltlab.exit_predictor.baselines import register_rule_policies
    from rltlab.exit_predictor.evaluate import _params
    register_rule_policies(model)
    llm = LLM(model)
    for name, eps in (("hidden_delta", 0.5), ("successive_kl", 0.05)):
        params = _params(name, 6, {"eps": eps}, eos=None)
        outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params)
        for o in outs:
            assert o.outputs[0].error is None if hasattr(o.outputs[0], "error") else True
            assert len(o.outputs[0].token_ids) == 6
            assert all(2 <= d <= R for d in o.outputs[0].exit_depths[1:])


# ----------------------------------------------------------------------------- round 0 (N = 0)

def test_round0_labels_exit_at_2():
    tr = _fake_traces()
    # round-2 argmax vs round-4 argmax: 2==2, 5==5, 4!=6, 8!=9
    assert feat.make_labels(tr, 2, feat.label_spec("argmax")).tolist() == [1, 1, 0, 0]
    assert feat.make_labels(tr, 2, feat.label_spec("kl", eps=0.1)).tolist() == [0, 1, 0, 0]
    # stage2 at exit 2: I_3 = CE_2 - CE_3 and I_4 = CE_3 - CE_4 must both be <= 0.005
    assert feat.make_labels(tr, 2, feat.label_spec("stage2")).tolist() == [0, 1, 0, 1]


def _round0_traces():
    """Two prompts x output indices, stored out of order; prompt 7 lacks output index 2."""
    rows = [  # (prompt_id, sample, output_index, token)
        (3, 0, 2, 11), (3, 0, 1, 10), (7, 0, 1, 20), (3, 0, 3, 12), (7, 0, 3, 22),
        (3, 1, 1, 15), (3, 1, 2, 16)]
    n, H = len(rows), 4
    gen = torch.Generator().manual_seed(1)
    return {"prompt_id": torch.tensor([r[0] for r in rows]),
            "sample_index": torch.tensor([r[1] for r in rows]),
            "output_index": torch.tensor([r[2] for r in rows]),
            "token": torch.tensor([r[3] for r in rows]),
            "round_mask": torch.ones(n, R, dtype=torch.bool),
            "top1_prob": torch.rand(n, R, generator=gen) + 0.1,
            "margin": torch.rand(n, R, generator=gen) + 0.1,
            "entropy": torch.rand(n, R, generator=gen) + 0.1,
            "hidden": torch.randn(n, R, H, generator=gen)}


def test_round0_features_from_previous_position():
    tr = _round0_traces()
    # row i's input is the token emitted by (same prompt, sample, output index - 1)
    assert feat.previous_rows(tr).tolist() == [1, -1, -1, 0, -1, -1, 5]
    emb = torch.randn(30, 4, generator=torch.Generator().manual_seed(2))
    x, keep = feat.trace_round0_features(tr, emb, ("embed", "prev_stats", "prev_hidden"))
    assert keep.tolist() == [True, False, False, True, False, False, True]
    assert x.shape == (3, 4 + 3 + 4)
    for row, (i, p) in enumerate([(0, 1), (3, 0), (6, 5)]):
        want = torch.cat([emb[tr["token"][p]], torch.stack([tr["top1_prob"][p, R - 1],
                          tr["margin"][p, R - 1], tr["entropy"][p, R - 1]]),
                          tr["hidden"][p, R - 1]])
        assert torch.allclose(x[row], want, atol=0, rtol=0), (i, p)
    x2, _ = feat.trace_round0_features(tr, emb)     # default blocks: embed + prev_stats
    assert torch.equal(x2, x[:, :7])
    assert len(feat.feature_names(4, 0)) == 7
    with pytest.raises(ValueError, match="blocks"):
        feat.trace_round0_features(tr, emb, ("embed", "gates"))


def test_train_round0_on_teacher_traces(trace_dir, tmp_path, model):
    from rltlab.model.checkpoint import model_hash
    from rltlab.exit_predictor.train import train_from_traces
    from tiny_models import tiny_engine_model
    tr, info = load_training_data(trace_dir)
    metrics = train_from_traces(trace_dir, tmp_path / "p", rounds=[0], k=2, kind="mlp",
                                hidden=8, epochs=3, target_precision=0.5, model=model)
    e = metrics["per_round"][0]
    assert e["decision_round"] == 0 and e["exit_round"] == 2
    assert 2 <= e["test"]["expected_rounds"] <= R
    pred, manifest = load_predictor(tmp_path / "p" / "n0")
    assert manifest["decision_round"] == 0 and manifest["k"] == 2
    assert manifest["base_model_hash"] == model_hash(model)
    assert manifest["features"]["set"] == "round0"
    assert manifest["features"]["blocks"] == ["embed", "prev_stats"]
    assert manifest["features"]["dim"] == pred.in_dim == 32 + 3
    # output index 1 has no previous traced position: dropped
    first = int((tr["output_index"] == 1).sum())
    assert first > 0 and manifest["rows_used"] == info["num_tokens"] - first
    with pytest.raises(ValueError, match="base model"):
        train_from_traces(trace_dir, tmp_path / "q", rounds=[0], epochs=1)
    with pytest.raises(ValueError, match="hash"):
        train_from_traces(trace_dir, tmp_path / "q", rounds=[0], epochs=1,
                          model=tiny_engine_model(1))
