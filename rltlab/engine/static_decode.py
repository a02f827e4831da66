"""Decode rounds through static buffers: fused projections, Triton paged attention, CUDA graphs.

A decode row is the single token of one sequence at its own round. One call runs ONE round of the
shared layers for up to max_batch such rows (rows may sit at different rounds: each reads and
writes its own plane). Everything the round needs lives in fixed device buffers, so on CUDA the
whole round (24 layers, final norm; the exit gate only for run(), whose caller reads its logits)
is captured once per batch-size bucket and replayed: one launch per round instead of ~20 per
layer (run_token chains all rounds of a fixed-depth token into one graph, with one RoPE table
for all of them, see rltlab/engine/token_step.py). The host packs the rows' indices into a
pinned staging buffer and issues one copy; nothing in a round reads the device back.

Round capture (launch_token / run_token with capture=True, the engine's decode capture,
rltlab/engine/hooks.py): the whole-token launch also copies each round's h_r and gate logit of
every row into captured_hidden [max_batch, R, H] / captured_gates [max_batch, R], inside the
same graph (its own graph per bucket and depth; the graphs without capture are unchanged).

Math: the reference layer (rltlab.model.architecture), with the sandwich norms fused pairwise
(kernels.add_rmsnorm: h + norm(x) * w_post, then the next norm) and q/k/v resp. gate/up as one
matmul each. fuse_projections() makes the model's q/k/v (gate/up) weights views into one fused
tensor, so in-place weight updates reach the fused matmuls and the captured graphs as they are.

Triton rounds write K/V with one fused RoPE + K/V-write kernel (kernels/small_batch.py); rounds
of one row (batch-1 decode, speculative drafts) also run every matmul as a weight-streaming
Triton GEMV with SiLU * up fused into the down projection's loads (small_batch_kernels=True, the
default); gemv_rows = G sends rounds of up to G rows the same way (fp32 rows as FMA products on
each loaded weight tile). Larger buckets keep cuBLAS matmuls (optionally torch.compile'd).

Padding rows (a bucket larger than the batch) carry slot -1 (their K/V write is skipped) and
context length 1; their outputs are never read.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rltlab import kernels
from rltlab.engine.prefix_groups import PrefixGroups
from rltlab.model.architecture import OuroForCausalLM, apply_rope, rope_cos_sin

# Rounds of at most this many rows use the Triton GEMV instead of cuBLAS, by default
# (ExecutionConfig.gemv_rows). In bf16 it beats cuBLAS at one row but not at 2..16 rows: even
# with split-K on the down projection a 16-row round's four matmuls lose to cuBLAS, and a
# 16-row verification program costs more with them (docs/results.md H25, H26); in fp32 the FMA
# rows beat cuBLAS at 5-37 rows.
GEMV_ROWS = 1
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


# Graphs captured by capture_graph in this process and the host seconds they took (their
# warm-ups' Triton specialisations included): rltlab.bench.first_loop reads what a closed loop
# still captures after LLM.warm_up() (graphs_captured).
CAPTURE_STATS = {"graphs": 0, "seconds": 0.0}


@contextlib.contextmanager
def graphs_captured():
    """The graphs capture_graph made inside the block and their host seconds: a dict like
    CAPTURE_STATS, filled once the block has ended."""
    before, counts = dict(CAPTURE_STATS), {}
    try:
        yield counts
    finally:
        counts.update({k: CAPTURE_STATS[k] - before[k] for k in before})


def capture_graph(fn, pool, warmup=None) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph in `pool` after two warm-ups
    on a side stream (compile / autotune / Triton specialisations outside the capture); fn must
    be idempotent, or `warmup` a version that is (fn, then undo its writes to its inputs)."""
    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    CAPTURE_STATS["graphs"] += 1
    CAPTURE_STATS["seconds"] += time.perf_counter() - start
    return graph


