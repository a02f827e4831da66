"""Kernels for decode rounds of a few rows (M <= 64): weight-streaming GEMV and fused RoPE + K/V.

At batch 1-16 a decode round is a stream of weight reads: every linear layer reads its whole
weight matrix for a handful of rows. cuBLAS reaches ~62% of the GPU's copy bandwidth on these
shapes, and the activation (SiLU * up) and
RoPE + K/V write run as separate small kernels. Here:

  * small_m_linear(x, w, act) = act(x) @ w.T, one program per BLOCK_N output features, streaming
    w in [BLOCK_N, BLOCK_K] tiles. act="silu_mul" reads x = [gate | up] and applies
    silu(gate) * up on the fly (SwiGLU's down projection), so the activation never hits memory.
    Accumulation in fp32; one rounding to x's dtype at the end. Several rows share each loaded
    weight tile: bf16 through tl.dot (tensor cores, 16-row blocks), fp32 as broadcast FMAs (the
    one-row arithmetic per row, blocks of up to 16 rows); more rows add row blocks (grid axis 1).
  * Split-K (tiles with SPLIT_K > 1): a narrow weight (N = 2048: o and down) gives only
    N / BLOCK_N = 256-512 one-row programs, each walking all of K, too few loads in flight to
    stream HBM (~50% of copy bandwidth vs ~85% for the wide q/k/v and gate/up); several rows'
    wider BLOCK_N (tl.dot) leave fewer programs still. The grid becomes (N / BLOCK_N, row blocks
    x SPLIT_K): each program accumulates a contiguous run of K tiles for its row block and
    stores an fp32 partial to a per-device workspace, then counts itself in on its output
    tile's counter (atomic, acq_rel). The program that arrives last sums the SPLIT_K partials
    in the fixed order 0..SPLIT_K-1, so the output is bit-identical run to run whichever program
    that is, writes it, and resets the counter to 0 for the next call (also inside CUDA graphs).
    Nothing waits on another program, so no scheduling order can deadlock. All calls on a
    device share the workspace: consecutive ones in a stream are safe (under PDL every store
    and atomic comes after gdc_wait), concurrent ones on two streams are not.
  * rope_write_kv(qkv, ...) splits a fused q|k|v row, applies rotate-half RoPE to q and k (fp32,
    one rounding), writes k and v into the paged cache (plane, slot) and returns q. One program
    per row; a negative slot marks a padding row (nothing written). With k_out it also stores
    the RoPE'd k there (prefill attention over a chunk's own keys needs no cache gather).

Both have torch references with the same arguments (``*_ref``), which are the spec in the tests.
Rounding differs from the references only in where bf16 rounding happens (fp32 inside, once at
the end), which is within bf16 tolerance and exact in fp32.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kv_copy import write_kv_ref
from .l2_prefetch import prefetch_args, prefetch_l2
from .pdl import await_previous_kernel, launch_options

MAX_ROWS = 64
# Rows per program of the few-row paths: tl.dot's minimum (bf16), and for FMA products
# [BLOCK_M, BLOCK_N, BLOCK_K] (fp32) at most 16 rows (registers); more rows, more row blocks.
DOT_ROWS, FMA_ROWS = 16, 16
ACTIVATIONS = (None, "silu_mul")
# Split-K workspace per device: fp32 partials [SPLIT_K, M, N] and one int32 arrival counter per
# output tile (column block x row block), zero between calls. Fixed sizes (above Ouro-1.4B's
# 8 x 64 x 11264 partials, 32 MiB) so that CUDA graphs keep pointing at the same buffers.
SPLIT_K_PARTIALS = 1 << 23
SPLIT_K_COUNTERS = 1 << 16
_split_k_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def small_m_linear_ref(x, w, act=None):
    """act(x) @ w.T; x [M, K] (act=None) or [M, 2K] = [gate | up] (act="silu_mul"), w [N, K]."""
    if act == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return F.linear(x, w)


@triton.jit
def _weight_tile(w_ptr, cols, col_ok, ks, K, stride_wn, FMA: tl.constexpr):
    """w[cols, ks]: a [BLOCK_N, BLOCK_K] tile, or with FMA [1, BLOCK_N, BLOCK_K], loaded straight
    into the layout of the [BLOCK_M, BLOCK_N, BLOCK_K] products (a 2-D tile broadcast to 3-D
    would be shuffled through shared memory on every K step)."""
    if FMA:   # one return statement: Triton requires one return type across them
        tile = tl.load(w_ptr + cols[None, :, None] * stride_wn + ks[None, None, :],
                       mask=col_ok[None, :, None] & (ks < K)[None, None, :], other=0.0)
    else:
        tile = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                       mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    return tile


@triton.jit
def _accumulate_tile(acc, w, x_ptr, rows, ks, row_ok, K, stride_xm, SILU_MUL: tl.constexpr,
                     BLOCK_M: tl.constexpr, FMA: tl.constexpr):
    """acc + act(x[:, ks]) @ w.T for one weight tile w (_weight_tile's)."""
    if FMA:   # x as [BLOCK_M, 1, BLOCK_K], in the products' layout as w
        x_at = x_ptr + rows[:, None, None] * stride_xm + ks[None, None, :]
        x_ok = row_ok[:, None, None] & (ks < K)[None, None, :]
    else:
        x_at = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        x_ok = row_ok[:, None] & (ks < K)[None, :]
    if SILU_MUL:
        gate = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
        up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
        x = gate * tl.sigmoid(gate) * up
    else:
        x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        # One row: a broadcast multiply and a row sum keep every loaded weight in fp32 FMAs.
        acc += tl.sum(w.to(tl.float32) * x, axis=1)[None, :]
    elif FMA:
        # fp32 rows: the same FMAs per row on the weight tile loaded once ([M, N, K] products).
        # An IEEE tl.dot takes no tensor cores either and needs BLOCK_N >= 16 (few programs).
        acc += tl.sum(w.to(tl.float32) * x, axis=2)
    else:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    return acc


@triton.jit
def _reduce_split_k(acc, partials_ptr, counters_ptr, out_ptr, rows, row_ok, cols, col_ok, M, N,
                    stride_om, split, tile, SPLIT_K: tl.constexpr):
    """Store this program's [BLOCK_M, BLOCK_N] partial (split ``split`` of output tile ``tile``);
    the tile's last program to arrive sums all SPLIT_K partials in order 0..SPLIT_K-1 into out
    and resets the tile's counter."""
    mask = row_ok[:, None] & col_ok[None, :]
    at = rows[:, None] * N + cols[None, :]   # partials: [SPLIT_K, M, N] fp32
    tl.store(partials_ptr + split * M * N + at, acc, mask=mask)
    # One thread does the atomic below: the barrier orders every thread's partial store before
    # its release (the pattern of CUTLASS's split-K semaphore).
    tl.debug_barrier()
    counter = counters_ptr + tile
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
        # The partials come from other SMs: read them from L2 (.cg), never from a stale L1 line.
        total = tl.load(partials_ptr + at, mask=mask, cache_modifier=".cg")
        for other in tl.static_range(1, SPLIT_K):
            total += tl.load(partials_ptr + other * M * N + at, mask=mask, cache_modifier=".cg")
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 total.to(out_ptr.dtype.element_ty), mask=mask)
        # No program of this launch touches the counter again, and the next launch only after
        # this one has finished (stream order, or gdc_wait under PDL): a plain store is enough.
        tl.store(counter, 0)


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, out_ptr, partials_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    pf_ptr, pf_bytes,
    SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr,
    PREFETCH: tl.constexpr, PF_CHUNK: tl.constexpr, PF_LANES: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The grid's second axis is (block of BLOCK_M rows) x SPLIT_K, split fastest.
    row_block, split = tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < N, rows < M
    if SPLIT_K == 1:
        k_begin, k_end = 0, K
    else:
        # Split s takes tiles [s T / SPLIT_K, (s + 1) T / SPLIT_K) of the T = cdiv(K, BLOCK_K):
        # balanced to one tile, never empty (check_tiles makes SPLIT_K <= T). The masks
        # below stay `< K`: splits meet on tile boundaries, only the last tile is ragged.
        k_tiles = tl.cdiv(K, BLOCK_K)
        k_begin = split * k_tiles // SPLIT_K * BLOCK_K
        k_end = (split + 1) * k_tiles // SPLIT_K * BLOCK_K
    FMA: tl.constexpr = IEEE and BLOCK_M > 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The first weight tile is loaded before waiting for the previous kernel (under PDL the
    # weight stream starts while it drains); the loop takes the rest. Same order either way.
    ks = k_begin + tl.arange(0, BLOCK_K)
    w = _weight_tile(w_ptr, cols, col_ok, ks, K, stride_wn, FMA)
    prefetch_l2(pf_ptr, pf_bytes, PREFETCH, PF_CHUNK, PF_LANES)   # the next kernel's weights
    await_previous_kernel(GDC)
    acc = _accumulate_tile(acc, w, x_ptr, rows, ks, row_ok, K, stride_xm, SILU_MUL, BLOCK_M, FMA)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, cols, col_ok, ks, K, stride_wn, FMA)
        acc = _accumulate_tile(acc, w, x_ptr, rows, ks, row_ok, K, stride_xm, SILU_MUL, BLOCK_M,
                               FMA)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        _reduce_split_k(acc, partials_ptr, counters_ptr, out_ptr, rows, row_ok, cols, col_ok, M,
                        N, stride_om, split, row_block * tl.num_programs(0) + tl.program_id(0),
                        SPLIT_K)


