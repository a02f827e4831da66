"""Fault suite, sections B5/B6, C3 (traces) and E of docs/reliability.md: the add-on components
(lookahead exit predictors, draft heads), the trace store and the GSM8K reader under bad input,
misuse and concurrent writers. Tiny random models and checkpoints throughout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltlab.draft_heads import build_component, save_component
from rltlab.engine import LLM, SamplingParams
from rltlab.engine_patches.loop_draft import load_draft_component
from rltlab.engine_patches.lookahead_exit import install
from rltlab.exit_predictor.model import ExitPredictor, save_predictor
from rltlab.model.checkpoint import model_hash
from rltlab.traces import (TraceCorruptError, TraceWriter, collect_traces, iter_shards,
                           load_traces, read_manifest)
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R, H = 4, 32
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(0)


# ------------------------------------------------------------------ B5: exit predictors
def predictor_checkpoint(path, model, *, weights_nan=False, **override):
    torch.manual_seed(0)
    pred = ExitPredictor(H + 1 + 3, "mlp", 16)
    pred.set_normalization(torch.randn(64, H + 4))
    if weights_nan:
        with torch.no_grad():
            pred.net[0].weight[3, 5] = float("nan")
    manifest = {"base_model_hash": model_hash(model), "hidden_size": model.config.hidden_size,
                "num_rounds": model.config.num_rounds, "decision_round": 1, "k": 2,
                "exit_round": 3, "temperature": 1.5, "threshold": 0.0,
                "label": {"kind": "argmax"}, **override}
    return save_predictor(pred, path, manifest)


def exit_depths(llm, name):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_policy=name)
    return [out.outputs[0].exit_depths[1:] for out in llm.generate(PROMPTS, params)]


def test_reinstalled_predictor_is_served_by_a_live_engine(model, tmp_path):
    # threshold 0 fires for every token: exit round 3, then (re-installed) exit round 2
    install(model, predictor_checkpoint(tmp_path / "a", model), name="reinstall_test")
    llm = LLM(model)
    assert exit_depths(llm, "reinstall_test") == [[3] * 5] * 2
    install(model, predictor_checkpoint(tmp_path / "b", model, k=1, exit_round=2),
            name="reinstall_test")
    assert exit_depths(llm, "reinstall_test") == [[2] * 5] * 2
    # a checkpoint that does not fit a live engine's model is refused, the old one stays
    shallow = tiny_engine_model(0)
    shallow.config.total_ut_steps = 3
    with pytest.raises(ValueError, match="R = 3 rounds != the model's 4"):
        install(shallow, predictor_checkpoint(tmp_path / "c", shallow), name="reinstall_test")
    assert exit_depths(llm, "reinstall_test") == [[2] * 5] * 2


@pytest.mark.parametrize("override, field", [
    ({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"decision_round": 4, "exit_round": 4}, "decision_round"),
    ({"exit_round": 5, "k": 4}, "exit_round"), ({"exit_round": 1, "k": 0}, "exit_round"),
    ({"k": 3}, "'k'"), ({"threshold": 1.5}, "threshold"),
])
def test_predictor_manifest_values_are_checked(model, tmp_path, override, field):
    ckpt = predictor_checkpoint(tmp_path / "p", model, **override)
    with pytest.raises(ValueError) as info:
        install(model, ckpt, name="bad_values_test")
    assert str(ckpt / "manifest.json") in str(info.value) and field in str(info.value)


def test_predictor_with_nan_weights_is_refused(model, tmp_path):
    ckpt = predictor_checkpoint(tmp_path / "p", model, weights_nan=True)
    with pytest.raises(ValueError, match=r"predictor.safetensors: tensor\(s\) net.0.weight hold "
                                         "NaN"):
        install(model, ckpt, name="nan_test")


@pytest.mark.parametrize("edit, words", [
    (lambda text: text[: len(text) // 2], ["not valid JSON"]),
    (lambda text: "[1, 2]", ["must hold a JSON object"]),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "weights"}),
     ["field 'weights' is missing"]),
    (lambda text: json.dumps({**json.loads(text), "model": {"kind": "mlp", "in_dim": "36"}}),
     ["field 'model.in_dim' must be an integer"]),
    (lambda text: json.dumps({**json.loads(text), "model": {**json.loads(text)["model"],
                                                            "members": 0}}),
     ["field 'model.members' must be an integer >= 1"]),
])
def test_bad_predictor_manifest_names_file_and_field(model, tmp_path, edit, words):
    ckpt = predictor_checkpoint(tmp_path / "p", model)
    path = ckpt / "manifest.json"
    path.write_text(edit(path.read_text()))
    with pytest.raises(ValueError) as info:
        install(model, ckpt, name="bad_manifest_test")
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


# --------------------------------------------------------------------- B5: draft heads
@pytest.fixture
def head(model, tmp_path):
    comp = build_component("residual_mlp", model, draft_rounds=1)
    with torch.no_grad():
        comp.down.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return save_component(comp, model, tmp_path / "head")


def rewrite_head(out: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    state = load_file(out / "head.safetensors")
    edit(state)
    save_file(state, out / "head.safetensors")


def test_draft_head_sha256_is_checked_on_load(model, head):
    rewrite_head(head, lambda s: s["down.weight"].mul_(2.0))   # valid file, other weights
    with pytest.raises(ValueError, match=r"draft component 'residual_mlp' at .*head\.safetensors "
                                         "does not match the sha256"):
        load_draft_component(head, model)


def test_nan_draft_head_is_refused_naming_the_head(model, tmp_path):
    comp = build_component("residual_mlp", model, draft_rounds=1)
    with torch.no_grad():
        comp.up.weight[0, 0] = float("nan")
    out = save_component(comp, model, tmp_path / "nan_head")   # digests of the NaN file
    with pytest.raises(ValueError, match=r"draft component 'residual_mlp' at .*nan_head: "
                                         r"tensor\(s\) up.weight hold NaN"):
        load_draft_component(out, model)


def test_truncated_head_safetensors_names_the_file(model, head):
    data = (head / "head.safetensors").read_bytes()
    (head / "head.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"head\.safetensors does not match the sha256 .*"
                                         "truncated"):
        load_draft_component(head, model)
    meta = json.loads((head / "draft_component.json").read_text())
    meta.pop("files")        # no digests recorded: the unreadable file is still named
    (head / "draft_component.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="draft component 'residual_mlp' at .*cannot load its "
                                         "weights"):
        load_draft_component(head, model)


@pytest.mark.parametrize("edit, words", [
    (lambda meta, text: text[: len(text) // 2], ["not valid JSON"]),
    (lambda meta, text: json.dumps([meta]), ["must hold a JSON object"]),
    (lambda meta, text: json.dumps({k: v for k, v in meta.items() if k != "kind"}),
     ["field 'kind' is missing"]),
    (lambda meta, text: json.dumps({**meta, "draft_rounds": "1"}),
     ["field 'draft_rounds' must be an integer"]),
    (lambda meta, text: json.dumps({**meta, "kind": "layer_lora", "config": {"inner": 64}}),
     ["field 'config.inner' is not a setting of kind 'layer_lora'", "r, alpha"]),
])
def test_bad_draft_metadata_names_file_and_field(model, head, edit, words):
    path = head / "draft_component.json"
    path.write_text(edit(json.loads(path.read_text()), path.read_text()))
    with pytest.raises(ValueError) as info:
        load_draft_component(head, model)
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


# ------------------------------------------------------------------ B5: lookahead heads
@pytest.fixture
def la_heads(model, tmp_path):
    from rltlab.draft_heads import lookahead
    heads = lookahead.LookaheadHeads(model, depth=2, inner=8)
    with torch.no_grad():
        heads.heads[1].down.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    out = tmp_path / "la"
    lookahead.save(heads, out, [(0,), (1,), (0, 0)], model_hash(model), {"x": 1})
    return out


def _rewrite_la(out: Path, edit, rehash: bool = False) -> None:
    """Edit heads.safetensors' tensors; rehash: record the new file's sha256 (a file that
    passes the digest check)."""
    import hashlib
    from safetensors.torch import load_file, save_file
    state = load_file(out / "heads.safetensors")
    edit(state)
    save_file(state, out / "heads.safetensors")
    if rehash:
        _set_la_meta(out, weights_sha256=hashlib.sha256(
            (out / "heads.safetensors").read_bytes()).hexdigest())


def _set_la_meta(out: Path, **fields) -> None:
    meta = json.loads((out / "lookahead.json").read_text())
    meta.update(fields)
    (out / "lookahead.json").write_text(json.dumps(meta))


def test_lookahead_heads_sha256_is_checked_on_load(model, la_heads):
    """Lookahead heads replaced by other valid weights of the right shapes loaded silently."""
    from rltlab.draft_heads import lookahead
    lookahead.load(la_heads, model)                          # as saved: loads
    assert len(json.loads((la_heads / "lookahead.json").read_text())["weights_sha256"]) == 64
    _rewrite_la(la_heads, lambda s: s["heads.1.down.weight"].mul_(2.0))
    with pytest.raises(ValueError, match=r"la/heads\.safetensors does not match the sha256 "
                                         r"recorded in .*lookahead\.json: truncated, corrupt"):
        lookahead.load(la_heads, model)


def test_nan_lookahead_heads_are_refused_naming_the_tensor(model, tmp_path):
    from rltlab.draft_heads import lookahead
    heads = lookahead.LookaheadHeads(model, depth=2, inner=8)
    for bad in (float("nan"), float("inf")):
        with torch.no_grad():
            heads.heads[0].up.weight[0, 0] = bad
        lookahead.save(heads, tmp_path / "nan", [(0,)], model_hash(model), {})  # its digest
        with pytest.raises(ValueError, match=r"nan/heads\.safetensors: tensor\(s\) "
                                             r"heads\.0\.up\.weight hold NaN/Inf"):
            lookahead.load(tmp_path / "nan", model)


def test_lookahead_heads_without_a_recorded_sha256_are_refused_with_the_fix(model, la_heads):
    from rltlab.draft_heads import lookahead
    meta = json.loads((la_heads / "lookahead.json").read_text())
    del meta["weights_sha256"]
    (la_heads / "lookahead.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"lookahead\.json: field 'weights_sha256': missing.*"
                                         r"record_sha256"):
        lookahead.load(la_heads, model)
    lookahead.record_sha256(la_heads)             # the files are known good: record it
    lookahead.load(la_heads, model)


@pytest.mark.parametrize("edit, words", [
    ("truncated_weights", ["heads.safetensors", "cannot be read"]),
    ("garbage_weights", ["heads.safetensors", "cannot be read"]),
    ("missing_tensor", ["heads.safetensors", "heads.1.up.weight", "Missing"]),
    ("wrong_inner", ["heads.safetensors", "shape"]),
    ("truncated_json", ["lookahead.json", "truncated"]),
    ("list_json", ["lookahead.json", "holds a list"]),
    ("no_depth", ["lookahead.json", "field 'depth'", "missing"]),
    ("depth_str", ["lookahead.json", "field 'depth'", "a string"]),
    ("depth_zero", ["lookahead.json", "field 'depth'", ">= 1"]),
    ("tree_str", ["lookahead.json", "field 'tree'"]),
    ("tree_bad_rank", ["lookahead.json", "field 'tree'"]),
    ("hash_int", ["lookahead.json", "field 'base_model_hash'"]),
    ("sha_int", ["lookahead.json", "field 'weights_sha256'"]),
])
def test_bad_lookahead_files_name_the_file(model, la_heads, edit, words):
    """A truncated or malformed heads.safetensors / lookahead.json: a bare SafetensorError,
    JSONDecodeError, KeyError or AttributeError."""
    from rltlab.draft_heads import lookahead
    weights = la_heads / "heads.safetensors"
    if edit == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:100])
        _set_la_meta(la_heads, weights_sha256=__import__("hashlib").sha256(
            weights.read_bytes()).hexdigest())
    elif edit == "garbage_weights":
        weights.write_bytes(b"\xff" * 64)
        _set_la_meta(la_heads, weights_sha256=__import__("hashlib").sha256(
            weights.read_bytes()).hexdigest())
    elif edit == "missing_tensor":
        _rewrite_la(la_heads, lambda s: s.pop("heads.1.up.weight"), rehash=True)
    elif edit == "wrong_inner":
        _set_la_meta(la_heads, inner=16)
    elif edit in ("truncated_json", "list_json"):
        text = (la_heads / "lookahead.json").read_text()
        (la_heads / "lookahead.json").write_text(
            text[: len(text) // 2] if edit == "truncated_json" else "[" + text + "]")
    else:
        meta = json.loads((la_heads / "lookahead.json").read_text())
        changes = {"no_depth": None, "depth_str": {"depth": "2"}, "depth_zero": {"depth": 0},
                   "tree_str": {"tree": "0"}, "tree_bad_rank": {"tree": [[0], [0, -1]]},
                   "hash_int": {"base_model_hash": 5}, "sha_int": {"weights_sha256": 5}}[edit]
        if changes is None:
            del meta["depth"]
        else:
            meta.update(changes)
        (la_heads / "lookahead.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as info:
        lookahead.load(la_heads, model)
    assert type(info.value).__name__ in ("ValueError", "JSONFileError")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_shipped_lookahead_heads_carry_their_sha256():
    import hashlib
    from rltlab.bench.tree_spec import HEADS
    meta = json.loads((Path(HEADS) / "lookahead.json").read_text())
    assert meta["weights_sha256"] == hashlib.sha256(
        (Path(HEADS) / "heads.safetensors").read_bytes()).hexdigest()


# ------------------------------------------------------------------ B6: trace provenance
def trace_params():
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, seed=3)


def test_traces_of_another_model_at_the_same_version_are_refused(model, tmp_path):
    collect_traces(LLM(model), PROMPTS, trace_params(), tmp_path)
    before = (tmp_path / "manifest.json").read_bytes()
    other = tiny_engine_model(1)                       # same shapes, other weights, version 0
    with pytest.raises(ValueError, match=r"holds traces of weight version 0 from model "
                                         f"{model_hash(model)}.*hash to {model_hash(other)}"):
        collect_traces(LLM(other), PROMPTS, trace_params(), tmp_path)
    assert (tmp_path / "manifest.json").read_bytes() == before       # nothing changed
    assert read_manifest(tmp_path)["info"]["model_hashes"] == {"0": model_hash(model)}
    _, manifest = collect_traces(LLM(model), PROMPTS, trace_params(), tmp_path)   # same: ok
    assert manifest["num_tokens"] == 2 * read_manifest(tmp_path)["shards"][0]["num_tokens"]
    _, manifest = collect_traces(LLM(other, weight_version=1), PROMPTS, trace_params(), tmp_path)
    assert manifest["info"]["model_hashes"] == {"0": model_hash(model), "1": model_hash(other)}


def test_misspelled_trace_field_raises_naming_it(model, tmp_path):
    collect_traces(LLM(model), PROMPTS, trace_params(), tmp_path)
    assert load_traces(tmp_path, fields=["hidden", "token"])["token"].shape[0] > 0
    for read in (lambda f: load_traces(tmp_path, fields=f),
                 lambda f: next(iter_shards(tmp_path, fields=f))):
        with pytest.raises(ValueError, match=r"unknown trace fields \['hiden'\]; available: "
                                             r"\['hidden', "):
            read(["hiden", "token"])
    with pytest.raises(ValueError, match="a list of field names"):
        load_traces(tmp_path, fields="hidden")


# ------------------------------------------------------------------- C3: trace writers
def _records(n):
    gen = torch.Generator().manual_seed(n)
    rec = {k: torch.rand(R, generator=gen) for k in ("gate_logit", "hazard", "cdf", "top1_prob",
                                                     "margin", "entropy", "logprob_ref",
                                                     "kl_ref")}
    rec.update(hidden=torch.randn(R, 3, generator=gen), round_mask=torch.ones(R, dtype=bool),
               top1_id=torch.randint(0, 50, (R,), generator=gen), executed=R, selected=2,
               ref_round=R, ref_token=1, token=1, position=10, output_index=1, prompt_id=0,
               sample_index=0, weight_version=0, seed=1)
    return [dict(rec) for _ in range(n)]


def test_second_trace_writer_on_a_directory_is_refused(tmp_path):
    first = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=2)
    first.add(_records(3))
    with pytest.raises(RuntimeError, match=f"{tmp_path} is being written by another trace "
                                           f"writer .*pid {os.getpid()}"):
        TraceWriter(tmp_path, num_rounds=R, hidden_dim=3)
    first.close()
    second = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=2)
    second.add(_records(2))
    assert second.close()["num_tokens"] == 5
    assert load_traces(tmp_path)["token"].shape[0] == 5      # manifest and shards agree
    with pytest.raises(RuntimeError, match="closed"):
        second.add(_records(2))


def test_trace_writer_lock_holds_across_processes_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom rltlab.traces import TraceWriter\n"
         f"w = TraceWriter({str(tmp_path)!r}, num_rounds={R}, hidden_dim=3)\n"
         "print('ready', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match=f"being written by another trace writer .*pid "
                                               f"{holder.pid}"):
            TraceWriter(tmp_path, num_rounds=R, hidden_dim=3)
    finally:
        holder.kill()      # SIGKILL: no close(); the OS drops the lock with the process
        holder.wait()
    TraceWriter(tmp_path, num_rounds=R, hidden_dim=3).close()


# ------------------------------------------------------------ E: trace manifest files
@pytest.mark.parametrize("edit, words", [
    (lambda m, text: text[: len(text) // 2], ["not valid JSON"]),
    (lambda m, text: json.dumps([m]), ["must hold a JSON object, got a list"]),
    (lambda m, text: json.dumps({**m, "shards": [{k: v for k, v in m["shards"][0].items()
                                                  if k != "sha256"}]}),
     ["field 'shards[0].sha256' is missing"]),
    (lambda m, text: json.dumps({**m, "shards": [None]}), ["field 'shards[0]' must be"]),
    (lambda m, text: json.dumps({**m, "num_rounds": "4"}), ["field 'num_rounds' must be"]),
])
def test_bad_trace_manifest_names_file_and_field(tmp_path, edit, words):
    writer = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=2)
    writer.add(_records(2))
    writer.close()
    path = tmp_path / "manifest.json"
    path.write_text(edit(json.loads(path.read_text()), path.read_text()))
    for read in (lambda: load_traces(tmp_path), lambda: read_manifest(tmp_path),
                 lambda: TraceWriter(tmp_path, num_rounds=R, hidden_dim=3)):
        with pytest.raises(TraceCorruptError) as info:
            read()
        assert str(path) in str(info.value)
        for word in words:
            assert word in str(info.value)


# ------------------------------------------------------------------------ E: GSM8K JSONL
GOOD = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})


@pytest.mark.parametrize("lines, words", [
    ([GOOD, GOOD[:-9]], [":2: not valid JSON"]),
    ([GOOD, "[1, 2]"], [":2: a GSM8K record must be a JSON object"]),
    ([GOOD, "", json.dumps({"question": 5, "answer": "#### 5"})],
     [":3: field 'question' must be a non-empty string"]),
    ([], ["holds no GSM8K records"]),
    (["", "  "], ["holds no GSM8K records"]),
])
def test_bad_gsm8k_jsonl_is_reported_by_line(tmp_path, lines, words):
    from rltlab.eval.gsm8k import evaluate_gsm8k, load_gsm8k_jsonl

    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))

    def never_called(prompts):
        raise AssertionError("generated for a bad file")

    for read in (lambda: load_gsm8k_jsonl(path), lambda: evaluate_gsm8k(never_called, None, path)):
        with pytest.raises(ValueError) as info:
            read()
        assert str(path) in str(info.value)
        for word in words:
            assert word in str(info.value)
