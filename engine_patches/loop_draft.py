"""Load a trained loop-aware draft component (rltlab.draft_heads) onto a base model, checking that
it was trained for THIS model: base model hash (rltlab.model.checkpoint.model_hash: names, shapes,
dtype and bytes), hidden size, vocabulary and draft depth d.

    from rltlab.engine_patches.loop_draft import load_draft_component, speculative_kwargs
    comp = load_draft_component("runs/.../draft", model)            # raises on a mismatch
    out = speculative_generate(model, prompts, 64, k=4, **speculative_kwargs(comp))
"""
from __future__ import annotations

import json
from pathlib import Path

from rltlab.draft_heads.heads import META_FILE, build_component, component_kwargs
from rltlab.model.architecture import OuroForCausalLM


class IncompatibleDraftComponent(ValueError):
    pass


def read_metadata(path) -> dict:
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} holds no {META_FILE}: not a draft component")
    return json.loads(meta_path.read_text())


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
    component = build_component(meta["kind"], model, meta["draft_rounds"],
                                **meta.get("config", {}))
    component.load_weights(Path(path))
    param = next(model.parameters())
    return component.to(device=param.device, dtype=param.dtype).eval()


def speculative_kwargs(component) -> dict:
    """Keyword arguments of rltlab.engine.speculative.speculative_generate for a component."""
    return component_kwargs(component)
