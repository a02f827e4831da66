"""Downstream-aware exit labels (exit_predictor.downstream): the cached, batched counterfactual
reruns equal a brute-force full-sequence recompute per exit, on a tiny random model whose early
exits do change later tokens; the label file aligns with the traces and trains a predictor."""
import pytest
import torch

from rltlab.engine import LLM, SamplingParams
from rltlab.exit_predictor import downstream as ds
from rltlab.exit_predictor import features as feat
from rltlab.exit_predictor.train import load_training_data, train_from_traces
from rltlab.traces import collect_traces
from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)
R, EXIT = 4, 3


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(0)


def _prompts(n=10, seed=0):
    return random_prompts(n, seed, 3, 9)


@torch.no_grad()
def _greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n + 1):
        ids.append(int(model(torch.tensor([ids])).final_logits[0, -1].argmax()))
    return ids[len(prompt) + 1:]          # o_1..o_n (o_0 comes from the prefill)


@torch.no_grad()
def _argmax_full(model, prompt, decoded, early):
    """Full-sequence recompute, no cache: argmax at every decode input with the inputs in
    `early` (decode indices) exiting at EXIT."""
    first = int(model(torch.tensor([prompt])).final_logits[0, -1].argmax())
    ids = torch.tensor([list(prompt) + [first] + list(decoded[:-1])])
    rounds = torch.full_like(ids, R)
    for j in early:
        rounds[0, len(prompt) + j] = EXIT
    return model(ids, exit_rounds=rounds).final_logits[0, len(prompt):].argmax(-1)


def _flip(changed, j):
    later = changed[j + 1:].nonzero()
    return int(later[0]) + 1 if len(later) else 0


def _reference_single(model, prompt, decoded):
    base = _argmax_full(model, prompt, decoded, [])
    own, flips = [], []
    for j in range(len(decoded)):
        changed = _argmax_full(model, prompt, decoded, [j]) != base
        own.append(not bool(changed[j]))
        flips.append(_flip(changed, j))
    return own, flips


def _reference_greedy(model, prompt, decoded):
    base = _argmax_full(model, prompt, decoded, [])
    exits, own, flips = [], [], []
    for j in range(len(decoded)):
        changed = _argmax_full(model, prompt, decoded, exits + [j]) != base
        own.append(not bool(changed[j]))
        flips.append(_flip(changed, j))
        if own[-1] and flips[-1] == 0:
            exits.append(j)
    return own, flips


@pytest.mark.parametrize("mode", ["single", "greedy"])
def test_reruns_match_a_full_recompute(model, mode):
    fn, ref = ((ds.sequence_flips, _reference_single) if mode == "single"
               else (ds.sequence_greedy, _reference_greedy))
    seen_own_fail = seen_flip = False
    for prompt in _prompts(6, seed=1):
        decoded = _greedy(model, prompt, 9)
        own, flips, mismatches = (fn(model, prompt, decoded, EXIT, batch_size=4)
                                  if mode == "single" else fn(model, prompt, decoded, EXIT))
        want_own, want_flips = ref(model, prompt, decoded)
        assert mismatches == 0
        assert own.tolist() == want_own
        assert flips.tolist() == want_flips
        seen_own_fail |= not all(want_own)
        seen_flip |= any(f > 0 for f, o in zip(want_flips, want_own) if o)
    assert seen_own_fail and seen_flip     # the comparison covered both kinds of label-0


def test_rerun_counts_tokens_it_does_not_reproduce(model):
    prompt = _prompts(1, seed=2)[0]
    decoded = _greedy(model, prompt, 6)
    wrong = decoded[:3] + [(decoded[3] + 1) % 61] + decoded[4:]
    assert ds.sequence_flips(model, prompt, wrong, EXIT)[2] >= 1


