"""Trainable draft components for loop-aware speculative decoding (docs/ouro.md).

Reuse-exact (they read the frozen round-d state h_d; the draft's rounds 1..d stay the target's):
  * ResidualMLPHead:  logits = lm_head(h_d + down(silu(up(norm(h_d))))), `down` zero-initialised
    (so an untrained head IS the shallow drafter), lm_head frozen and shared with the target.
  * LoraLMHead:       a PEFT LoRA on a draft-only copy of lm_head (the copy shares the frozen base
    weight; only the LoRA matrices are new). Saved in PEFT format (save_pretrained).
Not reuse-exact:
  * LayerLoraDrafter: a PEFT LoRA on the shared layers, active on the draft path only (a copy of
    the model sharing the frozen base weights). Verification must recompute rounds 1..d.

Every component is called as head(h) -> logits and records its draft_rounds; `save_component`
/ `load_component` write / read it with a draft_component.json of compatibility metadata.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from rltlab import kernels
from rltlab.model.architecture import OuroForCausalLM, RMSNorm

META_FILE = "draft_component.json"
LAYER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _shared_copy(module: nn.Module) -> nn.Module:
    """deepcopy whose parameters ARE the original's (frozen base weights cost no memory)."""
    return copy.deepcopy(module, memo={id(p): p for p in module.parameters()})


class ResidualMLPHead(nn.Module):
    kind = "residual_mlp"
    reuse_exact = True

    def __init__(self, model: OuroForCausalLM, draft_rounds: int = 1, inner: int | None = None):
        super().__init__()
        hidden = model.config.hidden_size
        self.draft_rounds, self.inner = draft_rounds, inner or 2 * hidden
        self.norm = RMSNorm(hidden, model.config.rms_norm_eps)
        self.up = nn.Linear(hidden, self.inner, bias=False)
        self.down = nn.Linear(self.inner, hidden, bias=False)
        nn.init.normal_(self.up.weight, std=hidden ** -0.5)
        nn.init.zeros_(self.down.weight)
        self._lm_head = [model.lm_head]     # not a submodule: frozen, not saved, not trained
        param = next(model.parameters())
        self.to(device=param.device, dtype=param.dtype)   # where the model is (a GPU: there)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.is_cuda and h.dim() == 2 and not torch.is_grad_enabled():
            return self.fused_forward(h)
        return self._lm_head[0](h + self.down(F.silu(self.up(self.norm(h)))))

    def fused_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The same map in 5 kernels instead of ~11 (Triton RMSNorm; the residual add folded
        into the down projection's GEMM): drafting runs it K times per speculative iteration,
        where a tiny model's cost is mostly kernel count. Inference only (no backward)."""
        normed = kernels.rmsnorm(h.contiguous(), self.norm.weight, self.norm.eps)
        inner = F.silu(self.up(normed))
        return self._lm_head[0](torch.addmm(h, inner, self.down.weight.t()))

    def adapter_parameters(self):
        return list(self.parameters())

    def config_dict(self) -> dict:
        return {"inner": self.inner}

    def save_weights(self, out: Path) -> None:
        safetensors.torch.save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                                    str(out / "head.safetensors"))

    def load_weights(self, src: Path) -> None:
        self.load_state_dict(safetensors.torch.load_file(str(src / "head.safetensors")))


class _HeadCopy(nn.Module):
    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.proj = _shared_copy(lm_head)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class LoraLMHead(nn.Module):
    kind = "lora_lm_head"
    reuse_exact = True

    def __init__(self, model: OuroForCausalLM, draft_rounds: int = 1, r: int = 16,
                 alpha: int | None = None):
        super().__init__()
        from peft import LoraConfig, get_peft_model
        self.draft_rounds, self.r, self.alpha = draft_rounds, r, alpha or 2 * r
        config = LoraConfig(r=r, lora_alpha=self.alpha, lora_dropout=0.0,
                            target_modules=["proj"])
        flags = model.lm_head.weight.requires_grad
        self.peft = get_peft_model(_HeadCopy(model.lm_head), config)
        model.lm_head.weight.requires_grad_(flags)   # get_peft_model froze the shared weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.peft(h)

    def adapter_parameters(self):
        return [p for n, p in self.peft.named_parameters() if "lora_" in n]

    def config_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha}

    def save_weights(self, out: Path) -> None:
        self.peft.save_pretrained(str(out / "peft"))

    def load_weights(self, src: Path) -> None:
        from peft import set_peft_model_state_dict
        state = safetensors.torch.load_file(str(src / "peft" / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.peft, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"unexpected adapter tensors: {result.unexpected_keys[:5]}")


class LayerLoraDrafter(nn.Module):
    """LoRA on the shared layers, draft path only: pass `.draft_model` to speculative_generate
    (verification then recomputes rounds 1..d with the target's layers)."""
    kind = "layer_lora"
    reuse_exact = False

    def __init__(self, model: OuroForCausalLM, draft_rounds: int = 1, r: int = 8,
                 alpha: int | None = None):
        super().__init__()
        from peft import LoraConfig, get_peft_model
        self.draft_rounds, self.r, self.alpha = draft_rounds, r, alpha or 2 * r
        flags = {id(p): p.requires_grad for p in model.parameters()}
        config = LoraConfig(r=r, lora_alpha=self.alpha, lora_dropout=0.0,
                            target_modules=LAYER_TARGETS)
        self.peft = get_peft_model(_shared_copy(model), config)
        for p in model.parameters():     # get_peft_model froze the shared base weights
            p.requires_grad_(flags[id(p)])
        self._lm_head = [model.lm_head]

    @property
    def draft_model(self) -> OuroForCausalLM:
        return self.peft.get_base_model()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._lm_head[0](h)

    def draft_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced draft logits [B, T, V]: rounds 1..d of the adapted layers."""
        exits = torch.full_like(input_ids, self.draft_rounds)
        return self.draft_model(input_ids, exit_rounds=exits).final_logits

    adapter_parameters = LoraLMHead.adapter_parameters
    config_dict = LoraLMHead.config_dict
    save_weights = LoraLMHead.save_weights
    load_weights = LoraLMHead.load_weights


KINDS = {cls.kind: cls for cls in (ResidualMLPHead, LoraLMHead, LayerLoraDrafter)}


class Fp32Base(nn.Module):
    """What a reuse-exact component is built and distilled on where the model is not fp32
    (bfloat16 on a GPU): the model's config and a frozen fp32 copy of its lm_head, on the
    model's device (no other weights). The adapter then trains in fp32 (AdamW's small updates
    survive) on h_d cast to fp32; save_component(component, model) records the model itself,
    and load_draft_component puts the saved component onto the model in its dtype."""

    def __init__(self, model: OuroForCausalLM):
        super().__init__()
        self.config = model.config
        weight = model.lm_head.weight
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                 device=weight.device, dtype=torch.float32)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.float())
        self.lm_head.requires_grad_(False)


def training_base(model: OuroForCausalLM, kind: str):
    """The model a component of `kind` is built and trained on: the model itself when it is
    fp32 or the kind is not reuse-exact (layer_lora adapts the shared layers), else Fp32Base."""
    if KINDS[kind].reuse_exact and next(model.parameters()).dtype != torch.float32:
        return Fp32Base(model)
    return model


def component_input(component, h: torch.Tensor) -> torch.Tensor:
    """h in the dtype of the component's weights (h_d of a bf16 model for an fp32 head)."""
    dtype = next(component.parameters()).dtype
    return h if h.dtype == dtype else h.to(dtype)