# Tile shapes (BLOCK_N, BLOCK_K, num_warps, num_stages) for one row and for more rows (bf16 /
# fp32), by default and per (N, K) weight shape; a fifth entry SPLIT_K splits K over that many
# programs per output tile (module docstring), and 4 entries mean SPLIT_K = 1. One row
# needs many programs in flight to saturate HBM (N / BLOCK_N * SPLIT_K of them); bf16 rows use
# tensor cores (tl.dot needs BLOCK_N >= 16); fp32 rows keep one row's narrow blocks, BLOCK_K
# bounded by the [BLOCK_M, BLOCK_N, BLOCK_K] products' registers. The per-shape entries are the
# Ouro-1.4B layer's, the fastest of `python -m rltlab.bench.gemv --sweep`, except the
# few_rows_fma ones (below). Under PDL the same tiles serve: the ones a --sweep --pdl picked per
# shape made the engine's interleaved one-row round slower (docs/results.md, "Negative
# results"). The narrow o and down entries (down split-K 4) were picked under PDL and checked in
# an interleaved round of 96 GEMVs. The one-row o and gate/up entries were then re-tuned inside
# the engine's PDL + L2-prefetch round, which chains of one shape mispredict (docs/results.md
# E15).
TILES = {
    "one_row": (4, 1024, 4, 2), "few_rows": (16, 256, 4, 3), "few_rows_fma": (4, 128, 4, 2),
    ("one_row", 6144, 2048): (4, 1024, 4, 2), ("one_row", 2048, 2048): (4, 2048, 4, 2),
    ("one_row", 11264, 2048): (4, 1024, 4, 2), ("one_row", 2048, 5632): (8, 512, 2, 5, 4),
    ("few_rows", 6144, 2048): (64, 256, 4, 4), ("few_rows", 2048, 2048): (16, 256, 4, 4),
    ("few_rows", 11264, 2048): (32, 256, 4, 3),
    # down at 16 rows: split-K 8, the sweep's best (docs/results.md H25)
    ("few_rows", 2048, 5632): (64, 64, 4, 3, 8),
    # the embedded model's fp32 q/k/v, gate/up and down (its o keeps the default): the best of
    # `python -m rltlab.bench.gemv --config artifacts/ouro-tiny/config.json --dtype float32
    # --rows 1 5 16 37 --sweep` at 5, 16 and 37 rows
    ("few_rows_fma", 1152, 384): (2, 64, 1, 3), ("few_rows_fma", 2048, 384): (2, 256, 1, 2),
    ("few_rows_fma", 384, 1024): (4, 256, 4, 3),
    # ... and by row count, ("few_rows_fma", N, K, T) for rounds of at most T rows (the
    # smallest tier that holds them, FMA_ROW_TIERS), the best measured in the tree program's
    # rounds: at 5 rows (the heads' leaves alone) q/k/v (with RoPE, kernels/rope_gemv.py) and
    # o; at 16 (the lead program) q/k/v and down.
    ("few_rows_fma", 1152, 384, 8): (16, 64, 4, 2), ("few_rows_fma", 384, 384, 8): (1, 64, 4, 2),
    ("few_rows_fma", 1152, 384, 16): (2, 128, 4, 2),
    ("few_rows_fma", 384, 1024, 16): (1, 256, 4, 2),
}
FMA_ROW_TIERS = (8, 16)


