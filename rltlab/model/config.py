"""OuroConfig: the Hugging Face `config.json` of an Ouro model, validated on construction."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


_REQUIRED_KEYS = ("rope_theta",)
_SUPPORTED_ACTS = ("silu", "swish")   # HF's ACT2FN maps both to SiLU


def _is_token_id(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


@dataclass
class OuroConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 65536
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int | list[int] | None = 0   # HF configs may list several stop ids
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings", "total_ut_steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"OuroConfig.{name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "early_exit_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"OuroConfig.{name} must be a number, got {value!r}")
            if not math.isfinite(value):   # json reads NaN / Infinity without complaint
                raise ValueError(f"OuroConfig.{name} must be finite, got {value!r}")
        if not _is_token_id(self.bos_token_id):
            raise ValueError(f"OuroConfig.bos_token_id must be an int or null, got "
                             f"{self.bos_token_id!r}")
        eos = self.eos_token_id
        if not (_is_token_id(eos) or (isinstance(eos, list) and eos
                                      and all(_is_token_id(t) and t is not None for t in eos))):
            raise ValueError("OuroConfig.eos_token_id must be an int, a non-empty list of ints "
                             f"or null, got {eos!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("OuroConfig.num_attention_heads must be a multiple of "
                             f"num_key_value_heads ({self.num_attention_heads} vs "
                             f"{self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"OuroConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ValueError("OuroConfig.early_exit_threshold must lie in [0, 1], got "
                             f"{self.early_exit_threshold}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("OuroConfig.rms_norm_eps and rope_theta must be positive")
        if self.tie_word_embeddings:
            raise ValueError("OuroConfig.tie_word_embeddings=True is not an Ouro model "
                             "(Ouro's lm_head is untied)")
        for token, values in (("bos_token_id", [self.bos_token_id]),
                              ("eos_token_id", list(self.eos_token_ids))):
            if any(v is not None and not 0 <= v < self.vocab_size for v in values):
                raise ValueError(f"OuroConfig.{token}={getattr(self, token)} is outside the "
                                 "vocabulary")
        self._refuse_unimplemented()

    def _refuse_unimplemented(self) -> None:
        """Config keys that change the computation in the HF code but not here: refused rather
        than silently ignored (null means unset and is fine). A NaN / Infinity in any other
        top-level key (initializer_range, ...) marks a broken file: refused too."""
        for key, value in self.extra.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"OuroConfig.{key} must be finite, got {value!r}")
        if self.extra.get("rope_scaling") is not None:
            raise ValueError(f"OuroConfig.rope_scaling={self.extra['rope_scaling']!r} is not "
                             "implemented: rltlab computes plain RoPE from rope_theta, so this "
                             "checkpoint would run with other positions than it was trained "
                             "with. Remove the key (or set it to null) only if that is intended")
        step = self.extra.get("early_exit_step")
        if step is not None:
            hint = (f" (for depth {step + 1} use SamplingParams(exit_policy='fixed', "
                    f"exit_policy_args={{'depth': {step + 1}}}))" if _is_token_id(step) else "")
            raise ValueError(f"OuroConfig.early_exit_step={step!r} is not implemented: the HF "
                             "code then emits every token from that round, rltlab chooses "
                             "exits per token through the engine's exit policies" + hint +
                             "; remove the key or set it to null")
        act = self.extra.get("hidden_act", "silu")     # missing: HF's default, silu
        if act not in _SUPPORTED_ACTS:
            raise ValueError(f"OuroConfig.hidden_act={act!r} is not implemented: rltlab's MLP "
                             "computes down(silu(gate(x)) * up(x)) whatever the key says; the "
                             "supported value is 'silu' (HF's alias 'swish' is taken too)")
        self._refuse_sliding_window()

    def _refuse_sliding_window(self) -> None:
        """Sliding-window attention, as the HF Qwen2-style config classes read it: layer i slides
        when `use_sliding_window` is true, `sliding_window` is not null (the classes default it
        to 4096 when missing) and i >= `max_window_layers` (a class default when missing: no
        guess, refused); an explicit `layer_types` list decides instead. rltlab attends over
        the full context, so any sliding layer is refused."""
        layer_types = self.extra.get("layer_types")
        if layer_types is not None:
            if (not isinstance(layer_types, list) or len(layer_types) != self.num_hidden_layers
                    or any(t != "full_attention" for t in layer_types)):
                raise ValueError(f"OuroConfig.layer_types={layer_types!r} is not implemented: "
                                 "rltlab attends over the full context in every layer; the "
                                 f"supported value is {self.num_hidden_layers} x "
                                 "'full_attention' (or null)")
            return
        use = self.extra.get("use_sliding_window", False)
        window = self.extra.get("sliding_window", 4096)
        if not use or window is None:
            return
        first = self.extra.get("max_window_layers")
        if isinstance(first, int) and not isinstance(first, bool) \
                and first >= self.num_hidden_layers:
            return          # HF would slide no layer (layers >= max_window_layers slide)
        which = ("every layer from max_window_layers=" f"{first!r} on" if first is not None
                 else "layers from max_window_layers on (not stated: a class default)")
        raise ValueError(f"OuroConfig.use_sliding_window={use!r} (sliding_window={window!r}) is "
                         f"not implemented: HF attends within the window in {which}, rltlab "
                         "attends over the full context. Set use_sliding_window to false (or "
                         "sliding_window to null) only if full attention is intended")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (eos_token_id as a tuple; empty when null)."""
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)

    @property
    def num_rounds(self) -> int:
        return self.total_ut_steps

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OuroConfig":
        """From a config.json's content. Keys that a checkpoint must state are required: the
        dataclass defaults are Ouro-1.4B's, while Qwen2-style config classes default a missing
        rope_theta to 10000.0, so guessing either could silently change every position's
        rotation."""
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise ValueError(f"config has no {', '.join(missing)}: state it explicitly (Ouro "
                             "checkpoints use rope_theta 1000000.0, Qwen2-style config classes "
                             "default to 10000.0; rltlab does not guess)")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "OuroConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"architectures": ["OuroForCausalLM"], "model_type": "ouro"}
        # Keys without effect on the computation (torch_dtype, hidden_act, ...) are kept so that
        # save_pretrained writes back what from_pretrained read.
        data.update(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                data[f.name] = getattr(self, f.name)
        return data

    def num_parameters(self) -> int:
        """Parameter count implied by the config (matches the model built from it)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 4 * h
        return 2 * self.vocab_size * h + layers * per_layer + h + h + 1
