"""Runs one round of the shared layers for a heterogeneous batch over the paged round planes.

KV layout: kv_cache [num_layers, 2, R, num_blocks, block_size, Hkv, D]; plane d-1 holds round d;
slot = block * block_size + offset. A row is one sequence's span at its own round d: its active
tokens write their K/V into plane d, then attend over plane d for positions 0..pos (LAST_EXITED:
a position that exited at e < d has its round-e K/V copied there). The math is the reference
model's, module by module (rltlab.model): same norms, projections, RoPE and SDPA.

Attention is plain torch for every device: rows are padded into [B, max_q] queries and
[B, max_ctx] keys gathered through the block tables, with a causal mask per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltlab import kernels
from rltlab.model import OuroForCausalLM, apply_rope, rope_cos_sin
from rltlab.engine.sequence import Sequence


@dataclass
class RoundBatch:
    """Per-token and per-row index tensors of one step (built once, used by every layer)."""
    hidden: torch.Tensor       # [T, H] round input (embedding for round 1)
    positions: torch.Tensor    # int64 [T]
    rounds: torch.Tensor       # int64 [T] (1-based)
    slots: torch.Tensor        # int64 [T]
    row_planes: torch.Tensor   # int64 [B]: plane (round - 1) each row reads
    tok_row: torch.Tensor      # int64 [T]: row of each token
    tok_col: torch.Tensor      # int64 [T]: index of each token within its row
    key_slots: torch.Tensor    # int64 [B, max_ctx]
    mask: torch.Tensor         # bool [B, 1, groups * max_q, max_ctx] (GQA: per query group)
    row_sizes: list[int]


class ModelRunner:
    def __init__(self, model: OuroForCausalLM, num_blocks: int, block_size: int):
        cfg = model.config
        self.model, self.config, self.block_size = model, cfg, block_size
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        shape = (cfg.num_hidden_layers, 2, cfg.num_rounds, num_blocks, block_size,
                 cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._flat = self.kv_cache.view(cfg.num_hidden_layers, 2, cfg.num_rounds,
                                        num_blocks * block_size, cfg.num_key_value_heads,
                                        cfg.head_dim)
        # Triton only on CUDA: on CPU the interpreter (TRITON_INTERPRET=1) would be pointless.
        self._use_triton = self.device.type == "cuda" and kernels.triton_available(self.device)

    # ------------------------------------------------------------------------ batch building
    def prepare(self, seqs: list[Sequence]) -> RoundBatch:
        dev, bs = self.device, self.block_size
        positions, rounds, first_round_ids, hidden_parts = [], [], [], []
        for seq in seqs:
            span = seq.span
            positions.append(span.start + span.active)
            rounds.append(span.round + 1)
            if span.round == 0:
                first_round_ids.append(torch.tensor(seq.token_ids(span.start,
                                                                  span.start + span.length)))
                hidden_parts.append(None)
            else:
                hidden_parts.append(span.hidden)
        if first_round_ids:
            embedded = iter(self.model.model.embed_tokens(
                torch.cat(first_round_ids).to(dev)).split([len(t) for t in first_round_ids]))
            hidden_parts = [h if h is not None else next(embedded) for h in hidden_parts]
        sizes = [int(p.numel()) for p in positions]
        row_t = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(sizes))
        col_t = torch.cat([torch.arange(n) for n in sizes])
        pos_t = torch.cat(positions)
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table_t for s in seqs],
                                                 batch_first=True)
        slots = tables[row_t, pos_t // bs] * bs + pos_t % bs
        max_q, max_ctx = max(sizes), int(pos_t.max()) + 1
        keys = torch.arange(max_ctx)
        key_slots = tables[:, keys // bs] * bs + keys % bs   # past a row's context: masked
        query_pos = torch.zeros(len(seqs), max_q, dtype=torch.long)  # padding sees key 0 only
        query_pos[row_t, col_t] = pos_t
        mask = keys[None, None, :] <= query_pos[:, :, None]
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        return RoundBatch(
            hidden=torch.cat(hidden_parts), positions=pos_t.to(dev),
            rounds=torch.repeat_interleave(torch.tensor(rounds), torch.tensor(sizes)).to(dev),
            slots=slots.to(dev), row_planes=torch.tensor(rounds, device=dev) - 1,
            tok_row=row_t.to(dev), tok_col=col_t.to(dev), key_slots=key_slots.to(dev),
            mask=mask[:, None].repeat(1, 1, groups, 1).to(dev), row_sizes=sizes)

    # ------------------------------------------------------------------------------ one round
    @torch.no_grad()
    def run_round(self, batch: RoundBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h_r [T, H] after model.norm, gate logits fp32 [T])."""
        cfg, model = self.config, self.model.model
        cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        cos, sin = cos[:, None], sin[:, None]
        planes = batch.rounds - 1
        x = batch.hidden
        for idx, layer in enumerate(model.layers):
            attn = self._attention(idx, layer.self_attn, layer.input_layernorm(x), cos, sin,
                                   planes, batch)
            x = x + layer.input_layernorm_2(attn)
            x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
        h = model.norm(x)
        return h, model.early_exit_gate(h).float().squeeze(-1)

    def _attention(self, idx, attn, x, cos, sin, planes, batch: RoundBatch) -> torch.Tensor:
        num_tokens, d = x.shape[0], attn.head_dim
        q = attn.q_proj(x).view(num_tokens, attn.num_heads, d)
        k = attn.k_proj(x).view(num_tokens, attn.num_kv_heads, d)
        v = attn.v_proj(x).view(num_tokens, attn.num_kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self._flat[idx, 0, planes, batch.slots] = k
        self._flat[idx, 1, planes, batch.slots] = v
        kv_heads, groups = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads
        rows, max_q = batch.key_slots.shape[0], batch.mask.shape[2] // groups
        keys = self._flat[idx, 0, batch.row_planes[:, None], batch.key_slots]  # [B, ctx, Hkv, D]
        values = self._flat[idx, 1, batch.row_planes[:, None], batch.key_slots]
        queries = q.new_zeros(rows, max_q, attn.num_heads, d)
        queries[batch.tok_row, batch.tok_col] = q
        # GQA without copying K/V: query head h reads kv head h // groups (HF repeat_kv), so
        # the group's queries are stacked along the query axis of their kv head.
        queries = queries.view(rows, max_q, kv_heads, groups, d).permute(0, 2, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            queries.reshape(rows, kv_heads, groups * max_q, d), keys.transpose(1, 2),
            values.transpose(1, 2), attn_mask=batch.mask)
        out = out.view(rows, kv_heads, groups, max_q, d).permute(0, 3, 1, 2, 4)
        out = out[batch.tok_row, batch.tok_col].reshape(num_tokens, -1)
        return attn.o_proj(out)

    # ------------------------------------------------------------------------- after a round
    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def last_exited_copy(self, slots: list[int], exit_rounds: list[int]) -> None:
        """LAST_EXITED: tokens that exited at e < R get their round-e K/V in planes e+1..R."""
        if not slots:
            return
        slots_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
        planes_t = torch.tensor([e - 1 for e in exit_rounds], dtype=torch.int32,
                                device=self.device)
        copy = kernels.last_exited_copy if self._use_triton else kernels.last_exited_copy_ref
        with torch.no_grad():
            copy(self.kv_cache, slots_t, planes_t)


def place_model(model: OuroForCausalLM, dtype, device) -> OuroForCausalLM:
    """The model itself if dtype/device match, else an engine-owned converted copy."""
    param = next(model.parameters())
    dtype, device = dtype or param.dtype, torch.device(device or param.device)
    if dtype == param.dtype and device == param.device:
        return model.eval()
    with torch.device("meta"):
        copy = OuroForCausalLM(model.config)
    copy = copy.to(dtype).to_empty(device=device)
    copy.load_state_dict(model.state_dict())
    return copy.eval()