@pytest.fixture(scope="module")
def greedy_traces(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "t"
    prompts = _prompts(16, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, exit_threshold=0.5, min_loops=1,
                            ignore_eos=True)
    collect_traces(LLM(model), prompts, params, out, teacher=True, shard_tokens=40,
                   prompt_ids=list(range(len(prompts))))
    return out, dict(enumerate(prompts))


def test_label_file_aligns_with_the_traces_and_trains(model, greedy_traces, tmp_path):
    trace_dir, prompts = greedy_traces
    summary = ds.compute_downstream(model, trace_dir, prompts=prompts, mode="greedy",
                                    progress=False)
    assert summary["rerun_mismatches"] == 0
    tr, _ = load_training_data(trace_dir)
    tr = ds.attach_downstream(tr, trace_dir, EXIT)
    # the stored own_ok equals the traces' own round-3 vs round-4 agreement for the first
    # output (no earlier exits) and the labels follow own_ok and first_flip
    first = tr["output_index"] == 1
    agree = tr["top1_id"][:, EXIT - 1] == tr["top1_id"][:, R - 1]
    assert torch.equal(tr["downstream_own_ok"][first], agree[first])
    lab = feat.make_labels(tr, EXIT, feat.label_spec("downstream"))
    flip = tr["downstream_first_flip"]
    assert torch.equal(lab.bool(), tr["downstream_own_ok"] & (flip == 0))
    lab2 = feat.make_labels(tr, EXIT, feat.label_spec("downstream", window=2))
    assert torch.equal(lab2.bool(), tr["downstream_own_ok"] & ((flip == 0) | (flip > 2)))
    assert 0 < lab.mean() < lab2.mean() <= agree.float().mean() + 0.2
    with pytest.raises(ValueError, match="measure exit round 3, not 2"):
        feat.make_labels(tr, 2, feat.label_spec("downstream"))
    metrics = train_from_traces(trace_dir, tmp_path / "p", rounds=(1,), k=2,
                                label="downstream", epochs=2, cpu=True)
    spec = metrics["per_round"][0]
    manifest = (tmp_path / "p" / "n1" / "manifest.json").read_text()
    assert '"kind": "downstream"' in manifest and '"mode": "greedy"' in manifest
    assert '"file_sha256"' in manifest
    assert spec["train"]["label_rate"] < 1.0


def test_bad_input_is_refused_and_writes_nothing(model, greedy_traces, tmp_path):
    trace_dir, prompts = greedy_traces
    path = ds.downstream_file(trace_dir, 2)
    with pytest.raises(ValueError, match="mode"):
        ds.compute_downstream(model, trace_dir, prompts=prompts, exit_round=2, mode="both")
    with pytest.raises(ValueError, match="not this model"):
        ds.compute_downstream(tiny_engine_model(1), trace_dir, prompts=prompts, exit_round=2)
    with pytest.raises(ValueError, match="exit round"):
        ds.compute_downstream(model, trace_dir, prompts=prompts, exit_round=R)
    with pytest.raises(ValueError, match="no prompt"):
        ds.compute_downstream(model, trace_dir, prompts={0: prompts[0]}, exit_round=2)
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match="rltlab.exit_predictor.downstream"):
        ds.read_downstream(trace_dir, 2)
    tr, _ = load_training_data(trace_dir)
    with pytest.raises(ValueError, match="attach_downstream"):
        feat.make_labels(tr, EXIT, feat.label_spec("downstream"))
    with pytest.raises(ValueError, match="window"):
        feat.label_spec("downstream", window=0)



def test_labels_of_other_traces_are_refused(model, greedy_traces, tmp_path):
    from safetensors.torch import save_file

    trace_dir, prompts = greedy_traces
    ds.compute_downstream(model, trace_dir, prompts=prompts, exit_round=1, mode="single",
                          progress=False)
    stored, meta = ds.read_downstream(trace_dir, 1)
    tr, _ = load_training_data(trace_dir)
    assert ds.attach_downstream(tr, trace_dir, 1)["downstream_exit_round"] == 1
    path = ds.downstream_file(trace_dir, 1)
    save_file(stored, str(path), metadata={**meta, "content_sha256": "0" * 64})
    try:
        with pytest.raises(ValueError, match="other traces"):
            ds.attach_downstream(tr, trace_dir, 1)
    finally:
        path.unlink()
