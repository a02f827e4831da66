"""Random-weight Ouro models of named shapes and random prompts for them: what benches, tests and
pipeline runs use where no trained checkpoint is needed. Their quality figures mean nothing."""
from __future__ import annotations

import torch

from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4),
    "ouro-1.4b": dict(),   # OuroConfig's defaults: the real Ouro-1.4B shapes
}


def preset_config(name: str) -> OuroConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
    return OuroConfig(**PRESETS[name], total_ut_steps=4)


def random_model(config: OuroConfig, device="cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> OuroForCausalLM:
    """An OuroForCausalLM of `config` with seeded random weights (std 0.02), in eval mode."""
    with torch.device(device):
        model = OuroForCausalLM(config)
    return model.init_weights(seed, std=0.02).to(dtype).eval()


def random_prompts(num: int, length: int, vocab: int, seed: int,
                   spread: float = 0.0) -> list[list[int]]:
    """num random prompts of `length` tokens (ids 1..vocab-1); spread > 0: of lengths drawn
    uniformly from length x (1 - spread) .. length x (1 + spread), as real RL prompts' lengths
    differ (the fused prefill's eager steps pay per distinct length)."""
    if not 0 <= spread < 1:
        raise ValueError(f"prompt spread must be in [0, 1), got {spread!r}")
    gen = torch.Generator().manual_seed(seed)
    if not spread:
        return torch.randint(1, vocab, (num, length), generator=gen).tolist()
    lo, hi = max(1, round(length * (1 - spread))), longest_prompt(length, spread)
    lengths = torch.randint(lo, hi + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def longest_prompt(length: int, spread: float = 0.0) -> int:
    """The longest prompt random_prompts(length=length, spread=spread) can draw."""
    return round(length * (1 + spread))
