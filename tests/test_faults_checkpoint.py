"""Fault suite, section A (real checkpoints) and E (tokenizer files) of docs/reliability.md:
HF-style checkpoint details that used to be refused, ignored or slow, on tiny random checkpoints
written with the project's own save_pretrained."""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltlab.engine import LLM, SamplingParams
from rltlab.model import checkpoint
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.checkpoint import from_pretrained, load_model, load_tokenizer, save_pretrained
from rltlab.model.config import OuroConfig
from rltlab.model.generate import generate_plain

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, total_ut_steps=4,
            max_position_embeddings=128)
PROMPT = [3, 17, 42, 9, 25]


def tiny_model(seed: int = 0, **config) -> OuroForCausalLM:
    return OuroForCausalLM(OuroConfig(**{**TINY, **config})).init_weights(seed, std=0.2).eval()


@pytest.fixture
def saved(tmp_path) -> Path:
    return save_pretrained(tiny_model(), tmp_path / "ckpt")


def edit_config(out: Path, **changes) -> None:
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))


_DROP = object()


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[n], sb[n]) for n in sa)


# ------------------------------------------------------------------------ A1: list eos
def test_list_eos_token_id_loads_and_every_id_stops_generation(tmp_path):
    model = tiny_model(seed=1)
    reference = generate_plain(model, [PROMPT], 12, depth=4).token_ids[0]   # no stop
    # two ids that first occur at output positions a < b (> 0), and one that never occurs
    a, b = [i for i, t in enumerate(reference) if i > 0 and t not in reference[:i]][:2]
    never = next(t for t in range(TINY["vocab_size"]) if t not in reference)
    # the list's LATER entry occurs first in the output: a stop on eos_token_id[0] alone
    # (or a refusal of the list) fails
    eos = [never, reference[a], reference[b]]
    model.config.eos_token_id = eos
    loaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"))
    assert loaded.config.eos_token_id == eos and loaded.config.eos_token_ids == tuple(eos)

    plain = generate_plain(loaded, [PROMPT], 12, depth=4,
                           eos_token_id=loaded.config.eos_token_id)
    assert plain.token_ids[0] == reference[:a + 1]
    out = LLM(loaded).generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))
    assert out[0].outputs[0].token_ids == reference[:a + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    model.config.eos_token_id = [never, reference[b]]
    out = LLM(model).generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))
    assert out[0].outputs[0].token_ids == reference[:b + 1]
    for bad in ([], [1, "2"], [True], [1, 64]):    # lists are checked like single ids
        with pytest.raises(ValueError, match="eos_token_id"):
            OuroConfig(**TINY, eos_token_id=bad)


# ----------------------------------------------------------------------- A1: extra keys
def rewrite_weights(out: Path, edit) -> None:
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def test_rotary_inv_freq_buffers_are_skipped_with_a_warning(saved):
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 8, 2).float() / 8)
    rewrite_weights(saved, lambda s: s.update({
        "model.rotary_emb.inv_freq": inv_freq,
        "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq.clone(),
        "model.layers.1.self_attn.rotary_emb.inv_freq": inv_freq.clone()}))
    with pytest.warns(UserWarning, match=r"skipping 3 rotary inv_freq buffer\(s\)"):
        loaded = from_pretrained(saved)
    assert_same_state(loaded, tiny_model())
    # anything else unknown stays refused, also next to a rotary buffer
    rewrite_weights(saved, lambda s: s.update({
        "model.layers.0.self_attn.rotary_emb.scale": torch.ones(4)}))
    with pytest.raises(ValueError, match="unexpected: model.layers.0.self_attn.rotary_emb.scale"):
        from_pretrained(saved)


# --------------------------------------------------------------------- A2: config keys
@pytest.mark.parametrize("key, value", [("rope_scaling", {"type": "linear", "factor": 2.0}),
                                        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                        ("early_exit_step", 1), ("early_exit_step", 0)])
def test_unimplemented_config_keys_are_refused(saved, key, value):
    edit_config(saved, **{key: value})
    with pytest.raises(ValueError, match=f"config.json: OuroConfig.{key}=.* is not implemented"):
        from_pretrained(saved)
    edit_config(saved, **{key: None})     # null = unset, as HF writes it
    from_pretrained(saved)


@pytest.mark.parametrize("value", ["gelu", "relu", "gelu_pytorch_tanh", None, 1])
def test_other_hidden_act_is_refused(saved, value):
    # HF builds the MLP from hidden_act; rltlab's MLP is SiLU whatever the key says (gelu loaded
    # and gave SiLU's logits bit for bit)
    edit_config(saved, hidden_act=value)
    with pytest.raises(ValueError, match=r"config.json: OuroConfig.hidden_act=.* is not "
                                         r"implemented.*'silu'"):
        from_pretrained(saved)
    for ok in ("silu", "swish", _DROP):     # swish is HF's other name for SiLU; missing = silu
        edit_config(saved, hidden_act=ok)
        from_pretrained(saved)


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": True, "sliding_window": 4},
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
    {"use_sliding_window": True},                       # HF's config classes default to 4096
    {"use_sliding_window": 1, "sliding_window": 4},
    {"layer_types": ["full_attention", "sliding_attention"]},
    {"layer_types": "full_attention"},
    {"layer_types": ["full_attention"]},                # one entry for two layers
])
def test_sliding_window_attention_is_refused(saved, changes):
    edit_config(saved, **changes)
    key = "layer_types" if "layer_types" in changes else "use_sliding_window"
    with pytest.raises(ValueError, match=f"config.json: OuroConfig.{key}=.* not implemented"):
        from_pretrained(saved)


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": False, "sliding_window": 4},   # off: the window is ignored (as HF)
    {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    {"use_sliding_window": True, "sliding_window": None},
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},  # no layer >= 2
    {"layer_types": ["full_attention", "full_attention"]},
])
def test_sliding_window_keys_that_leave_attention_full_load(saved, changes):
    edit_config(saved, **changes)
    assert_same_state(from_pretrained(saved), tiny_model())


