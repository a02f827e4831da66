"""OuroConfig: the Hugging Face `config.json` of an Ouro model, validated on construction."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    eos_token_id: int = 0
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
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"OuroConfig.{name} must be an int or null, got {value!r}")
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
        for token in ("bos_token_id", "eos_token_id"):
            value = getattr(self, token)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"OuroConfig.{token}={value} is outside the vocabulary")

    @property
    def num_rounds(self) -> int:
        return self.total_ut_steps

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OuroConfig":
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
        return cls.from_dict(data)

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
