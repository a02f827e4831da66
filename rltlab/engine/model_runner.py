"""Runs one round of the shared layers for a heterogeneous batch over the paged round planes.

KV layout: kv_cache [num_layers, 2, R, num_blocks, block_size, Hkv, D]; plane d-1 holds round d;
slot = block * block_size + offset. A row is one sequence's span at its own round d: its active
tokens write their K/V into plane d, then attend over plane d for positions 0..pos (LAST_EXITED:
a position that exited at e < d has its round-e K/V copied there). The math is the reference
model's, module by module (rltlab.model.architecture): same norms, projections, RoPE and SDPA.

Two paths (ExecutionConfig.decode_path):
  * gather: plain torch for every row; rows are padded into [B, max_q] queries and [B, max_ctx]
    keys gathered through the block tables, with a causal mask per row. Prefill chunks and
    recomputed spans always take it.
  * static (default on CUDA): decode rows go through rltlab.engine.static_decode (fused
    projections, Triton paged attention, one CUDA graph per batch bucket); the other rows of the
    same step (prefill chunks) take rltlab.engine.fused_prefill, the same fused layer with
    causal paged attention, when their positions are contiguous (fused_prefill=True, the
    default), else the gather path. The step's rows come back decode rows first.
"""
from __future__ import annotations

import itertools
from copy import deepcopy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from rltlab import kernels
from rltlab.common.device import tensor_to_device, to_device
from rltlab.model.architecture import OuroForCausalLM, apply_rope, rope_cos_sin
from rltlab.engine.fused_prefill import FusedPrefill, contiguous, whole_prompt_inputs
from rltlab.engine.prefill_graphs import PrefillGraphs, resolve_max_tokens
from rltlab.engine.sequence import Sequence
from rltlab.engine.static_decode import StaticDecoder, fuse_projections


@dataclass
class StepRows:
    """What the engine needs to know about one step's rows, on the host."""
    row_sizes: list[int]
    slot_list: list[int]
    round_list: list[int]        # per token, 1-based
    position_list: list[int]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def offsets(self) -> list[int]:
        """First token index of each row."""
        return list(itertools.accumulate([0] + self.row_sizes[:-1]))

    @property
    def rounds(self) -> torch.Tensor:
        return to_device(self.round_list, torch.int64, self.device)

    @property
    def positions(self) -> torch.Tensor:
        return to_device(self.position_list, torch.int64, self.device)

    @staticmethod
    def concat(parts: list["StepRows"]) -> "StepRows":
        return StepRows(*(sum((getattr(p, f) for p in parts), []) for f in
                          ("row_sizes", "slot_list", "round_list", "position_list")),
                        device=parts[0].device)


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
    rows: StepRows             # the same, on the host
    # Gather path only (None for the fused prefill path):
    key_slots: torch.Tensor | None = None   # int64 [B, max_ctx]
    mask: torch.Tensor | None = None        # bool [B, 1, groups * max_q, max_ctx] (GQA groups)
    # Every row is positions 0..n-1 of its sequence (a first prefill chunk): its keys are its
    # own fresh k/v, so attention is plain causal attention without the cache gather.
    from_start: bool = False
    # Fused prefill path only: per row (first token index, tokens, plane, first position), and
    # the rows' block tables (int32 [B, max_blocks]).
    chunks: list[tuple[int, int, int, int]] | None = None
    tables: torch.Tensor | None = None

    @property
    def row_sizes(self) -> list[int]:
        return self.rows.row_sizes

    @property
    def slot_list(self) -> list[int]:
        return self.rows.slot_list


