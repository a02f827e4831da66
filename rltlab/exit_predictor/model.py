"""The exit predictor (linear or small MLP, fp32) and its checkpoint format.

A checkpoint is a directory:

    predictor.safetensors   weights + feature normalization (mean/std buffers)
    manifest.json           format, base model hash, hidden size, R, decision round N, k, exit
                            round, label definition, feature list, model kind, temperature,
                            threshold (+ target precision), training-data manifest checksum,
                            metrics, sha256 of predictor.safetensors

The calibrated probability is sigmoid(logit / temperature); the token is predicted to be able
to exit at N + k when that probability >= threshold. With members > 1 the logit is the mean of
that many independently seeded networks over the same normalized features (an ensemble: at the
0.99-precision thresholds the predictors are calibrated to, one network's recall moved by +-4
points from seed to seed on the same data, docs/experiments/n_plus_2.md, "The predictor").
"""
from __future__ import annotations

import hashlib
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


def check_members(members: Any) -> int:
    """members, if it is an int >= 1 (networks in one predictor), else a ValueError."""
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"predictor members must be an int >= 1, got {members!r}")
    return members


class ExitPredictor(nn.Module):
    """logit = f((x - mean) / std); f linear or Linear-GELU-Linear (fp32), or the mean of
    `members` such networks (module docstring)."""

    def __init__(self, in_dim: int, kind: str = "linear", hidden: int = 64, members: int = 1):
        super().__init__()
        if kind not in MODEL_KINDS:
            raise ValueError(f"predictor kind must be one of {MODEL_KINDS}, got {kind!r}")
        self.kind, self.in_dim, self.hidden = kind, in_dim, hidden
        self.members = check_members(members)
        self.register_buffer("feat_mean", torch.zeros(in_dim))
        self.register_buffer("feat_std", torch.ones(in_dim))

        def network() -> nn.Module:
            if kind == "linear":
                return nn.Linear(in_dim, 1)
            return nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

        if members == 1:    # one network keeps the "net." weight names of earlier checkpoints
            self.net = network()
        else:
            self.nets = nn.ModuleList(network() for _ in range(members))

    @classmethod
    def ensemble(cls, parts: list["ExitPredictor"]) -> "ExitPredictor":
        """One predictor whose logit is the mean of `parts`' logits: single networks of one
        kind and size, trained on the same features (equal normalization buffers)."""
        if not parts:
            raise ValueError("an ensemble needs at least one predictor")
        first = parts[0]
        for p in parts:
            if p.members != 1 or (p.kind, p.in_dim, p.hidden) != \
                    (first.kind, first.in_dim, first.hidden):
                raise ValueError("ensemble members must be single networks of one kind and size")
            if not (torch.equal(p.feat_mean, first.feat_mean)
                    and torch.equal(p.feat_std, first.feat_std)):
                raise ValueError("ensemble members must share their feature normalization")
        if len(parts) == 1:
            return first
        out = cls(first.in_dim, first.kind, first.hidden, members=len(parts))
        out.feat_mean.copy_(first.feat_mean)
        out.feat_std.copy_(first.feat_std)
        for net, p in zip(out.nets, parts):
            net.load_state_dict(p.net.state_dict())
        return out

    def set_normalization(self, features: torch.Tensor) -> None:
        with torch.no_grad():
            self.feat_mean.copy_(features.float().mean(0))
            self.feat_std.copy_(features.float().std(0).clamp_min(1e-4))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.float() - self.feat_mean) / self.feat_std
        if self.members == 1:
            return self.net(x).squeeze(-1)
        return torch.stack([net(x) for net in self.nets]).mean(0).squeeze(-1)


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
                      "hidden": predictor.hidden, "members": predictor.members},
            **manifest, "weights": {"file": WEIGHTS, "sha256": sha256_file(out / WEIGHTS)}}
    write_json_atomic(out / MANIFEST, full)
    return out


