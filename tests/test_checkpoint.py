"""rltlab.model.checkpoint: round trips, every rejection path, atomic saves (the Ouro-1.4B manifest:
test_ouro_manifest.py)."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from rltlab.model.checkpoint import (from_pretrained, load_model_and_tokenizer, load_tokenizer,
                               manifest, model_hash, num_parameters, save_pretrained)
from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM

from file_modes import assert_umask_permissions

REPO = Path(__file__).resolve().parents[1]
OURO_DATA = REPO / "tests" / "ouro-1.4b"  # copy of shared/ouro-1.4b: source of truth
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, total_ut_steps=4,
            max_position_embeddings=128)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> OuroForCausalLM:
    model = OuroForCausalLM(OuroConfig(**TINY)).init_weights(seed).to(dtype)
    with torch.no_grad():  # non-trivial norms and gate bias, so that every tensor matters
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen).to(dtype))
    return model


def logits(model: OuroForCausalLM) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    return model(ids, all_logits=True).final_logits


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name].view(torch.uint8), sb[name].view(torch.uint8)), name


@pytest.fixture
def saved(tmp_path) -> tuple[OuroForCausalLM, Path]:
    model = tiny_model()
    return model, save_pretrained(model, tmp_path / "ckpt")


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_round_trip(tmp_path, dtype, max_shard_bytes):
    model = tiny_model(dtype=dtype)
    out = save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes)
    files = sorted(p.name for p in out.iterdir())
    if max_shard_bytes is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and files == sorted(["config.json", *shards,
                                                    "model.safetensors.index.json"])
        assert set(index["weight_map"]) == set(model.state_dict())
        assert index["metadata"]["total_size"] == num_parameters(model) * dtype.itemsize
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert {**config, "torch_dtype": None} == {**model.config.to_dict(), "torch_dtype": None}

    loaded = from_pretrained(out)
    assert_same_state(model, loaded)
    assert model_hash(loaded) == model_hash(model)
    if (dtype == torch.bfloat16) == (max_shard_bytes is not None):  # forwards are the slow part
        assert torch.equal(logits(loaded), logits(model))


def test_small_limit_above_total_writes_single_file(tmp_path):
    out = save_pretrained(tiny_model(), tmp_path / "ckpt", max_shard_bytes=10**9)
    assert (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()


def test_dtype_casting_on_save_and_load(saved, tmp_path):
    model, out = saved
    for spec in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        loaded = from_pretrained(out, dtype=spec)
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    half = from_pretrained(out, dtype="float16")
    assert half.model.embed_tokens.weight.dtype == torch.float16

    # dtype=None/"auto" follows config.json's torch_dtype, which save_pretrained sets.
    bf16_dir = save_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(bf16_dir / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    for spec in (None, "auto"):
        assert from_pretrained(bf16_dir, dtype=spec).lm_head.weight.dtype == torch.bfloat16
    # Without torch_dtype in config.json, the stored dtype is used.
    config = json.loads((bf16_dir / "config.json").read_text())
    del config["torch_dtype"]
    (bf16_dir / "config.json").write_text(json.dumps(config))
    assert from_pretrained(bf16_dir).lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        from_pretrained(out, dtype="int8")


def test_manifest_hash_and_meta_models(saved, tmp_path):
    model, _ = saved
    assert num_parameters(model) == model.config.num_parameters()
    assert manifest(model)["model.layers.1.self_attn.k_proj.weight"] == [16, 32]
    assert model_hash(model) == model_hash(tiny_model())
    assert model_hash(model) != model_hash(tiny_model(seed=1))
    assert model_hash(model) != model_hash(tiny_model().to(torch.bfloat16))
    with torch.device("meta"):
        meta = OuroForCausalLM(OuroConfig(**TINY))
    assert manifest(meta) == manifest(model)
    with pytest.raises(ValueError, match="meta"):
        model_hash(meta)
    with pytest.raises(ValueError, match="meta"):
        save_pretrained(meta, tmp_path / "never-written")
    assert not (tmp_path / "never-written").exists()


def test_mixed_dtypes_and_transformers5_dtype_key(saved, tmp_path):
    model, out = saved
    model.model.early_exit_gate.to(torch.float64)
    with pytest.raises(ValueError, match="mixes dtypes"):
        save_pretrained(model, tmp_path / "mixed")
    save_pretrained(model, tmp_path / "mixed", dtype="bfloat16")
    assert from_pretrained(tmp_path / "mixed").model.early_exit_gate.bias.dtype == torch.bfloat16
    # transformers 5 writes "dtype" instead of "torch_dtype": honoured on load, dropped on save.
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = config.pop("torch_dtype").replace("float32", "float16")
    (out / "config.json").write_text(json.dumps(config))
    loaded = from_pretrained(out)
    assert loaded.lm_head.weight.dtype == torch.float16
    again = json.loads((save_pretrained(loaded, out) / "config.json").read_text())
    assert again["torch_dtype"] == "float16" and "dtype" not in again


# ------------------------------------------------------------------------------- rejections
def rewrite_weights(out: Path, edit) -> None:
    """Apply edit(state_dict) to the single-file checkpoint in `out`."""
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, error, words", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), ValueError,
     ["1 tensor(s) missing", "model.layers.1.mlp.up_proj.weight"]),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)}), ValueError,
     ["unexpected", "model.layers.2.mlp.up_proj.weight"]),
    (lambda s: s.update({"model.norm.weight": torch.ones(33)}), ValueError,
     ["wrong shape", "model.norm.weight [33] != [32]"]),
    (lambda s: s.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}), ValueError,
     ["unsupported dtype", "model.norm.weight (I32)"]),
    (lambda s: s["model.layers.0.self_attn.q_proj.weight"].view(-1)[7].fill_(float("nan")),
     ValueError, ["model.layers.0.self_attn.q_proj.weight", "NaN/Inf"]),
    (lambda s: s["lm_head.weight"].view(-1)[0].fill_(float("-inf")), ValueError,
     ["lm_head.weight", "NaN/Inf"]),
])
def test_rejects_bad_tensors(saved, edit, error, words):
    _, out = saved
    rewrite_weights(out, edit)
    with pytest.raises(error) as info:
        from_pretrained(out)
    for word in words:
        assert word in str(info.value)


def test_header_problems_are_found_before_allocation(saved, monkeypatch):
    _, out = saved
    rewrite_weights(out, lambda s: s.update({"lm_head.weight": torch.zeros(65, 32)}))

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before validating the headers")

    monkeypatch.setattr(torch.nn.Module, "to_empty", no_allocation)
    with pytest.raises(ValueError, match=r"wrong shape: lm_head.weight \[65, 32\] != \[64, 32\]"):
        from_pretrained(out)


def test_reports_many_missing_tensors_with_a_count(saved):
    _, out = saved
    rewrite_weights(out, lambda s: [s.pop(n) for n in list(s) if ".layers.1." in n])
    with pytest.raises(ValueError, match=r"11 tensor\(s\) missing: .*\(6 more\)"):
        from_pretrained(out)


def test_rejects_cast_overflow(saved):
    _, out = saved
    rewrite_weights(out, lambda s: s["model.early_exit_gate.bias"].fill_(1e6))
    assert from_pretrained(out).model.early_exit_gate.bias.item() == 1e6
    with pytest.raises(ValueError, match="early_exit_gate.bias .*overflows to Inf"):
        from_pretrained(out, dtype="float16")


def sharded(tmp_path) -> Path:
    out = save_pretrained(tiny_model(), tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    return out


def test_rejects_tensor_duplicated_across_shards(tmp_path):
    out = sharded(tmp_path)
    first, second = sorted(out.glob("model-*.safetensors"))[:2]
    state = load_file(second)
    state["model.embed_tokens.weight"] = load_file(first)["model.embed_tokens.weight"]
    save_file(state, second, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="duplicated across shards: model.embed_tokens.weight"):
        from_pretrained(out)


def test_rejects_index_inconsistent_with_shards(tmp_path):
    out = sharded(tmp_path)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["lm_head.weight"] = shards[0] if index["weight_map"][
        "lm_head.weight"] != shards[0] else shards[1]
    index["weight_map"]["model.extra.weight"] = shards[0]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as info:
        from_pretrained(out)
    message = str(info.value)
    assert "not where model.safetensors.index.json says: lm_head.weight" in message
    assert "in no shard: model.extra.weight" in message


def test_rejects_index_pointing_to_missing_shard(tmp_path):
    out = sharded(tmp_path)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shards that do not exist: .*{shard.name}"):
        from_pretrained(out)


def test_rejects_unsafe_index_paths(tmp_path):
    out = sharded(tmp_path)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the model-XXXXX-of-YYYYY pattern"):
        from_pretrained(out)


def test_rejects_pickle_only_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OuroConfig(**TINY).to_dict()))
    torch.save(tiny_model().state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle checkpoints .*refused for safety.*save_file"):
        from_pretrained(tmp_path)


def test_rejects_missing_files_and_bad_configs(saved, tmp_path):
    _, out = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError):
        from_pretrained(out / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "config.json").write_text((out / "config.json").read_text())
        from_pretrained(empty)
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="both model.safetensors and"):
        from_pretrained(out)
    (out / "model.safetensors.index.json").unlink()

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        from_pretrained(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_pretrained(out)
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(out)


def test_rejects_corrupt_safetensors(saved):
    _, out = saved
    (out / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        from_pretrained(out)


def test_hub_id_error_is_clear(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="not a local directory and the hub could not "
                                                "be reached: network unreachable"):
        from_pretrained("no-such-org/no-such-model")


# ---------------------------------------------------------------------------- atomic saves
@pytest.mark.parametrize("fail_on_call", [1, 2])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_on_call):
    old_model = tiny_model(seed=0)
    out = save_pretrained(old_model, tmp_path / "ckpt", max_shard_bytes=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_save, calls = safetensors.torch.save_file, []

    def crashing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_on_call:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", crashing_save)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(tiny_model(seed=1), out, max_shard_bytes=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or aside dirs left
    assert_same_state(from_pretrained(out), old_model)


def test_save_replaces_existing_checkpoint(saved, tmp_path):
    _, out = saved
    (out / "stale.txt").write_text("from an older save")
    new = tiny_model(seed=3)
    save_pretrained(new, out, max_shard_bytes=20_000)
    assert not (out / "stale.txt").exists() and not (out / "model.safetensors").exists()
    assert_same_state(from_pretrained(out), new)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


# ------------------------------------------------------------------------------- tokenizer
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the looped model thinks again", "exit early, exit late"] * 4,
                            trainer)
    assert tok.token_to_id("<|endoftext|>") == 0
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_tokenizer_round_trip(tmp_path):
    tokenizer, model = tiny_tokenizer(), tiny_model()
    out = save_pretrained(model, tmp_path / "ckpt", tokenizer=tokenizer)
    assert (out / "tokenizer.json").is_file()
    loaded_model, loaded = load_model_and_tokenizer(out)
    assert_same_state(loaded_model, model)
    text = "the looped model exits early<|endoftext|> then thinks ünïcode"
    ids = tokenizer.encode(text)
    assert loaded.encode(text) == ids and loaded.decode(ids) == tokenizer.decode(ids) == text
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == 0
    assert load_tokenizer(out).encode(text) == ids


def test_tokenizer_missing_is_an_error_only_when_requested(saved):
    _, out = saved
    from_pretrained(out)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(out)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model_and_tokenizer(out)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_checkpoints_and_atomic_files_get_the_umask_permissions(tmp_path, umask):
    """A checkpoint directory and an atomically written file get what mkdir() and open() would
    give them under the process umask, not tempfile's private 0700 / 0600 (which kept saved
    checkpoints and run files from every other user of a shared machine)."""
    from rltlab.common.atomic import write_json_atomic

    old = os.umask(umask)
    try:
        assert_umask_permissions(save_pretrained(tiny_model(seed=0), tmp_path / "ckpt"))
        assert_umask_permissions(write_json_atomic(tmp_path / "metrics.json", {"a": 1}))
    finally:
        os.umask(old)


def test_model_hash_is_reused_until_any_weight_changes(monkeypatch):
    """The sha256 runs once per model and weights (a trace collector hashes its engine's model
    each time it opens); a change to one element, even through .data (which torch's version
    counters miss), or an in-place optimizer-style update, makes it hash again."""
    from rltlab.model import checkpoint
    model = tiny_model(seed=3)
    calls = []
    real = checkpoint.hashlib.sha256
    monkeypatch.setattr(checkpoint.hashlib, "sha256", lambda: calls.append(1) or real())
    first = model_hash(model)
    assert model_hash(model) == first and len(calls) == 1
    weight = model.model.layers[0].mlp.down_proj.weight
    weight.data[1, 2] += 0.5                          # bypasses the version counter
    changed = model_hash(model)
    assert len(calls) == 2 and changed != first
    assert changed == model_hash(copy.deepcopy(model))    # what a fresh hash gives
    with torch.no_grad():
        weight.add_(torch.randn_like(weight))
    assert model_hash(model) not in (first, changed) and len(calls) == 4


def test_weight_fingerprint_sees_one_changed_element_of_any_size():
    from rltlab.model.checkpoint import _fingerprint
    for tensor in (torch.randn(3).to(torch.bfloat16), torch.randn(4, 2), torch.randn(5)):
        state = {"w": tensor}
        before = _fingerprint(state, ["w"])
        tensor.view(-1)[1] += 1
        assert _fingerprint(state, ["w"]) != before, tensor.dtype
        assert _fingerprint(state, ["w"]) == _fingerprint({"w": tensor.clone()}, ["w"])
