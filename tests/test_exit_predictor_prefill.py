"""Round-0 predictor training on output index 1: the prefill states written beside the traces
(exit_predictor.data) are the state the engine samples the first output token from, and the
trainer uses them as output index 1's previous position."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.exit_predictor import features as feat
from rltlab.exit_predictor.data import read_prefill_states, write_prefill_states
from rltlab.exit_predictor.model import load_predictor
from rltlab.exit_predictor.train import load_training_data, train_from_traces
from rltlab.traces import collect_traces
from file_modes import assert_umask_permissions
from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)
R = 4


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(0)


def _prompts(n=12, seed=0):
    return random_prompts(n, seed, 3, 11)


def test_prefill_state_is_what_the_engine_samples_the_first_token_from(model, tmp_path):
    prompts = _prompts()
    ids = [100 + i for i in range(len(prompts))]
    path = write_prefill_states(model, prompts, ids, tmp_path, batch_size=5)
    assert_umask_permissions(path)   # not safetensors' own 0600
    states = read_prefill_states(path.parent)
    assert states["prompt_id"].tolist() == ids
    outs = LLM(model, max_num_seqs=4).generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0))
    logp = torch.log_softmax(states["hidden"] @ model.lm_head.weight.detach().float().T, -1)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        first = out.outputs[0].token_ids[0]
        assert states["first_token"][i] == first
        assert abs(float(logp[i, first]) - out.outputs[0].logprobs[0]) < 1e-5
        with torch.no_grad():   # unpadded full-depth forward of this prompt alone
            alone = model(torch.tensor([prompt])).final_hidden[0, -1].float()
        assert torch.allclose(states["hidden"][i], alone, atol=1e-5, rtol=0)
    assert torch.allclose(states["stats"], feat.prob_stats(
        states["hidden"] @ model.lm_head.weight.detach().float().T), atol=1e-6)


@pytest.fixture(scope="module")
def traced(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "t"
    prompts = _prompts(16, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, exit_threshold=0.5, min_loops=1,
                            ignore_eos=True)
    collect_traces(LLM(model, max_num_seqs=8), prompts, params, out, teacher=True)
    write_prefill_states(model, prompts, list(range(len(prompts))), out)
    return out


def test_round0_features_of_output_index_1_come_from_the_prefill(model, traced):
    tr, _ = load_training_data(traced)
    states = read_prefill_states(traced)
    emb = model.model.embed_tokens.weight.detach().float()
    blocks = ("embed", "prev_stats", "prev_hidden")
    x, keep = feat.trace_round0_features(tr, emb, blocks, states)
    assert bool(keep.all())                       # greedy sample 0: every row has a previous
    x_old, keep_old = feat.trace_round0_features(tr, emb, blocks)
    first = tr["output_index"] == 1
    assert keep_old.tolist() == (~first).tolist()
    assert torch.equal(x[~first], x_old)          # other rows unchanged
    for row in torch.nonzero(first)[:, 0].tolist():
        j = int(tr["prompt_id"][row])
        want = torch.cat([emb[states["first_token"][j]], states["stats"][j], states["hidden"][j]])
        assert torch.equal(x[row], want)
    other = {k: v[:3] for k, v in states.items()}  # prompts without a prefill state: dropped
    _, keep3 = feat.trace_round0_features(tr, emb, blocks, other)
    assert keep3.tolist() == (~first | (tr["prompt_id"] < 3)).tolist()


def test_round0_training_uses_output_index_1(model, traced, tmp_path):
    tr, info = load_training_data(traced)
    metrics = train_from_traces(traced, tmp_path / "p", rounds=[0], k=2, kind="mlp", hidden=8,
                                epochs=2, target_precision=0.5, model=model)
    _, manifest = load_predictor(tmp_path / "p" / "n0")
    assert manifest["rows_used"] == info["num_tokens"]
    assert len(manifest["training"]["prefill_states"]) == 64     # sha256 of the file
    assert metrics["per_round"][0]["exit_round"] == 2


def test_round0_previous_state_from_another_round(model, traced):
    tr, _ = load_training_data(traced)
    emb = model.model.embed_tokens.weight.detach().float()
    blocks = ("embed", "prev_stats", "prev_hidden")
    x, keep = feat.trace_round0_features(tr, emb, blocks, prev_round=2)
    prev = feat.previous_rows(tr)[keep]
    H = emb.shape[1]
    assert torch.equal(x[:, -H:], tr["hidden"][prev, 1].float())
    assert torch.equal(x[:, H], tr["top1_prob"][prev, 1].float())
    x4, _ = feat.trace_round0_features(tr, emb, blocks)
    assert torch.equal(x4[:, -H:], tr["hidden"][prev, R - 1].float())
    assert not torch.equal(x4, x)
    with pytest.raises(ValueError, match="prev_round"):
        feat.trace_round0_features(tr, emb, blocks, prev_round=R + 1)