def test_ouro_1_4b_config_keys_load():
    path = Path(__file__).parent / "ouro-1.4b" / "config.json"
    config = OuroConfig.from_json_file(path)
    assert config.extra["hidden_act"] == "silu" and config.extra["use_sliding_window"] is False


def test_missing_rope_theta_is_refused(saved):
    edit_config(saved, rope_theta=_DROP)
    with pytest.raises(ValueError, match=r"config.json: config has no rope_theta"):
        from_pretrained(saved)


@pytest.mark.parametrize("key, value", [("rope_theta", float("inf")), ("rope_theta", float("nan")),
                                        ("rms_norm_eps", float("nan")),
                                        ("rms_norm_eps", float("inf")),
                                        ("initializer_range", float("nan"))])
def test_non_finite_config_floats_are_refused(saved, key, value):
    edit_config(saved, **{key: value})     # json writes NaN / Infinity and reads them back
    with pytest.raises(ValueError, match=f"config.json: OuroConfig.{key} must be finite"):
        from_pretrained(saved)


# ------------------------------------------------------------- A4: huge num_hidden_layers
@pytest.mark.parametrize("layers", [100_000, 10 ** 7])
def test_huge_num_hidden_layers_is_refused_fast_without_building(saved, monkeypatch, layers):
    edit_config(saved, num_hidden_layers=layers)

    def no_build(*args, **kwargs):
        raise AssertionError("built the model before checking the headers")

    monkeypatch.setattr(checkpoint, "OuroForCausalLM", no_build)
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        from_pretrained(saved)
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    missing = 11 * (layers - 2)
    assert f"{missing} tensor(s) missing: model.layers.2.self_attn.q_proj.weight" in message
    assert f"implies {5 + 11 * layers:,} tensors ({layers:,} layers" in message


@pytest.mark.parametrize("config", [TINY, {**TINY, "num_key_value_heads": 4, "head_dim": 6},
                                    {**TINY, "num_hidden_layers": 1, "vocab_size": 7}])
def test_expected_tensors_describe_the_model_state_dict(config):
    from rltlab.model.checkpoint_checks import ExpectedTensors

    cfg = OuroConfig(**config)
    with torch.device("meta"):
        model = OuroForCausalLM(cfg)
    expected = ExpectedTensors(cfg)
    assert {n: list(expected.shape(n)) for n in expected.names()} == checkpoint.manifest(model)
    assert len(expected) == len(model.state_dict())
    assert expected.shape("model.layers.01.mlp.up_proj.weight") is None
    assert expected.shape(f"model.layers.{cfg.num_hidden_layers}.mlp.up_proj.weight") is None


# ---------------------------------------------------------------- A5: relative paths
def test_relative_path_is_not_taken_for_a_hub_id(saved, tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_download(repo_id, **kwargs):
        asked.append(repo_id)
        if repo_id == "some-org/some-model":
            return str(saved)
        raise OSError(f"{repo_id} is not on the hub (offline test)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for text in ("runs/model", "ckpt/missing"):   # first part exists here: a path
        with pytest.raises(FileNotFoundError, match=f"no such directory: .*{text}"):
            from_pretrained(text)
    assert asked == []
    assert_same_state(from_pretrained("ckpt"), tiny_model())   # relative, existing
    assert_same_state(from_pretrained("some-org/some-model"), tiny_model())  # still a hub id
    assert asked == ["some-org/some-model"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no such directory: .*other-org/model.*"
                                                "HF_HUB_OFFLINE"):
        from_pretrained("other-org/model")


# ------------------------------------------------------------------ E: tokenizer files
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["loops think again, then exit"] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    return save_pretrained(tiny_model(), tmp_path_factory.mktemp("tok") / "ckpt", tokenizer=hf)


@pytest.mark.parametrize("file, text, words", [
    ("tokenizer.json", lambda t: t[: len(t) // 2], ["not valid JSON"]),
    ("tokenizer.json", lambda t: "[]", ["must hold a JSON object"]),
    ("tokenizer.json", lambda t: json.dumps({**json.loads(t), "model": 5}), ["field 'model'"]),
    ("tokenizer.json", lambda t: json.dumps({k: v for k, v in json.loads(t).items()
                                             if k != "added_tokens"}), ["added_tokens"]),
    ("tokenizer_config.json", lambda t: t[:-20], ["not valid JSON"]),
    ("tokenizer_config.json", lambda t: "[1, 2]", ["must hold a JSON object"]),
    ("tokenizer_config.json", lambda t: json.dumps({**json.loads(t), "eos_token": 5}),
     ["field 'eos_token'"]),
    ("tokenizer_config.json", lambda t: json.dumps({**json.loads(t), "model_max_length": "x"}),
     ["field 'model_max_length'"]),
])
def test_bad_tokenizer_files_name_the_file_and_field(tokenizer_dir, tmp_path, file, text, words):
    import shutil

    out = Path(shutil.copytree(tokenizer_dir, tmp_path / "ckpt"))
    if not (out / file).is_file():
        (out / file).write_text("{}")
    (out / file).write_text(text((out / file).read_text()))
    loaders = [load_tokenizer] if file == "tokenizer_config.json" else \
        [load_tokenizer, lambda p: load_model(p)]
    for load in loaders:
        with pytest.raises(ValueError) as info:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load(out)
        assert str(out / file) in str(info.value)
        for word in words:
            assert word in str(info.value)