def fuse_projections(model: OuroForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make q/k/v and gate/up weights views of one tensor each (values unchanged).
    Returns [(w_qkv, w_gate_up)] per layer."""
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused.append((_fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                      _fuse([mlp.gate_proj, mlp.up_proj])))
    return fused


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    weight = torch.cat([lin.weight.detach() for lin in linears])
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[offset: offset + rows], requires_grad=False)
        offset += rows
    return weight


def qkv_rope(y, w_qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """One matmul for q, k, v; RoPE on q and k. -> q [N, Hq, D], k, v [N, Hkv, D]."""
    qkv = F.linear(y, w_qkv)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(-1, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(-1, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(-1, num_kv_heads, head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def post_attention(x, attn, w_o, w_attn_out, w_mlp_in, w_gate_up, w_down, w_mlp_out, w_next,
                   eps: float, add_rmsnorm, silu_mul=kernels.silu_mul_ref):
    """o_proj, sandwich norms, SwiGLU MLP. -> (residual x, norm_next(x)) for the next layer."""
    x, m = add_rmsnorm(x, F.linear(attn.flatten(1), w_o), w_attn_out, w_mlp_in, eps)
    return add_rmsnorm(x, F.linear(silu_mul(F.linear(m, w_gate_up)), w_down), w_mlp_out, w_next,
                       eps)


class StaticDecoder:
    """One round for up to max_batch token rows through fixed buffers: stage() the rows'
    indices, then run() their round inputs (see the module docstring)."""

    def __init__(self, model: OuroForCausalLM, *, fused, kv_cache: torch.Tensor,
                 block_size: int, max_batch: int, max_blocks_per_seq: int, cuda_graphs: bool,
                 compile: bool, small_batch_kernels: bool = True,
                 gemv_rows: int = GEMV_ROWS, pdl: bool = False,
                 fused_qkv_rope: bool = True, l2_prefetch_mb: float = 4.0,
                 triton: bool | None = None, shared_prefix: bool = True):
        cfg = model.config
        self.model, self.config, self.kv_cache, self.block_size = model, cfg, kv_cache, block_size
        self.device, self.dtype = kv_cache.device, kv_cache.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.compiled = compile
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch, self.max_blocks = max_batch, max_blocks_per_seq
        self.layers = [self._layer_weights(i, layer, fused[i])
                       for i, layer in enumerate(model.model.layers)]
        # Triton on CUDA; the torch references elsewhere (the kernels have their own
        # interpreter tests, and interpreting them here would only slow the CPU path down).
        # triton=True forces them elsewhere (tests, under TRITON_INTERPRET=1).
        use_triton = self.device.type == "cuda" if triton is None else triton
        self._attention = kernels.paged_decode_attention if use_triton \
            else kernels.paged_decode_attention_torch
        self._write_kv = kernels.write_kv if use_triton else kernels.write_kv_ref
        # The Triton kernel sizes its key-range split from a host bound; the graph fixes it at
        # the block-table capacity (empty splits cost one tile check each).
        self._attention_kwargs = ({"max_context_len": max_blocks_per_seq * block_size}
                                  if use_triton else {})
        # Rows sharing a prompt's blocks read them once per group (prefix_groups.py); the
        # torch attention off CUDA reads every row's keys anyway.
        self.groups = (PrefixGroups(max_batch, block_size, self.device)
                       if shared_prefix and use_triton else None)
        # Under torch.compile the torch reference norm is fused by inductor with its neighbours.
        self._norm = kernels.add_rmsnorm if use_triton and not compile else kernels.add_rmsnorm_ref
        # A round's first norm: one kernel on CUDA, where the reference launches five.
        self._first_norm = kernels.rmsnorm if use_triton else kernels.rmsnorm_ref
        # Under torch.compile inductor fuses SiLU * up itself.
        self._silu_mul = kernels.silu_mul if use_triton and not compile else kernels.silu_mul_ref
        self._small_rows = gemv_rows if use_triton and small_batch_kernels else 0
        # GEMV rounds (one row, or up to gemv_rows) are chains of small Triton kernels: launched
        # with PDL (Hopper+), each starts streaming its weights while the previous one drains
        # (rltlab.kernels.pdl).
        self.pdl = pdl and self._small_rows > 0 and kernels.pdl_available(self.device)
        # Where the fused RoPE + K/V write kernel replaces qkv_rope's RoPE and write_kv: every
        # Triton round except compiled ones (inductor already fuses RoPE into its neighbours).
        self._fused_rope = use_triton and not compile
        # One-row rounds: RoPE + K/V write in the q/k/v GEMV's epilogue (kernels/rope_gemv.py).
        self._qkv_rope_gemv = fused_qkv_rope
        # One-row PDL rounds: each kernel brings the head of the next GEMV's weight into L2
        # (kernels/l2_prefetch.py); PDL's condition is the prefetch's (Hopper, compiled).
        self._prefetch = (prefetch_plan(self.layers, int(l2_prefetch_mb * 2 ** 20))
                          if self.pdl and fused_qkv_rope and l2_prefetch_mb > 0 else None)
        self._qkv, self._post = qkv_rope, post_attention
        if compile:
            self._qkv = torch.compile(qkv_rope, dynamic=True, fullgraph=True)
            self._post = torch.compile(post_attention, dynamic=True, fullgraph=True)
        # Index buffer: [positions | planes | slots | context lengths | block tables], int32.
        self._num_index = max_batch * (4 + max_blocks_per_seq)
        self.index = torch.zeros(self._num_index, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._staging = [torch.zeros(self._num_index, dtype=torch.int32, pin_memory=pin)
                         for _ in range(2)]
        self._staged_events: list = [None, None]
        self._turn = 0
        for buf in self._staging:
            self._stage_padding(buf.numpy(), 0)
        self.hidden_in = torch.zeros(max_batch, cfg.hidden_size, dtype=self.dtype,
                                     device=self.device)
        self.hidden_out = torch.zeros_like(self.hidden_in)
        self.gate_out = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        # Whole-token mode (run_token): round r's plane for every row.
        rounds = cfg.num_rounds
        self._plane_rows = torch.arange(rounds, dtype=torch.int32, device=self.device)[:, None] \
            .expand(rounds, max_batch).contiguous()
        self.token_in = torch.zeros_like(self.hidden_in)
        # Round capture buffers, allocated on the first capturing launch and kept (captured
        # graphs write into them).
        self.captured_hidden: torch.Tensor | None = None
        self.captured_gates: torch.Tensor | None = None
        self._graphs: dict = {}   # bucket -> one round; (bucket, depth) -> a whole token
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def _layer_weights(self, idx, layer, fused) -> dict:
        layers = self.model.model.layers
        next_norm = (layers[idx + 1].input_layernorm if idx + 1 < len(layers)
                     else self.model.model.norm)
        return dict(w_qkv=fused[0], w_o=layer.self_attn.o_proj.weight,
                    w_attn_out=layer.input_layernorm_2.weight,
                    w_mlp_in=layer.post_attention_layernorm.weight, w_gate_up=fused[1],
                    w_down=layer.mlp.down_proj.weight,
                    w_mlp_out=layer.post_attention_layernorm_2.weight,
                    w_next=next_norm.weight)

    # ---------------------------------------------------------------------------- host side
    def _views(self, buf):
        b, nb = self.max_batch, self.max_blocks
        return buf[:b], buf[b: 2 * b], buf[2 * b: 3 * b], buf[3 * b: 4 * b], \
            buf[4 * b:].reshape(b, nb)

    def _stage_padding(self, buf: np.ndarray, start: int) -> None:
        positions, planes, slots, ctx, _ = self._views(buf)
        positions[start:], planes[start:], slots[start:], ctx[start:] = 0, 0, -1, 1

    def stage(self, positions: list[int], planes: list[int], slots: list[int],
              tables: list[list[int]]) -> None:
        """Pack the rows' indices into pinned memory and copy them to the device in one go."""
        n = len(positions)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"{n} decode rows; this decoder holds 1..{self.max_batch}")
        turn, self._turn = self._turn, 1 - self._turn
        if self._staged_events[turn] is not None:
            self._staged_events[turn].synchronize()   # that buffer's last copy must be done
        buf = self._staging[turn].numpy()
        pos_v, plane_v, slot_v, ctx_v, table_v = self._views(buf)
        pos_v[:n], plane_v[:n], slot_v[:n] = positions, planes, slots
        ctx_v[:n] = np.asarray(positions) + 1
        for row, table in enumerate(tables):
            table_v[row, : len(table)] = table
        self._stage_padding(buf, n)
        self.index.copy_(self._staging[turn], non_blocking=True)
        if self.groups is not None:
            self.groups.use(self.groups.plan(plane_v[:n], ctx_v[:n], table_v[:n]))
        if self.device.type == "cuda":
            self._staged_events[turn] = torch.cuda.Event()
            self._staged_events[turn].record()

    # ------------------------------------------------------------------------- device side
    def run(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One round for the staged rows; hidden [n, H] is their round input.
        -> (h_r [n, H] after model.norm, gate logits fp32 [n]), both fresh tensors."""
        n = hidden.shape[0]
        self.hidden_in[:n].copy_(hidden)
        bucket = self._bucket(n)
        self._launch((bucket, "gates"), lambda: self._round(bucket, gates=True))
        return self.hidden_out[:n].clone(), self.gate_out[:n].clone()

    def launch_round(self, n: int) -> None:
        """One round for the first n staged rows on whatever hidden_in holds (the caller keeps
        inputs and outputs in hidden_in / hidden_out: rltlab.engine.round_window); no gate
        logits (round windows run host-fixed depths)."""
        bucket = self._bucket(n)
        self._launch(bucket, lambda: self._round(bucket))

    def run_token(self, hidden: torch.Tensor, depth: int, capture: bool = False) -> torch.Tensor:
        """Rounds 1..depth of the staged rows' tokens in one go (one graph replay on CUDA):
        round r reads and writes plane r - 1 for every row, whatever stage() put in planes.
        hidden [n, H]: the embeddings. -> h_depth [n, H] (whole tokens run host-fixed depths:
        no gate logits). capture: see launch_token."""
        n = hidden.shape[0]
        self.launch_token(n, depth, hidden, capture)
        return self.hidden_out[:n].clone()

    def launch_token(self, n: int, depth: int, hidden: torch.Tensor,
                     capture: bool = False) -> None:
        """run_token for the first n staged rows, its h_depth left in hidden_out (the caller
        reads it before the next launch: rltlab.engine.token_window). capture: also leave
        round r's h_r (after model.norm) and gate logit of row i in captured_hidden[i, r - 1]
        and captured_gates[i, r - 1], r <= depth, until the next capturing launch."""
        if not 1 <= depth <= self.config.num_rounds:
            raise ValueError(f"depth must lie in 1..{self.config.num_rounds}, got {depth}")
        self.token_in[:n].copy_(hidden)
        bucket = self._bucket(n)
        if capture:
            self._capture_buffers()
            self._launch((bucket, depth, "capture"), lambda: self._token(bucket, depth, True))
        else:
            self._launch((bucket, depth), lambda: self._token(bucket, depth))

    def _capture_buffers(self) -> None:
        if self.captured_hidden is None:
            rounds = self.config.num_rounds
            self.captured_hidden = torch.zeros(self.max_batch, rounds, self.config.hidden_size,
                                               dtype=self.dtype, device=self.device)
            self.captured_gates = torch.zeros(self.max_batch, rounds, dtype=torch.float32,
                                              device=self.device)

    def run_token_ragged(self, hidden: torch.Tensor, depths: list[int]) -> torch.Tensor:
        """Rounds 1..depths[i] of staged row i's token, rows ordered deepest first: round r
        runs the rows whose depth exceeds r - 1 (one replay of that bucket's round at plane
        r - 1; no host sync between rounds). A bucket larger than the rows still going also
        recomputes a few finished rows, writing K/V into planes at or past their exit: the
        caller's LAST_EXITED copy overwrites exactly those planes, and no other row reads them.
        hidden [n, H]: the embeddings. -> h at each row's own depth [n, H]."""
        n, R = hidden.shape[0], self.config.num_rounds
        if len(depths) != n or not all(1 <= d <= R for d in depths) or \
                any(a < b for a, b in zip(depths, depths[1:])):
            raise ValueError(f"depths must be {n} rounds in 1..{R}, deepest first, got {depths}")
        out = torch.empty_like(hidden)
        self.hidden_in[:n].copy_(hidden)
        for r in range(depths[0]):
            going = sum(d > r for d in depths)
            if r:
                self.hidden_in[:going].copy_(self.hidden_out[:going])
            bucket = self._bucket(going)
            self._launch((bucket, "plane", r), lambda: self._round(bucket, plane=r))
            done = sum(d > r + 1 for d in depths)   # rows [done, going) exit after round r + 1
            out[done:going].copy_(self.hidden_out[done:going])
        return out

    def _token(self, n: int, depth: int, capture: bool = False) -> None:
        # Reads only token_in and the staged indices: running it again (the capture's warm-up
        # does) recomputes the same values and rewrites the same K/V. Every round sits at the
        # token's position: one RoPE table for all of them.
        rope = self.rope(self._views(self.index)[0][:n])
        for r in range(depth):
            self._round(n, plane=r, x=self.token_in[:n] if r == 0 else self.hidden_out[:n],
                        rope=rope, gates=capture)
            if capture:
                self.captured_hidden[:n, r].copy_(self.hidden_out[:n])
                self.captured_gates[:n, r].copy_(self.gate_out[:n])

    def _grouped(self) -> bool:
        return self.groups is not None and self.groups.active

    def _bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _launch(self, key, fn) -> None:
        """Run fn: on CUDA as the graph captured under `key` and whether rows are grouped
        (captured on first use)."""
        key = (key, self._grouped())
        if not self.cuda_graphs:
            fn()
            return
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn)
        self._graphs[key].replay()

    def _capture(self, fn, warmup=None) -> torch.cuda.CUDAGraph:
        return capture_graph(fn, self._pool, warmup)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) [n, head_dim] at positions [n], for _round(rope=...): rounds at
        the same positions share them (about ten small kernels each time on a GPU)."""
        cfg = self.config
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype)

    @torch.no_grad()
    def _round(self, n: int, plane: int | None = None, rows: tuple | None = None,
               x: torch.Tensor | None = None, rope: tuple | None = None,
               gates: bool = False) -> None:
        """One round for the first n staged rows; plane: the same plane for every row (whole
        tokens) instead of the staged ones; rows: (positions, slots, context lengths, block
        tables) device tensors of n rows instead of the staged ones (with a plane; the
        speculative graphs of rltlab.engine.spec.draft_program build their own); x: the round's input
        [n, H] instead of hidden_in (it may be hidden_out: read before it is written); rope:
        self.rope(positions) where the caller has it; gates: also write the exit gate's logits
        into gate_out (run() returns them, a capturing whole token keeps them)."""
        cfg, model = self.config, self.model.model
        positions, planes, slots, ctx, tables = self._views(self.index)
        if plane is not None:
            planes = self._plane_rows[plane]
        if rows is not None:
            positions, slots, ctx, tables = rows
        positions, planes, slots, ctx, tables = (positions[:n], planes[:n], slots[:n], ctx[:n],
                                                 tables[:n])
        shared = {"shared": self.groups.shared.rows(n)} if rows is None and self._grouped() else {}
        cos, sin = (t[:n] for t in rope) if rope is not None else self.rope(positions)
        scale, eps = cfg.head_dim ** -0.5, cfg.rms_norm_eps
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        x = self.hidden_in[:n] if x is None else x
        y = self._first_norm(x, model.layers[0].input_layernorm.weight, eps)
        small = n <= self._small_rows
        pdl = {"pdl": True} if small and self.pdl else {}
        for idx, w in enumerate(self.layers):
            fetch = self._prefetch[idx] if small and self._prefetch else {}
            if small and self._qkv_rope_gemv:
                q = kernels.rope_kv_linear(y, w["w_qkv"], cos, sin, self.kv_cache, idx, planes,
                                           slots, *heads, **pdl)
            elif small:
                qkv = kernels.small_m_linear(y, w["w_qkv"], **pdl)
                q = kernels.rope_write_kv(qkv, cos, sin, self.kv_cache, idx, planes, slots,
                                          *heads, **pdl)
            elif self._fused_rope:
                q = kernels.rope_write_kv(F.linear(y, w["w_qkv"]), cos, sin, self.kv_cache, idx,
                                          planes, slots, *heads)
            else:
                q, k, v = self._qkv(y, w["w_qkv"], cos[:, None], sin[:, None], *heads)
                self._write_kv(self.kv_cache, idx, planes, slots, k, v)
            attn = self._attention(q, self.kv_cache[idx, 0], self.kv_cache[idx, 1], planes,
                                   tables, ctx, scale, **self._attention_kwargs, **pdl, **shared,
                                   **({"prefetch": fetch["attention"]} if fetch else {}))
            if small:
                x, y = self._small_mlp(x, attn, w, eps, pdl, fetch)
            else:
                x, y = self._post(x, attn, w["w_o"], w["w_attn_out"], w["w_mlp_in"],
                                  w["w_gate_up"], w["w_down"], w["w_mlp_out"], w["w_next"], eps,
                                  self._norm, self._silu_mul)
        self.hidden_out[:n].copy_(y)
        if gates:
            self.gate_out[:n].copy_(model.early_exit_gate(y).float().squeeze(-1))

    @staticmethod
    def _small_mlp(x, attn, w, eps, pdl: dict, fetch: dict):
        """post_attention for <= 16 rows: weight-streaming GEMVs, SiLU * up fused into down;
        pdl: {"pdl": True} to launch them with PDL, else {}; fetch: the layer's prefetch_plan
        entry, or {}."""
        linear = kernels.small_m_linear
        o = linear(attn.flatten(1), w["w_o"], prefetch=fetch.get("w_o"), **pdl)
        x, m = kernels.add_rmsnorm(x, o, w["w_attn_out"], w["w_mlp_in"], eps, **pdl)
        gate_up = linear(m, w["w_gate_up"], prefetch=fetch.get("w_gate_up"), **pdl)
        down = linear(gate_up, w["w_down"], "silu_mul", prefetch=fetch.get("w_down"), **pdl)
        return kernels.add_rmsnorm(x, down, w["w_mlp_out"], w["w_next"], eps, **pdl)


def prefetch_plan(layers: list[dict], budget: int) -> list[dict]:
    """Per layer, what each one-row kernel brings into L2 for the GEMV after it: the attention
    the o projection's weight, and each GEMV (keyed by its own weight) the next GEMV's, the
    last layer's down projection the first layer's q/k/v (the next round). Each entry is
    (weight, first min(budget, size) bytes)."""
    if budget < 16:
        raise ValueError(f"an L2 prefetch budget of {budget} bytes prefetches nothing")

    def head(weight):
        return weight, kernels.prefetch_bytes(weight, budget)

    return [{"attention": head(w["w_o"]), "w_o": head(w["w_gate_up"]),
             "w_gate_up": head(w["w_down"]),
             "w_down": head(layers[(i + 1) % len(layers)]["w_qkv"])}
            for i, w in enumerate(layers)]
