"""Prefill rounds through the static path's fused layer instead of the plain-torch gather path.

A prefill chunk is one sequence's run of contiguous positions start..start+n-1 at one round.
Its round here is the static decoder's layer (rltlab.engine.static_decode): q/k/v and gate/up
as one matmul each, RoPE fused with the K/V write into the round's plane
(kernels.rope_write_kv), the sandwich norms fused pairwise (kernels.add_rmsnorm), and causal
flash attention over the plane through the block table (kernels.paged_prefill_attention), one
launch per chunk. No [rows, queries, keys] mask is built on the host.
Chunks that start at position 0 (a whole prompt, the common RL case) see only their own keys:
those of one length go through torch's fused causal attention together
(F.scaled_dot_product_attention: FlashAttention-2, then cuDNN for shapes that recur; see
SDPA_BACKENDS),
on the layer's fresh k (RoPE'd by the same kernel that writes the cache, into k_out) and v (a
view of the q|k|v output): no gather from the cache, and no copy at all when the chunks lie
back to back in the step, as a step of whole prompts does. SiLU * up is one kernel
(kernels.silu_mul). Whole prompts of many lengths make one attention launch per length and
layer; with pad_lengths (ExecutionConfig.pad_prefill_attention, opt-in) those of one length
bucket are padded at their ends into one launch instead.

Why: the gather path ran 1K-token prefill at a third of the bf16 matmul rate; its unfused
norms, RoPE and padded attention copies cost as much as the matmuls (docs/results.md E16).

Rows whose active positions are not contiguous (a recomputed span after some tokens exited)
keep the gather path: ModelRunner checks `contiguous` before choosing. Each kernel has a torch
reference with the same arguments, used off CUDA (and by the CPU tests).
"""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rltlab import kernels
from rltlab.common.device import tensor_to_device, to_device
from rltlab.engine.static_decode import post_attention
from rltlab.model.architecture import OuroForCausalLM, rope_cos_sin


# cuDNN runs the whole prompts' causal attention faster than FlashAttention-2 (16 prompts of
# 1K tokens: 0.158 against 0.281 ms per layer, 7 x 1K 2.4x, 128 x 128 1.39x), but builds an
# execution plan for every new (chunks, length) shape: ~70-80 ms each (1.4 s for the first), and
# admissions of a few requests at a time bring a new shape nearly every step (such mixed steps
# took ~42 ms each in a W7 closed loop). So a shape takes cuDNN only once it has run
# ExecutionConfig.cudnn_prefill_after rounds (16 by default: a plan pays for itself after ~25
# rounds of 24 layers), FlashAttention-2 before; a single prompt never does (1 x 1K: cuDNN
# 0.086 against 0.082 ms, and at c = 1 the first cuDNN call's ~1 s would land in a request's
# latency). Where cuDNN cannot run (CPU, a shape it refuses) torch falls through the list.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION] + SDPA_BACKENDS


