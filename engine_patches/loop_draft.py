"""Load a trained loop-aware draft component (rltlab.draft_heads) onto a base model, checking that
it was trained for THIS model: base model hash (rltlab.model.checkpoint.model_hash: names, shapes,
dtype and bytes), hidden size, vocabulary and draft depth d. The metadata is checked field by
field, every weight file against the sha256 the metadata records, and the loaded tensors for
NaN/Inf; errors name the file, field or tensor and the component.

    from rltlab.engine_patches.loop_draft import load_draft_component, speculative_kwargs
    comp = load_draft_component("runs/.../draft", model)            # raises on a mismatch
    out = speculative_generate(model, prompts, 64, k=4, **speculative_kwargs(comp))
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from rltlab.common.json_fields import field, read_json_object
from rltlab.draft_heads.heads import (KINDS, META_FILE, build_component, component_kwargs,
                                      component_settings, saved_tensors)
from rltlab.engine.spec.proposers import DraftProposer
from rltlab.model.architecture import OuroForCausalLM


class IncompatibleDraftComponent(ValueError):
    pass


def read_metadata(path) -> dict:
    """The component's metadata, its fields checked (ValueError naming file and field)."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} holds no {META_FILE}: not a draft component")
    meta = read_json_object(meta_path)
    kind = field(meta, "kind", meta_path, "str")
    if kind not in KINDS:
        raise ValueError(f"{meta_path}: field 'kind' must be one of {sorted(KINDS)}, "
                         f"got {kind!r}")
    field(meta, "draft_rounds", meta_path, "int")
    settings = field(meta, "config", meta_path, "object", optional=True) or {}
    unknown = sorted(set(settings) - set(component_settings(kind)))
    if unknown:
        raise ValueError(f"{meta_path}: field 'config.{unknown[0]}' is not a setting of kind "
                         f"{kind!r} (its settings: {', '.join(component_settings(kind))})")
    files = field(meta, "files", meta_path, "object", optional=True) or {}
    for rel, digest in files.items():
        if not isinstance(digest, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{meta_path}: field 'files.{rel}' must map a file inside the "
                             f"component to its sha256, got {digest!r:.80}")
    return meta


def check_compatible(meta: dict, model: OuroForCausalLM, draft_rounds: int | None = None,
                     check_hash: bool = True) -> None:
    """Raise IncompatibleDraftComponent naming every field that does not match."""
    from rltlab.model.checkpoint import model_hash
    cfg, problems = model.config, []
    for key, want in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size),
                      ("num_rounds", cfg.num_rounds)):
        if meta.get(key) != want:
            problems.append(f"{key}: component {meta.get(key)} vs model {want}")
    d = meta.get("draft_rounds")
    if not isinstance(d, int) or not 1 <= d < cfg.num_rounds:
        problems.append(f"draft_rounds {d!r} outside [1, {cfg.num_rounds - 1}]")
    if draft_rounds is not None and d != draft_rounds:
        problems.append(f"draft_rounds: component {d} vs requested {draft_rounds}")
    if check_hash and not problems and meta.get("base_model_hash") != model_hash(model):
        problems.append(f"base_model_hash: component {meta.get('base_model_hash')} vs model "
                        f"{model_hash(model)} (other weights or dtype)")
    if problems:
        raise IncompatibleDraftComponent("draft component does not fit this model: "
                                         + "; ".join(problems))


def load_draft_component(path, model: OuroForCausalLM, draft_rounds: int | None = None,
                         check_hash: bool = True):
    """Build the component recorded in <path>/draft_component.json and load its weights, on
    the model's device and in its dtype (the hash check already pins the dtype)."""
    meta = read_metadata(path)
    check_compatible(meta, model, draft_rounds, check_hash)
    name = f"draft component {meta['kind']!r} at {path}"
    for rel, digest in meta.get("files", {}).items():   # recorded by save_component
        file = Path(path) / rel
        if not file.is_file():
            raise FileNotFoundError(f"{name}: {file} (listed in {META_FILE}) does not exist")
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise ValueError(f"{name}: {file} does not match the sha256 recorded in "
                             f"{META_FILE}: truncated, corrupt or replaced")
    component = build_component(meta["kind"], model, meta["draft_rounds"],
                                **meta.get("config", {}))
    try:
        component.load_weights(Path(path))
    except Exception as err:   # safetensors / PEFT: unreadable or mismatched weight files
        raise ValueError(f"{name}: cannot load its weights: {err}") from err
    bad = [n for n, t in saved_tensors(component).items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"{name}: tensor(s) {', '.join(sorted(bad)[:5])} hold NaN/Inf values; "
                         "refusing the head")
    param = next(model.parameters())
    return component.to(device=param.device, dtype=param.dtype).eval()


def speculative_kwargs(component) -> dict:
    """Keyword arguments of rltlab.model.speculative.speculative_generate for a component."""
    return component_kwargs(component)


def load_proposer(path, model, num_draft_tokens: int = 4, check_hash: bool = True
                  ) -> DraftProposer:
    """A DraftProposer from a trained component directory (load_draft_component checks
    that it fits the model). Load it onto the model the engine runs (same dtype/device)."""
    comp = load_draft_component(path, model, check_hash=check_hash)
    return DraftProposer(num_draft_tokens, comp.draft_rounds, comp)