def tiles_for(rows: int, n: int, k: int, fma: bool = False) -> tuple[int, ...]:
    """The tiles of a [rows, K] x [N, K]^T product; fma: several rows as FMA products (fp32)
    rather than tl.dot."""
    kind = "one_row" if rows == 1 else "few_rows_fma" if fma else "few_rows"
    if kind == "few_rows_fma":
        for tier in FMA_ROW_TIERS:
            if rows <= tier and (kind, n, k, tier) in TILES:
                return TILES[kind, n, k, tier]
    return TILES.get((kind, n, k), TILES[kind])


def block_rows(rows: int, fma: bool) -> int:
    """BLOCK_M of a [rows, K] product: 1, tl.dot's 16, or FMA products' rows rounded up to a
    power of two, at most FMA_ROWS."""
    if rows == 1:
        return 1
    return min(FMA_ROWS, triton.next_power_of_2(rows)) if fma else DOT_ROWS


def check_tiles(tiles, rows: int, n: int, k: int, fma: bool = False
                ) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) of 4 or 5 tiles for a [rows, K] x
    [N, K]^T product (fma: rows as FMA products, block_rows); ValueError where split-K cannot
    run it."""
    if len(tiles) not in (4, 5):
        raise ValueError(f"tiles are (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]), "
                         f"got {tiles!r}")
    block_n, block_k, warps, stages = tiles[:4]
    split_k = tiles[4] if len(tiles) == 5 else 1
    k_tiles = triton.cdiv(k, block_k)
    if split_k < 1:
        raise ValueError(f"SPLIT_K must be >= 1, got {split_k}")
    if split_k > k_tiles:
        raise ValueError(f"SPLIT_K={split_k} leaves a split without a BLOCK_K tile: K={k} has "
                         f"{k_tiles} tile(s) of BLOCK_K={block_k}")
    if split_k > 1 and (split_k * rows * n > SPLIT_K_PARTIALS or triton.cdiv(n, block_n)
                        * triton.cdiv(rows, block_rows(rows, fma)) > SPLIT_K_COUNTERS):
        raise ValueError(f"{rows} rows, N={n}, BLOCK_N={block_n}, SPLIT_K={split_k} exceeds the "
                         f"split-K workspace ({SPLIT_K_PARTIALS} partials, {SPLIT_K_COUNTERS} "
                         f"counters)")
    return block_n, block_k, warps, stages, split_k


def split_k_workspace(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials, int32 counters) of split-K on ``device``, allocated zeroed on first use."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:   # one key per GPU, as x.device gives
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _split_k_workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # The counters' zeroing would be captured into the graph instead of run now.
            raise RuntimeError("run one split-K small_m_linear on this device before capturing "
                               "a CUDA graph (it allocates the split-K workspace)")
        _split_k_workspaces[device] = (
            torch.empty(SPLIT_K_PARTIALS, dtype=torch.float32, device=device),
            torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=device))
    return _split_k_workspaces[device]


def small_m_linear(x, w, act=None, tiles=None, *, pdl=False, prefetch=None):
    """Triton version of small_m_linear_ref for 1 <= M <= MAX_ROWS rows, in blocks of
    block_rows(M) (pdl: kernels/pdl.py; tiles: see TILES; prefetch: (weight, nbytes) to bring
    into L2 for the next kernel, kernels/l2_prefetch.py)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_m_linear takes 1..{MAX_ROWS} rows, got {m}")
    if x.shape[1] != (2 * k if act == "silu_mul" else k):
        raise ValueError(f"x has {x.shape[1]} columns; w {tuple(w.shape)} with act={act!r} "
                         f"needs {2 * k if act == 'silu_mul' else k}")
    if x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("x and w must share one dtype and be contiguous in their last dim")
    launch = launch_options(pdl, x.device)
    fp32 = w.dtype == torch.float32
    block_n, block_k, warps, stages, split_k = check_tiles(tiles or tiles_for(m, n, k, fp32), m,
                                                           n, k, fp32)   # fp32 rows: FMA products
    block_m = block_rows(m, fp32)
    pf_args, pf_meta = prefetch_args(prefetch, placeholder=w)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # SPLIT_K = 1 never touches the workspace: out stands in for its pointers.
    partials, counters = split_k_workspace(x.device) if split_k > 1 else (out, out)
    _small_m_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m) * split_k)](
        x, w, out, partials, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        *pf_args, SILU_MUL=act == "silu_mul", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, IEEE=fp32, num_warps=warps,
        num_stages=stages, **pf_meta, **launch,
    )
    return out