def bucket(n: int, least: int, step: int) -> int:
    """The next power of two >= max(n, least) up to `step`, the next multiple of step beyond:
    padding to it costs at most 2x below step and less than one step's worth beyond it."""
    n = max(n, least)
    return 1 << (n - 1).bit_length() if n <= step else -(-n // step) * step


def length_bucket(n: int) -> int:
    """A whole prompt's padded length: a power of two (16 at least) up to 128, a multiple of
    128 beyond (padded attention here, and prefill_graphs' buckets)."""
    return bucket(n, 16, 128)


def whole_prompt_inputs(seqs, lengths: list[int], block_size: int, embed, device):
    """FusedPrefill.run_rounds' inputs for fresh whole prompts back to back (seqs: Sequences,
    lengths: their prompts' lengths; embed: the model's embedding) -> (round-1 inputs,
    positions, slots, chunks), with one host->device copy: the engine's general step builder
    (ModelRunner.prepare) spent ~0.4 ms of host time a prompt on it at c = 1, while the
    device waited."""
    host = np.empty((3, sum(lengths)), dtype=np.int64)   # token ids, positions, slots
    lo = 0
    for seq, n in zip(seqs, lengths):
        host[0, lo: lo + n] = seq.token_ids(0, n)
        host[1, lo: lo + n] = np.arange(n)
        host[2, lo: lo + n] = prompt_slots(seq, n, block_size)
        lo += n
    ids, positions, slots = tensor_to_device(torch.from_numpy(host), device)
    chunks = [(end - n, n, 0, 0) for end, n in zip(itertools.accumulate(lengths), lengths)]
    return embed(ids), positions, slots, chunks


def prompt_slots(seq, n: int, block_size: int) -> np.ndarray:
    """The KV slots of a sequence's positions 0..n-1, through its block table."""
    positions = np.arange(n)
    return np.asarray(seq.block_table)[positions // block_size] * block_size + \
        positions % block_size


def contiguous(positions: list[torch.Tensor]) -> bool:
    """Every row's active positions are one run p0, p0 + 1, ... (they ascend)."""
    return all(int(p[-1]) - int(p[0]) + 1 == p.numel() for p in positions)


class FusedPrefill:
    """One round for rows of contiguous positions; layer weights shared with the static decoder
    (StaticDecoder.layers), so weight updates reach both."""

    def __init__(self, model: OuroForCausalLM, layers: list[dict], kv_cache: torch.Tensor,
                 triton: bool, cudnn_after: int | None = 16, pad_lengths: bool = False):
        self.model, self.layers, self.kv_cache = model, layers, kv_cache
        self.triton = triton
        self.cudnn_after = cudnn_after
        self.pad_lengths = pad_lengths   # ExecutionConfig.pad_prefill_attention
        self.shape_rounds: Counter = Counter()   # (chunks, length) -> rounds run (SDPA_BACKENDS)
        self._rmsnorm = kernels.rmsnorm if triton else kernels.rmsnorm_ref
        self._add_rmsnorm = kernels.add_rmsnorm if triton else kernels.add_rmsnorm_ref
        self._rope_write_kv = kernels.rope_write_kv if triton else kernels.rope_write_kv_ref
        self._attention = (kernels.paged_prefill_attention if triton
                           else kernels.paged_prefill_attention_ref)
        self._silu_mul = kernels.silu_mul if triton else kernels.silu_mul_ref
        cfg = model.config
        self._groups = cfg.num_attention_heads // cfg.num_key_value_heads

    @torch.no_grad()
    def run(self, hidden: torch.Tensor, positions: torch.Tensor, planes: torch.Tensor,
            slots: torch.Tensor, chunks: list[tuple[int, int, int, int]],
            tables: torch.Tensor | None, backends: list | None = None,
            rope: tuple | None = None, gates: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, H] round inputs; positions, planes (0-based), slots: per token [T];
        chunks: per row (first token index, tokens, plane, first position); tables [B, blocks]
        int32 block tables (None if every chunk starts at position 0); backends: SDPA's for the
        whole prompts instead of self.backends' choice (prefill_graphs.py: no cuDNN inside
        graphs); rope: RoPE's (cos, sin) at positions where the caller has them; gates: False
        skips the exit gate. -> (h_r [T, H] after model.norm, gate logits fp32 [T] or None)."""
        cfg, model = self.model.config, self.model.model
        cos, sin = rope if rope is not None else self.rope(positions, hidden.dtype)
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        scale, eps = cfg.head_dim ** -0.5, cfg.rms_norm_eps
        planes = planes.to(torch.int32)
        plan = self._from_start_plan(chunks, hidden.device, self.pad_lengths)
        self.shape_rounds.update(batch for batch, _, _ in plan)
        # The fresh RoPE'd keys, for the chunks from position 0 (one buffer for every layer).
        k_fresh = hidden.new_empty(hidden.shape[0], *heads[1:]) if plan else None
        k_end = (heads[0] + heads[1]) * heads[2]
        x = hidden
        y = self._rmsnorm(x, model.layers[0].input_layernorm.weight, eps)
        for idx, w in enumerate(self.layers):
            qkv = torch.nn.functional.linear(y, w["w_qkv"])
            q = self._rope_write_kv(qkv, cos, sin, self.kv_cache, idx, planes, slots, *heads,
                                    k_out=k_fresh)
            v_fresh = qkv[:, k_end:].view(-1, *heads[1:])
            attn = self._attend(idx, q, k_fresh, v_fresh, chunks, tables, scale, plan, backends)
            x, y = post_attention(x, attn, w["w_o"], w["w_attn_out"], w["w_mlp_in"],
                                  w["w_gate_up"], w["w_down"], w["w_mlp_out"], w["w_next"], eps,
                                  self._add_rmsnorm, self._silu_mul)
        return y, model.early_exit_gate(y).float().squeeze(-1) if gates else None

    def run_rounds(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   chunks: list[tuple[int, int, int, int]], tables: torch.Tensor | None,
                   rounds: int, backends: list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rounds 1..rounds of whole prompts back to back (every position runs them all, so
        round r + 1's input is round r's output and its K/V goes to plane r): `run`'s
        arguments without planes (chunks' planes are ignored) -> round `rounds`' (h, gate
        logits). Every round sits at the same positions (one RoPE table) and only the last
        one's gate logits are returned (the others are not computed)."""
        rope = self.rope(positions, hidden.dtype)
        for plane in range(rounds):
            planes = torch.full_like(positions, plane)
            plane_chunks = [(lo, n, plane, start) for lo, n, _, start in chunks]
            hidden, gates = self.run(hidden, positions, planes, slots, plane_chunks, tables,
                                     backends, rope=rope, gates=plane == rounds - 1)
        return hidden, gates

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """RoPE's (cos, sin) [T, head_dim] at positions [T], for run(rope=...)."""
        cfg = self.model.config
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)

    def _attend(self, idx: int, q, k_fresh, v_fresh, chunks, tables: torch.Tensor | None,
                scale: float, plan, backends: list | None = None) -> torch.Tensor:
        """Causal attention of every chunk's queries q [T, Hq, D] over its plane -> [T, Hq, D]:
        chunks from position 0 grouped by length through SDPA on their fresh keys and values
        (k_fresh, v_fresh [T, Hkv, D]; plan: _from_start_plan), the rest one paged launch
        each."""
        k_cache, v_cache = self.kv_cache[idx, 0], self.kv_cache[idx, 1]
        out = torch.empty_like(q)
        for row, (lo, n, plane, start) in enumerate(chunks):
            if start:
                out[lo: lo + n] = self._attention(q[lo: lo + n], k_cache, v_cache, plane,
                                                  tables[row], start, scale)
        for batch, tokens, padded in plan:   # tokens: a slice (views, no copy) or an index
            heads = lambda t: t[tokens].view(*batch, *t.shape[1:]).transpose(1, 2)   # [B,H,n,D]
            with sdpa_kernel(backends or self.backends(batch)):
                o = F.scaled_dot_product_attention(
                    heads(q), heads(k_fresh), heads(v_fresh), is_causal=True, scale=scale,
                    enable_gqa=self._groups > 1)
            o = o.transpose(1, 2).flatten(0, 1)
            if padded is None:
                out[tokens] = o
            else:   # only the real tokens' outputs: (their rows in o, their token rows)
                out[padded[1]] = o[padded[0]]
        return out

    def backends(self, batch: tuple[int, int]) -> list:
        """SDPA backends, in order of preference, for whole prompts of shape (chunks, length)."""
        recurs = self.cudnn_after is not None and self.shape_rounds[batch] > self.cudnn_after
        return CUDNN_FIRST if recurs and batch[0] > 1 else SDPA_BACKENDS

    @staticmethod
    def _from_start_plan(chunks, device: torch.device, pad_lengths: bool = False):
        """Per length n of the chunks that start at position 0: ((chunks, n), their queries'
        token rows: a slice when the chunks lie back to back in token order, else an index
        [B * n], None). Built once per round, shared by every layer.

        pad_lengths: one group per length bucket (prefill_graphs' for lengths) instead of per
        length, each chunk padded at its end to the group's longest, so prompts of many
        lengths take a few attention launches per layer instead of one per length. A padding
        row repeats its chunk's last token; causal attention keeps it out of every real
        query's view, and only the real rows' outputs are written: such a group's last item
        is (their rows in the padded [B * n] output, their token rows)."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for lo, n, _, start in chunks:
            if start == 0:
                key = length_bucket(n) if pad_lengths else n
                groups.setdefault(key, []).append((lo, n))
        plan = []
        for members in groups.values():
            los, lengths = [lo for lo, _ in members], [n for _, n in members]
            n = max(lengths)
            if min(lengths) < n:
                offsets, ends = torch.arange(n), torch.tensor(lengths)[:, None]
                tokens = torch.tensor(los)[:, None] + torch.minimum(offsets, ends - 1)
                real = (offsets < ends).flatten()
                padded = (tensor_to_device(real.nonzero().flatten(), device),
                          tensor_to_device(tokens.flatten()[real], device))
                plan.append(((len(los), n), tensor_to_device(tokens.flatten(), device), padded))
            elif los == list(range(los[0], los[0] + n * len(los), n)):
                plan.append(((len(los), n), slice(los[0], los[0] + n * len(los)), None))
            else:
                plan.append(((len(los), n), (to_device(los, torch.int64, device)[:, None]
                                             + torch.arange(n, device=device)).flatten(), None))
        return plan
