"""The Ouro looped transformer in plain PyTorch, with Hugging Face weight names.

One module serves as the trainable model (autograd: the shared layers accumulate gradients
from every round) and as the numerics reference of the rollout engine. A forward runs up to
R rounds of the same decoder layers; after each round `model.norm` gives h_r, which feeds the
next round, the exit gate and (for an exiting token) lm_head.

LAST_EXITED semantics (docs/ouro.md, KV semantics): every round d has its own K/V plane; a
token that exits after round e keeps its round-e K/V in every deeper plane, so a later query
at round d sees that token's version min(d, e). Positions that already exited still flow through the
layers (their results are discarded), which keeps this reference simple and batch-shaped.

SELECT_ONLY semantics (what the public Hugging Face Ouro code does with `exit_threshold`):
every position runs all R rounds at full depth and writes its own K/V in every plane; the exit
rule only selects which round's state a position's output (final_hidden / final_logits) comes
from. It equals LAST_EXITED when no position exits before R.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rltlab.model.config import OuroConfig
from rltlab.model.gates import at_least_fp32

# exit_fn(round_idx, gate_logits[B, T, round_idx] fp32, h_r[B, T, H]) -> bool[B, T] "exit now".
ExitFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]

LAST_EXITED, SELECT_ONLY = "last_exited", "select_only"
EXIT_SEMANTICS = (LAST_EXITED, SELECT_ONLY)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in (at least) fp32, cast back, then scale: the order matters in bf16.
        x32 = at_least_fp32(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [*positions.shape, head_dim] (rotate-half layout), inv_freq in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LoopedKVCache:
    """Contiguous per-round K/V planes for the plain generation loop: [R, L, B, Hkv, S, D]."""

    def __init__(self, config: OuroConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (config.num_rounds, config.num_hidden_layers, batch_size,
                 config.num_key_value_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x, cos, sin, mask, ctx: "_RoundContext", layer_idx: int):
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = ctx.effective_kv(layer_idx, k, v)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """The "sandwich" layer: four RMSNorms, two around each sub-block."""

    def __init__(self, config: OuroConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = OuroAttention(config)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, h, cos, sin, mask, ctx, layer_idx):
        attn = self.self_attn(self.input_layernorm(h), cos, sin, mask, ctx, layer_idx)
        h = h + self.input_layernorm_2(attn)
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class _RoundContext:
    """Supplies each layer with the K/V it must attend over in the current round.

    Positions that exited earlier contribute their previous (effective) K/V instead of the
    freshly computed one: that is LAST_EXITED. With a cache, the effective K/V of the new
    tokens is written into the current round's plane and the whole prefix is read back.
    """

    def __init__(self, num_layers: int, cache: LoopedKVCache | None, start: int):
        self.prev: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.cache, self.start = cache, start
        self.plane = 0
        self.active: torch.Tensor | None = None

    def effective_kv(self, layer_idx, k, v):
        prev = self.prev[layer_idx]
        if prev is not None and self.active is not None:
            keep_new = self.active[:, None, :, None]
            k, v = torch.where(keep_new, k, prev[0]), torch.where(keep_new, v, prev[1])
        self.prev[layer_idx] = (k, v)
        if self.cache is None:
            return k, v
        end = self.start + k.shape[2]
        self.cache.k[self.plane, layer_idx, :, :, self.start:end] = k
        self.cache.v[self.plane, layer_idx, :, :, self.start:end] = v
        return (self.cache.k[self.plane, layer_idx, :, :, :end],
                self.cache.v[self.plane, layer_idx, :, :, :end])


@dataclass
class LoopedOutput:
    # h_r per executed round, [B, T, H] (LAST_EXITED: frozen after exit; SELECT_ONLY: never)
    hidden_states: list[torch.Tensor]
    gate_logits: torch.Tensor             # [B, T, rounds executed], fp32 (fp64 in fp64)
    exit_rounds: torch.Tensor             # [B, T] int64, 1-based round each position emits from
    final_hidden: torch.Tensor            # [B, T, H] = h at each position's exit round
    logits: list[torch.Tensor] | None     # per-round logits, when all_logits=True
    final_logits: torch.Tensor | None     # lm_head(final_hidden), when logits are requested


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.config = config
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "OuroForCausalLM":
        """Random init (normal(0, std) matrices, unit norms, gate bias 0) from a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    param.fill_(1.0)
                elif name.endswith("early_exit_gate.bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        return self

    def round_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, *, exit_rounds: torch.Tensor | None = None,
                exit_fn: ExitFn | None = None, positions: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, cache: LoopedKVCache | None = None,
                all_logits: bool = False, logits: bool = True,
                exit_semantics: str = LAST_EXITED) -> LoopedOutput:
        """Run the looped model on input_ids [B, T].

        exit_rounds [B, T] (1-based) fixes each position's exit round (teacher forcing);
        exit_fn decides after each round; with neither, every position runs all R rounds.
        exit_semantics: LAST_EXITED (an exited position stops; deeper rounds see its exit-round
        K/V) or SELECT_ONLY (every position runs all R rounds with full-depth K/V; its exit
        round only selects the state its output comes from).
        key_mask [B, T] marks real (non-padding) tokens; positions default to the cache offset.
        """
        if exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"exit_semantics must be one of {EXIT_SEMANTICS}, "
                             f"got {exit_semantics!r}")
        select_only = exit_semantics == SELECT_ONLY
        cfg, num_rounds = self.config, self.config.num_rounds
        bsz, seq = input_ids.shape
        if exit_rounds is not None:
            if exit_rounds.shape != input_ids.shape:
                raise ValueError(f"exit_rounds shape {tuple(exit_rounds.shape)} != input_ids "
                                 f"shape {tuple(input_ids.shape)}")
            if exit_rounds.min() < 1 or exit_rounds.max() > num_rounds:
                raise ValueError(f"exit_rounds must lie in [1, {num_rounds}]")
            exit_fn = lambda r, _g, _h: exit_rounds == r  # noqa: E731
        start = cache.length if cache is not None else 0
        if cache is not None and start + seq > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} positions; {start + seq} needed")
        if positions is None:
            positions = torch.arange(start, start + seq, device=input_ids.device).expand(bsz, -1)
        if key_mask is None:
            key_mask = torch.ones(bsz, seq, dtype=torch.bool, device=input_ids.device)
        mask = self._attention_mask(key_mask, cache, start)

        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, h.dtype)
        cos, sin = cos[:, None], sin[:, None]
        ctx = _RoundContext(cfg.num_hidden_layers, cache, start)
        active = torch.ones(bsz, seq, dtype=torch.bool, device=input_ids.device)
        exit_round = torch.full((bsz, seq), num_rounds, dtype=torch.long, device=h.device)
        hidden_states, gates, round_logits = [], [], []
        selected = None   # SELECT_ONLY: h of each position's exit round, once it is reached
        for r in range(1, num_rounds + 1):
            # SELECT_ONLY keeps every position's fresh K/V (ctx.active None: nothing replaced)
            ctx.plane, ctx.active = r - 1, (active if r > 1 and not select_only else None)
            x = h
            for idx, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, mask, ctx, idx)
            h = self.model.norm(x) if select_only else torch.where(active[..., None],
                                                                    self.model.norm(x), h)
            hidden_states.append(h)
            gates.append(at_least_fp32(self.model.early_exit_gate(h)).squeeze(-1))
            if all_logits:
                round_logits.append(self.lm_head(h))
            if r < num_rounds and exit_fn is not None:
                exits = active & exit_fn(r, torch.stack(gates, dim=-1), h)
                exit_round = torch.where(exits, torch.full_like(exit_round, r), exit_round)
                if select_only:
                    kept = h if selected is None else selected
                    selected = torch.where(exits[..., None], h, kept)
                active = active & ~exits
            if not active.any() and not select_only:
                break
        if select_only and selected is not None:   # positions still active take round R
            h = torch.where(active[..., None], h, selected)
        if cache is not None:
            self._finalize_cache(cache, start, seq, executed=len(hidden_states), key_mask=key_mask)
        if not logits:
            final_logits = None
        elif all_logits and not select_only:   # h is the last round's, frozen after each exit
            final_logits = round_logits[-1]
        else:
            final_logits = self.lm_head(h)
        return LoopedOutput(hidden_states, torch.stack(gates, dim=-1), exit_round, h,
                            round_logits if all_logits else None, final_logits)

    def _attention_mask(self, key_mask, cache, start):
        """bool [B, 1, T, start+T]: causal, padding keys hidden, a query always sees itself."""
        bsz, seq = key_mask.shape
        keys = key_mask if cache is None else torch.cat(
            [cache.key_mask[:, :start], key_mask], dim=1)
        q_pos = torch.arange(start, start + seq, device=key_mask.device)[:, None]
        k_pos = torch.arange(start + seq, device=key_mask.device)[None, :]
        allowed = (k_pos <= q_pos)[None] & keys[:, None, :]
        allowed = allowed | (k_pos == q_pos)[None]
        return allowed[:, None]

    @staticmethod
    def _finalize_cache(cache, start, seq, executed, key_mask):
        end = start + seq
        # Every token exited by round `executed`: deeper planes get last-exited copies.
        for plane in range(executed, cache.k.shape[0]):
            cache.k[plane, :, :, :, start:end] = cache.k[executed - 1, :, :, :, start:end]
            cache.v[plane, :, :, :, start:end] = cache.v[executed - 1, :, :, :, start:end]
        cache.key_mask[:, start:end] = key_mask
        cache.length = end