def component_settings(kind: str) -> tuple[str, ...]:
    """The keyword settings of a component kind (its constructor's, after model and
    draft_rounds): what draft_component.json's "config" may hold."""
    import inspect

    params = list(inspect.signature(KINDS[kind].__init__).parameters)
    return tuple(p for p in params if p not in ("self", "model", "draft_rounds"))


def saved_tensors(component) -> dict[str, torch.Tensor]:
    """The tensors a component's weight files hold (the LoRA kinds: only the adapters; the
    frozen base weights they share are the model's)."""
    state = component.state_dict()
    if isinstance(component, ResidualMLPHead):
        return state
    return {name: tensor for name, tensor in state.items() if "lora_" in name}


def build_component(kind: str, model: OuroForCausalLM, draft_rounds: int = 1, **kwargs):
    if kind not in KINDS:
        raise ValueError(f"unknown draft component {kind!r}; known: {sorted(KINDS)}")
    if not 1 <= draft_rounds < model.config.num_rounds:
        raise ValueError(f"draft_rounds must lie in [1, {model.config.num_rounds - 1}]")
    unknown = sorted(set(kwargs) - set(component_settings(kind)))
    if unknown:
        raise ValueError(f"{unknown} are not settings of draft component {kind!r} (its "
                         f"settings: {', '.join(component_settings(kind))})")
    return KINDS[kind](model, draft_rounds, **kwargs)


def save_component(component, model: OuroForCausalLM, out_dir, extra: dict | None = None) -> Path:
    """<out_dir>/draft_component.json + the weights (PEFT format for the LoRA kinds).

    Crash-safe: the old metadata goes first, the weights are written to a temporary directory
    and moved into place file by file (rltlab.common.atomic), the metadata (with every weight file's
    sha256, "files") lands last, atomically; files of an earlier component that the new one
    does not have are removed. So a directory holding draft_component.json holds the finished
    component it describes (`component_files_ok` checks the digests)."""
    import tempfile

    from rltlab.common.atomic import write_bytes_atomic, write_text_atomic
    from rltlab.model.checkpoint import model_hash
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / META_FILE
    old_files = set()
    if meta_path.is_file():
        old_files = set(json.loads(meta_path.read_text()).get("files", {}))
        meta_path.unlink()              # not a finished component until the new metadata lands
    files = {}
    with tempfile.TemporaryDirectory(prefix=".draft-component-", dir=out) as tmp:
        component.save_weights(Path(tmp))
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                rel, data = path.relative_to(tmp).as_posix(), path.read_bytes()
                write_bytes_atomic(out / rel, data)
                files[rel] = hashlib.sha256(data).hexdigest()
    for rel in sorted(old_files - set(files)):
        (out / rel).unlink(missing_ok=True)
    meta = {"kind": component.kind, "draft_rounds": component.draft_rounds,
            "config": component.config_dict(), "base_model_hash": model_hash(model),
            "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size,
            "num_rounds": model.config.num_rounds, "reuse_exact": component.reuse_exact,
            **(extra or {}), "files": files}
    write_text_atomic(meta_path, json.dumps(meta, indent=2) + "\n")
    return out


def component_files_ok(path) -> bool:
    """Whether <path> holds a finished component: its metadata and every weight file it lists,
    with the recorded sha256 (metadata written before the digests were recorded: False)."""
    from rltlab.common.json_fields import read_json_object

    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        return False
    try:
        files = read_json_object(meta_path).get("files")
    except ValueError:   # truncated or not an object: not a finished component
        return False
    if not files or not isinstance(files, dict):
        return False
    for rel, digest in files.items():
        f = Path(path) / rel
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            return False
    return True


def component_kwargs(component) -> dict:
    """speculative_generate keyword arguments for a component."""
    kwargs = {"draft_rounds": component.draft_rounds, "head": component}
    if not component.reuse_exact:
        kwargs["draft_model"] = component.draft_model
    return kwargs