class ModelRunner:
    def __init__(self, model: OuroForCausalLM, num_blocks: int, block_size: int, *,
                 static_decode: bool = False, max_batch: int = 1, max_model_len: int = 0,
                 cuda_graphs: bool = True, compile: bool = False,
                 small_batch_kernels: bool = True, gemv_rows: int = 1, pdl: bool = True,
                 fused_qkv_rope: bool = True, l2_prefetch_mb: float = 4.0,
                 fused_prefill: bool = True, cudnn_prefill_after: int | None = 16,
                 pad_prefill_attention: bool = False, shared_prefix_attention: bool = True,
                 prefill_graph_tokens: int | None = None):
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
        self.static = None
        if static_decode:
            self._static_args = dict(fused=fuse_projections(model), kv_cache=self.kv_cache,
                                     block_size=block_size,
                                     max_blocks_per_seq=-(-max_model_len // block_size),
                                     cuda_graphs=cuda_graphs, compile=compile,
                                     small_batch_kernels=small_batch_kernels,
                                     gemv_rows=gemv_rows, pdl=pdl,
                                     fused_qkv_rope=fused_qkv_rope,
                                     l2_prefetch_mb=l2_prefetch_mb,
                                     shared_prefix=shared_prefix_attention)
            self.static = StaticDecoder(model, max_batch=max_batch, **self._static_args)
        self.prefill = (FusedPrefill(model, self.static.layers, self.kv_cache,
                                     triton=self._use_triton, cudnn_after=cudnn_prefill_after,
                                     pad_lengths=pad_prefill_attention)
                        if self.static is not None and fused_prefill else None)
        prefill_graph_tokens = resolve_max_tokens(prefill_graph_tokens, self.device, cuda_graphs)
        self.prefill_graphs = (PrefillGraphs(self.prefill, prefill_graph_tokens)
                               if self.prefill is not None and prefill_graph_tokens else None)

    # ------------------------------------------------------------------------------ one step
    def execute(self, seqs: list[Sequence]):
        """One round for every scheduled row -> (seqs in row order, StepRows, h_r [T, H],
        gate logits fp32 [T]). With the static path, decode rows come first."""
        if self.static is None:
            batch = self.prepare(seqs)
            return (seqs, batch.rows, *self.run_round(batch))
        decode = [s for s in seqs if s.span.exit_rounds is None]
        others = [s for s in seqs if s.span.exit_rounds is not None]
        parts = []
        if decode:
            parts.append((decode, *self._run_decode(decode)))
        if others:
            batch = self.prepare(others)
            parts.append((others, batch.rows, *self.run_round(batch)))
        if len(parts) == 1:
            return parts[0]
        return (decode + others, StepRows.concat([p[1] for p in parts]),
                torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))

    def _run_decode(self, seqs: list[Sequence]):
        rows = [(seq, seq.span.start, seq.span.round) for seq in seqs]
        hidden, gates, slots = self.run_token_rows(rows, self._decode_inputs(seqs))
        return StepRows([1] * len(seqs), slots, [plane + 1 for _, _, plane in rows],
                        [pos for _, pos, _ in rows], self.device), hidden, gates

    def run_token_rows(self, rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor):
        """One static-path round over explicit token rows (sequence, position, plane), hidden
        [T, H] their inputs -> (h_r, gate logits, slots). Rows of one sequence at consecutive
        positions are causal among themselves: every layer writes all rows' K/V before any row
        attends (speculative verification uses this for its K + 1 positions)."""
        slots = self._stage(rows)
        return (*self.static.run(hidden), slots)

    def _stage(self, rows: list[tuple[Sequence, int, int]]) -> list[int]:
        """Stage (sequence, position, plane) rows on the static decoder (grown if they do not
        fit: new buffers, graphs recaptured) -> their cache slots."""
        self.static_rows(len(rows))
        bs = self.block_size
        slots = [seq.block_table[pos // bs] * bs + pos % bs for seq, pos, _ in rows]
        self.static.stage([pos for _, pos, _ in rows], [plane for _, _, plane in rows], slots,
                          [seq.block_table for seq, _, _ in rows])
        return slots

    def static_rows(self, rows: int) -> StaticDecoder:
        """The static decoder, replaced by one of `rows` rows if it holds fewer (new buffers;
        graphs are recaptured)."""
        if rows > self.static.max_batch:
            self.static = StaticDecoder(self.model, max_batch=rows, **self._static_args)
        return self.static

    def run_token(self, seqs: list[Sequence], depth: int | list[int],
                  capture: bool = False) -> torch.Tensor:
        """Rounds 1..depth of every sequence's pending token (its last, at position
        num_tokens - 1) in one static-path launch, LAST_EXITED copies into the deeper planes
        included -> h_depth [n, H]. `depth` may also be one depth per sequence: then the rows
        run deepest first, each round over the rows still going (StaticDecoder.run_token_ragged),
        and every row gets the LAST_EXITED copies of its own depth. capture (one depth only):
        row i of the static decoder's round capture is seqs[i]'s token
        (StaticDecoder.launch_token)."""
        depths = [depth] * len(seqs) if isinstance(depth, int) else list(depth)
        if capture and len(set(depths)) > 1:
            raise ValueError("round capture needs one depth for every row")
        order = sorted(range(len(seqs)), key=lambda i: -depths[i])
        ordered = [seqs[i] for i in order]
        slots = self._stage([(seq, seq.num_tokens - 1, 0) for seq in ordered])
        ids = to_device([seq.output_token_ids[-1] for seq in ordered], torch.int64, self.device)
        embedded = self.model.model.embed_tokens(ids)
        sorted_depths = [depths[i] for i in order]
        if len(set(depths)) == 1:
            hidden = self.static.run_token(embedded, depths[0], capture)
        else:
            hidden = self.static.run_token_ragged(embedded, sorted_depths)
        short = [(slot, d) for slot, d in zip(slots, sorted_depths)
                 if d < self.config.num_rounds]
        self.last_exited_copy([slot for slot, _ in short], [d for _, d in short])
        if order == sorted(order):
            return hidden
        # seqs' order
        return hidden[tensor_to_device(torch.tensor(order).argsort(), hidden.device)]

    def _decode_inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """Round input per row: the embedding (round 1) or the span's last hidden state."""
        first = [i for i, seq in enumerate(seqs) if seq.span.round == 0]
        parts = [seq.span.hidden for seq in seqs]
        if first:
            ids = [seqs[i].token_ids(seqs[i].span.start, seqs[i].span.start + 1)[0] for i in first]
            embedded = self.model.model.embed_tokens(to_device(ids, torch.int64, self.device))
            for j, i in enumerate(first):
                parts[i] = embedded[j: j + 1]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
                tensor_to_device(torch.cat(first_round_ids), dev)).split(
                    [len(t) for t in first_round_ids]))
            hidden_parts = [h if h is not None else next(embedded) for h in hidden_parts]
        sizes = [int(p.numel()) for p in positions]
        row_t = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(sizes))
        col_t = torch.cat([torch.arange(n) for n in sizes])
        pos_t = torch.cat(positions)
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table_t for s in seqs],
                                                 batch_first=True)
        slots = tables[row_t, pos_t // bs] * bs + pos_t % bs
        token_rounds = torch.repeat_interleave(torch.tensor(rounds), torch.tensor(sizes))
        rows = StepRows(sizes, slots.tolist(), token_rounds.tolist(), pos_t.tolist(), dev)
        batch = RoundBatch(
            hidden=torch.cat(hidden_parts), positions=tensor_to_device(pos_t, dev),
            rounds=tensor_to_device(token_rounds, dev), slots=tensor_to_device(slots, dev),
            row_planes=to_device([r - 1 for r in rounds], torch.int64, dev),
            tok_row=tensor_to_device(row_t, dev), tok_col=tensor_to_device(col_t, dev), rows=rows)
        if self.prefill is not None and contiguous(positions):
            batch.chunks = list(zip(rows.offsets, sizes, [r - 1 for r in rounds],
                                    [int(p[0]) for p in positions]))
            batch.tables = tensor_to_device(tables.to(torch.int32), dev)
            return batch
        max_q, max_ctx = max(sizes), int(pos_t.max()) + 1
        keys = torch.arange(max_ctx)
        key_slots = tables[:, keys // bs] * bs + keys % bs   # past a row's context: masked
        query_pos = torch.zeros(len(seqs), max_q, dtype=torch.long)  # padding sees key 0 only
        query_pos[row_t, col_t] = pos_t
        mask = keys[None, None, :] <= query_pos[:, :, None]
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        batch.key_slots = tensor_to_device(key_slots, dev)
        batch.mask = tensor_to_device(mask[:, None].repeat(1, 1, groups, 1), dev)
        # active offsets ascend, so last == n - 1 means exactly 0..n-1
        batch.from_start = all(s.span.start == 0 and int(p[-1]) == p.numel() - 1
                               for s, p in zip(seqs, positions))
        return batch

    # ------------------------------------------------------------------------------ one round
    @torch.no_grad()
    def run_round(self, batch: RoundBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h_r [T, H] after model.norm, gate logits fp32 [T])."""
        if batch.chunks is not None:
            return (self.prefill_graphs or self.prefill).run(
                batch.hidden, batch.positions, batch.rounds - 1, batch.slots, batch.chunks,
                batch.tables)
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

    @torch.no_grad()
    def run_prompts(self, seqs: list[Sequence]) -> torch.Tensor:
        """Rounds 1..R of fresh whole prompts (each span: positions 0..P-1 at round 0, every
        position exiting at R) in one call, writing the K/V of every plane as R round steps
        would -> h_R of each prompt's last position [B, H], which samples token 0."""
        rounds, lengths = self.config.num_rounds, [seq.span.length for seq in seqs]
        embed = self.model.model.embed_tokens
        last = self.prefill_graphs and self.prefill_graphs.run_from_ids(   # a captured bucket
            seqs, lengths, self.block_size, embed.weight, rounds)
        if last is not None:
            return last
        if self.prefill is not None:   # fused prefill: one replay per step where graphs run
            run = (self.prefill_graphs or self.prefill).run_rounds
            inputs = whole_prompt_inputs(seqs, lengths, self.block_size, embed, self.device)
            hidden, _ = run(*inputs, None, rounds)
        else:
            batch = self.prepare(seqs)
            for _ in range(rounds):
                hidden, _ = self.run_round(batch)
                batch = replace(batch, hidden=hidden, rounds=batch.rounds + 1,
                                row_planes=batch.row_planes + 1)
        if len(seqs) == 1:   # c = 1: a slice, no index to copy over
            return hidden[-1:]
        ends = list(itertools.accumulate(lengths))
        return hidden[to_device([end - 1 for end in ends], torch.int64, self.device)]

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
        if batch.from_start:
            return attn.o_proj(self._causal_attention(q, k, v, batch, rows, max_q, groups))
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

    @staticmethod
    def _causal_attention(q, k, v, batch: RoundBatch, rows: int, max_q: int, groups: int):
        """Attention of rows that hold positions 0..n-1: causal over their own k/v, padded at
        the end (a valid query never sees the padding), so SDPA's flash kernel applies."""
        def padded(t):
            out = t.new_zeros(rows, max_q, *t.shape[1:])
            out[batch.tok_row, batch.tok_col] = t
            return out.transpose(1, 2)
        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True,
                                             enable_gqa=groups > 1)
        return out.transpose(1, 2)[batch.tok_row, batch.tok_col].reshape(q.shape[0], -1)

    # ------------------------------------------------------------------------- after a round
    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax of logits(hidden), logits all finite) per row, from the LM head's own dtype
        in one pass (kernels/greedy.py): what the general sampler gives greedy rows."""
        greedy = kernels.greedy_tokens if self._use_triton else kernels.greedy_tokens_ref
        return greedy(self.model.lm_head(hidden))

    def last_exited_copy(self, slots: list[int], exit_rounds: list[int]) -> None:
        """LAST_EXITED: tokens that exited at e < R get their round-e K/V in planes e+1..R."""
        if not slots:
            return
        self.copy_exited(to_device(slots, torch.int64, self.device),
                         to_device([e - 1 for e in exit_rounds], torch.int32, self.device))

    @torch.no_grad()
    def copy_exited(self, slots: torch.Tensor, exit_planes: torch.Tensor) -> None:
        """last_exited_copy on device tensors: slots int64, exit planes (round - 1) int32."""
        copy = kernels.last_exited_copy if self._use_triton else kernels.last_exited_copy_ref
        copy(self.kv_cache, slots, exit_planes)


def place_model(model: OuroForCausalLM, dtype, device, copy: bool = True) -> OuroForCausalLM:
    """The engine's model: a private copy of `model` in `dtype` on `device` (copy=True: the
    caller keeps its own model, values and train/eval mode untouched), or `model` itself when
    copy is False and dtype/device already match. Eval mode, no gradients (the engine only
    infers; the static decode path also rearranges the weights' storage)."""
    param = next(model.parameters())
    dtype, device = dtype or param.dtype, torch.device(device or param.device)
    if copy or dtype != param.dtype or device != param.device:
        with torch.device("meta"):
            placed = OuroForCausalLM(deepcopy(model.config))
        placed = placed.to(dtype).to_empty(device=device)
        placed.load_state_dict(model.state_dict())
        model = placed
    return model.eval().requires_grad_(False)