def rope_write_kv_ref(qkv, cos, sin, kv_cache, layer, planes, slots, num_heads, num_kv_heads,
                      head_dim, *, k_out=None):
    """q, k, v from qkv [N, (Hq + 2 Hkv) D]; RoPE (rotate-half, cos/sin [N, D]) on q and k;
    k, v written to kv_cache[layer, :, planes[n], slots[n]] (slot < 0: skipped); the RoPE'd k
    of every row also to k_out [N, Hkv, D] if given. -> q [N, Hq, D]."""
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(-1, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(-1, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(-1, num_kv_heads, head_dim)
    cos, sin = cos[:, None], sin[:, None]

    def rope(t):
        half = head_dim // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

    k = rope(k)
    write_kv_ref(kv_cache, layer, planes, slots, k, v)
    if k_out is not None:
        k_out.copy_(k)
    return rope(q)


@triton.jit
def _rope_rows(base, cos, sin, heads, d, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
               NUM: tl.constexpr):
    """RoPE'd fp32 [BLOCK_H, BLOCK_D] tile of NUM heads starting at ``base``."""
    mask = (heads < NUM)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(base + heads[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    y = tl.load(base + heads[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0)
    sign = tl.where(d < HALF, -1.0, 1.0)
    return x.to(tl.float32) * cos[None, :] + sign[None, :] * y.to(tl.float32) * sin[None, :], mask


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, planes_ptr, slots_ptr, k_out_ptr, block_size,
    stride_qkv, stride_cos, stride_q, stride_k_out,
    stride_kv, stride_p, stride_b, stride_s, stride_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, K_OUT: tl.constexpr,
    GDC: tl.constexpr,
):
    await_previous_kernel(GDC)
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + n * stride_cos + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + n * stride_cos + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    row = qkv_ptr + n * stride_qkv
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)
    q, q_mask = _rope_rows(row, cos, sin, heads, d, HALF, HEAD_DIM, NUM_HEADS)
    tl.store(q_ptr + n * stride_q + heads[:, None] * HEAD_DIM + d[None, :],
             q.to(q_ptr.dtype.element_ty), mask=q_mask)
    kv_heads = tl.arange(0, BLOCK_KV)
    k, kv_mask = _rope_rows(row + NUM_HEADS * HEAD_DIM, cos, sin, kv_heads, d, HALF, HEAD_DIM,
                            NUM_KV_HEADS)
    if K_OUT:
        tl.store(k_out_ptr + n * stride_k_out + kv_heads[:, None] * HEAD_DIM + d[None, :],
                 k.to(k_out_ptr.dtype.element_ty), mask=kv_mask)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot >= 0:
        plane = tl.load(planes_ptr + n).to(tl.int64)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM
                    + d[None, :], mask=kv_mask, other=0.0)
        dst = (kv_ptr + plane * stride_p + (slot // block_size) * stride_b
               + (slot % block_size) * stride_s + kv_heads[:, None] * stride_h + d[None, :])
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=kv_mask)


def rope_write_kv(qkv, cos, sin, kv_cache, layer, planes, slots, num_heads, num_kv_heads,
                  head_dim, *, k_out=None, pdl=False):
    """Triton version of rope_write_kv_ref (planes: int32 [N], slots: int [N]; pdl:
    kernels/pdl.py)."""
    n = qkv.shape[0]
    launch = launch_options(pdl, qkv.device)
    if k_out is not None and (k_out.shape != (n, num_kv_heads, head_dim) or not
                              k_out.is_contiguous() or k_out.dtype != kv_cache.dtype):
        raise ValueError(f"k_out must be a contiguous [N, Hkv, D] = [{n}, {num_kv_heads}, "
                         f"{head_dim}] tensor of the cache's dtype, got {tuple(k_out.shape)} "
                         f"{k_out.dtype}")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [N, (Hq + 2 Hkv) * D] contiguous")
    if cos.shape != (n, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin must be [N, D] = [{n}, {head_dim}] with one layout")
    if kv_cache.shape[-1] != head_dim or kv_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim must match and be contiguous")
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    layer_cache = kv_cache[layer]   # [2, P, NB, BS, Hkv, D]
    _rope_write_kv_kernel[(n,)](
        qkv, cos, sin, q, layer_cache, planes, slots, q if k_out is None else k_out,
        kv_cache.shape[4], qkv.stride(0), cos.stride(0), q.stride(0),
        0 if k_out is None else k_out.stride(0), *layer_cache.stride()[:5],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), K_OUT=k_out is not None, **launch,
    )
    return q
