"""The exit predictor (linear or small MLP, fp32) and its checkpoint format.

A checkpoint is a directory:

    predictor.safetensors   weights + feature normalization (mean/std buffers)
    manifest.json           format, base model hash, hidden size, R, decision round N, k, exit
                            round, label definition, feature list, model kind, temperature,
                            threshold (+ target precision), training-data manifest checksum,
                            metrics, sha256 of predictor.safetensors

The calibrated probability is sigmoid(logit / temperature); the token is predicted to be able
to exit at N + k when that probability >= threshold.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

FORMAT = "rltlab-exit-predictor"
SCHEMA_VERSION = 1
WEIGHTS = "predictor.safetensors"
MANIFEST = "manifest.json"
MODEL_KINDS = ("linear", "mlp")


class ExitPredictor(nn.Module):
    """logit = f((x - mean) / std); f linear or Linear-GELU-Linear (fp32)."""

    def __init__(self, in_dim: int, kind: str = "linear", hidden: int = 64):
        super().__init__()
        if kind not in MODEL_KINDS:
            raise ValueError(f"predictor kind must be one of {MODEL_KINDS}, got {kind!r}")
        self.kind, self.in_dim, self.hidden = kind, in_dim, hidden
        self.register_buffer("feat_mean", torch.zeros(in_dim))
        self.register_buffer("feat_std", torch.ones(in_dim))
        if kind == "linear":
            self.net = nn.Linear(in_dim, 1)
        else:
            self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def set_normalization(self, features: torch.Tensor) -> None:
        with torch.no_grad():
            self.feat_mean.copy_(features.float().mean(0))
            self.feat_std.copy_(features.float().std(0).clamp_min(1e-4))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.float() - self.feat_mean) / self.feat_std
        return self.net(x).squeeze(-1)


def sha256_file(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_predictor(predictor: ExitPredictor, out_dir: str | os.PathLike,
                   manifest: dict[str, Any]) -> Path:
    """Write weights + manifest (the manifest gains format, model kind, weight checksum)."""
    from rltlab.common.atomic import write_bytes_atomic, write_json_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in predictor.state_dict().items()}
    # weights first, manifest last, both atomic: a manifest always vouches for whole weights
    # (train_from_traces resumes from checkpoints whose manifest exists)
    write_bytes_atomic(out / WEIGHTS, safetensors.torch.save(state, metadata={"format": "pt"}))
    full = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "model": {"kind": predictor.kind, "in_dim": predictor.in_dim,
                      "hidden": predictor.hidden},
            **manifest, "weights": {"file": WEIGHTS, "sha256": sha256_file(out / WEIGHTS)}}
    write_json_atomic(out / MANIFEST, full)
    return out


def read_predictor_manifest(path: str | os.PathLike) -> dict[str, Any]:
    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: not an exit-predictor checkpoint")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{file}: schema version {manifest.get('schema_version')} is not "
                         f"{SCHEMA_VERSION}")
    return manifest


def load_predictor(path: str | os.PathLike) -> tuple[ExitPredictor, dict[str, Any]]:
    """(predictor in eval mode, manifest); the weights' sha256 is checked."""
    root = Path(path)
    manifest = read_predictor_manifest(root)
    weights = root / manifest["weights"]["file"]
    if Path(manifest["weights"]["file"]).name != manifest["weights"]["file"]:
        raise ValueError(f"{root / MANIFEST} names weights outside the directory")
    if sha256_file(weights) != manifest["weights"]["sha256"]:
        raise ValueError(f"{weights} does not match the sha256 in its manifest: corrupt")
    spec = manifest["model"]
    predictor = ExitPredictor(spec["in_dim"], spec["kind"], spec["hidden"])
    predictor.load_state_dict(safetensors.torch.load_file(weights))
    return predictor.eval(), manifest
