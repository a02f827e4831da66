"""python -m rltlab.model.standin: a random-weight checkpoint at a given config's shape, with a
tokenizer that decodes every id, that LLM loads; refused over a non-empty directory."""
from __future__ import annotations

import json

import pytest

from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model
from rltlab.model.standin import is_standin, main, padded_tokenizer, write_standin
from rltlab.common.paths import REPO_ROOT as REPO

REAL = REPO / "tests" / "ouro-1.4b" / "config.json"


def small_real_config(tmp_path):
    """The real Ouro-1.4B config.json with its layers and widths cut (vocab kept: 49,152)."""
    config = json.loads(REAL.read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_standin_loads_generates_and_decodes_every_id(tmp_path):
    out = write_standin(small_real_config(tmp_path), tmp_path / "standin", seed=3)
    assert is_standin(out) and (out / "README.md").read_text().count("random") >= 1
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["rltlab_standin"]["random_weights"]
    model, tokenizer, _ = load_model(out)
    assert tokenizer.get_vocab_size() == 49152
    assert tokenizer.decode([40000, 49151]).strip() == "x40000 x49151"
    llm = LLM(str(out))
    out_tokens = llm.generate("12+7=", SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out_tokens.outputs[0].token_ids) == 6 and out_tokens.outputs[0].text


def test_padding_keeps_the_original_ids_and_refuses_a_smaller_vocab():
    source = json.loads((REPO / "artifacts" / "ouro-tiny" / "tokenizer.json").read_text())
    padded = padded_tokenizer(source, 2048)
    vocab = padded["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(2048))
    assert all(vocab[k] == v for k, v in source["model"]["vocab"].items())
    with pytest.raises(ValueError, match="past vocab_size"):
        padded_tokenizer(source, 100)


def test_a_non_empty_directory_is_refused_in_one_line(tmp_path, capsys):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(small_real_config(tmp_path)), str(target), "--device", "cpu"])
    assert exit_info.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "mine"
