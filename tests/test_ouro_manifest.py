"""The real Ouro-1.4B shape on the meta device: 269 tensors, their names / shapes / dtype and the
parameter count match shared/ouro-1.4b (copied into tests/ouro-1.4b)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rltlab.model.checkpoint import manifest, num_parameters
from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM

REPO = Path(__file__).resolve().parents[1]
OURO_DATA = REPO / "tests" / "ouro-1.4b"  # copy of shared/ouro-1.4b: source of truth


def test_ouro_1p4b_manifest_on_meta_device():
    expected = json.loads((OURO_DATA / "weights.json").read_text())
    config = OuroConfig.from_json_file(OURO_DATA / "config.json")
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    assert manifest(model) == expected["tensors"]
    assert list(manifest(model)) == list(expected["tensors"])  # same order as well
    assert len(expected["tensors"]) == expected["num_tensors"] == 269
    assert num_parameters(model) == expected["num_parameters"] == 1_434_652_673
    assert config.num_parameters() == 1_434_652_673
    assert expected["dtype"] == config.extra["torch_dtype"] == "bfloat16"
    assert expected["safetensors_bytes_of_tensors"] == 2 * 1_434_652_673
    # The config round-trips through save_pretrained's config.json unchanged.
    assert OuroConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    assert config.to_dict() == json.loads((OURO_DATA / "config.json").read_text())


def test_ouro_1p4b_data_copy_matches_shared():
    shared = [p for p in (REPO.parent / "shared" / "ouro-1.4b", REPO / "shared" / "ouro-1.4b")
              if p.is_dir()]
    if not shared:
        pytest.skip("no shared/ouro-1.4b next to or inside the repository")
    for directory in shared:
        for name in ("config.json", "weights.json"):
            assert (directory / name).read_bytes() == (OURO_DATA / name).read_bytes(), name