def read_predictor_manifest(path: str | os.PathLike) -> dict[str, Any]:
    from rltlab.common.json_fields import read_json_object

    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: not an exit-predictor checkpoint")
    manifest = read_json_object(file)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{file}: schema version {manifest.get('schema_version')} is not "
                         f"{SCHEMA_VERSION}")
    return manifest


def check_manifest_values(manifest: dict[str, Any], file: Path) -> None:
    """Raise ValueError naming the file and the field unless the rounds, calibration and model
    description can work: rounds 0 <= N < exit round <= R (k = exit round - N when given),
    temperature > 0, threshold in [0, 1], positive sizes, a known model kind."""
    from rltlab.common.json_fields import field

    def bad(key: str, want: str, value: Any):
        return ValueError(f"{file}: field {key!r} must be {want}, got {value!r:.80}")

    R = field(manifest, "num_rounds", file, "int")
    for key in ("num_rounds", "hidden_size"):
        if field(manifest, key, file, "int") < 1:
            raise bad(key, "an integer >= 1", manifest[key])
    n = field(manifest, "decision_round", file, "int")
    if not 0 <= n < R:
        raise bad("decision_round", f"a round in 0..{R - 1} (R = {R})", n)
    exit_round = field(manifest, "exit_round", file, "int")
    if not n < exit_round <= R:
        raise bad("exit_round", f"a round in {n + 1}..{R} (after decision round {n}, R = {R})",
                  exit_round)
    if field(manifest, "k", file, "int", optional=True) not in (None, exit_round - n):
        raise bad("k", f"exit_round - decision_round = {exit_round - n}", manifest["k"])
    temperature = field(manifest, "temperature", file, "number")
    if not temperature > 0:
        raise bad("temperature", "a finite number > 0", temperature)
    if not 0 <= field(manifest, "threshold", file, "number") <= 1:
        raise bad("threshold", "a number in [0, 1]", manifest["threshold"])
    spec = field(manifest, "model", file, "object")
    if field(spec, "kind", file, "str", where="model.") not in MODEL_KINDS:
        raise bad("model.kind", f"one of {MODEL_KINDS}", spec["kind"])
    for key in ("in_dim", "hidden"):
        if field(spec, key, file, "int", where="model.") < 1:
            raise bad(f"model.{key}", "an integer >= 1", spec[key])
    members = field(spec, "members", file, "int", where="model.", optional=True)
    if members is not None and members < 1:    # absent: one network (earlier checkpoints)
        raise bad("model.members", "an integer >= 1", members)
    weights = field(manifest, "weights", file, "object")
    for key in ("file", "sha256"):
        field(weights, key, file, "str", where="weights.")


def load_predictor(path: str | os.PathLike) -> tuple[ExitPredictor, dict[str, Any]]:
    """(predictor in eval mode, manifest); the manifest's values, the weights' sha256 and their
    finiteness are checked (errors name the file and the field or tensor)."""
    root = Path(path)
    manifest = read_predictor_manifest(root)
    check_manifest_values(manifest, root / MANIFEST)
    weights = root / manifest["weights"]["file"]
    if Path(manifest["weights"]["file"]).name != manifest["weights"]["file"]:
        raise ValueError(f"{root / MANIFEST} names weights outside the directory")
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} (named in {root / MANIFEST}) does not exist")
    if sha256_file(weights) != manifest["weights"]["sha256"]:
        raise ValueError(f"{weights} does not match the sha256 in its manifest: corrupt")
    spec = manifest["model"]
    predictor = ExitPredictor(spec["in_dim"], spec["kind"], spec["hidden"],
                              spec.get("members", 1))
    try:
        state = safetensors.torch.load_file(weights)
        predictor.load_state_dict(state)
    except Exception as err:   # safetensors / load_state_dict: the file's tensors do not fit
        raise ValueError(f"{weights} does not hold the {spec['kind']} predictor its manifest "
                         f"describes: {err}") from err
    bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(f"{weights}: tensor(s) {', '.join(sorted(bad))} hold NaN/Inf values; "
                         "refusing the predictor")
    return predictor.eval(), manifest
