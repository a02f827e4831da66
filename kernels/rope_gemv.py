"""The q/k/v projection of a few rows with RoPE and the K/V write in the GEMV's epilogue.

A one-row decode round used to compute qkv = y @ w_qkv.T with the weight-streaming GEMV
(kernels/small_batch.py) and then run rope_write_kv: one program that reads qkv back, rotates q
and k, and writes k and v into the paged cache. That second kernel moves a few KB, but it sits on
the round's critical path in every layer: it waits for the whole GEMV, runs on one SM, and the
attention waits for it (24 launches per round, ~3 us each in an eager profile).

rope_kv_linear does both in one kernel. Each program owns BLOCK_N / 2 RoPE pairs of one head:
head-local dims j and j + D/2, which rotate-half RoPE mixes. It streams the weight rows of both
halves (the same bytes as the plain GEMV's BLOCK_N rows), so once its dot products are done it
holds both members of every pair and can rotate them in registers. Then it stores:

  * a q head: the rotated pair into q [M, Hq, D];
  * a k head: the rotated pair into the cache at (plane, slot), unless slot < 0 (padding);
  * a v head: the pair unrotated into the cache, unless slot < 0.

Several rows (tree and chain verification, small batches) share each loaded weight tile: a
program computes the [BLOCK_M, PAIRS] dot products of up to 16 rows as FMA products (the
arithmetic of one row, per row), each row with its own position, plane and slot; more rows
add row blocks on the grid's second axis.

Accumulation is fp32, as in small_m_linear; the rotation is applied to the fp32 dot products,
and the result is rounded once, where the unfused path rounds qkv first and the rotation again
(the same within one bf16 step, and identical in fp32 up to summation order).
"""

import torch
import triton
import triton.language as tl

from .l2_prefetch import prefetch_args, prefetch_l2
from .pdl import await_previous_kernel, launch_options
from .small_batch import (MAX_ROWS, block_rows, rope_write_kv_ref, small_m_linear_ref,
                          tiles_for)


def rope_kv_linear_ref(x, w_qkv, cos, sin, kv_cache, layer, planes, slots, num_heads,
                       num_kv_heads, head_dim):
    """rope_write_kv_ref(x @ w_qkv.T, ...): q/k/v of M rows, RoPE'd q returned [M, Hq, D],
    row m's k and v written to kv_cache[layer, :, planes[m], slots[m]] (slot < 0: skipped)."""
    return rope_write_kv_ref(small_m_linear_ref(x, w_qkv), cos, sin, kv_cache, layer, planes,
                             slots, num_heads, num_kv_heads, head_dim)


@triton.jit
def _weight_tile(w_ptr, feats, ks, K, stride_wn, BLOCK_M: tl.constexpr):
    """w[feats, ks]: one [PAIRS, BLOCK_K] weight tile (zeros past K); for several rows
    [1, PAIRS, BLOCK_K], in the layout of the [BLOCK_M, PAIRS, BLOCK_K] products."""
    if BLOCK_M == 1:   # one return statement: Triton requires one return type across them
        tile = tl.load(w_ptr + feats[:, None] * stride_wn + ks[None, :], mask=(ks < K)[None, :],
                       other=0.0)
    else:
        tile = tl.load(w_ptr + feats[None, :, None] * stride_wn + ks[None, None, :],
                       mask=(ks < K)[None, None, :], other=0.0)
    return tile


@triton.jit
def _accumulate(acc_lo, acc_hi, w_lo, w_hi, x_ptr, rows, row_ok, ks, K, stride_x,
                BLOCK_M: tl.constexpr):
    """Both halves' tiles times the rows' x[:, ks] (loaded once), added in fp32 ([BLOCK_M,
    PAIRS]): one row as a broadcast multiply and row sum, several as [M, PAIRS, K] products."""
    if BLOCK_M == 1:
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        acc_lo += tl.sum(w_lo.to(tl.float32) * x, axis=1)[None, :]
        acc_hi += tl.sum(w_hi.to(tl.float32) * x, axis=1)[None, :]
    else:
        x = tl.load(x_ptr + rows[:, None, None] * stride_x + ks[None, None, :],
                    mask=row_ok[:, None, None] & (ks < K)[None, None, :], other=0.0)
        acc_lo += tl.sum(w_lo.to(tl.float32) * x.to(tl.float32), axis=2)
        acc_hi += tl.sum(w_hi.to(tl.float32) * x.to(tl.float32), axis=2)
    return acc_lo, acc_hi


@triton.jit
def _rope_kv_linear_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, planes_ptr, slots_ptr, M, K, stride_x,
    stride_wn, stride_cos, stride_q, block_size, stride_kv, stride_p, stride_b, stride_s,
    stride_h, pf_ptr, pf_bytes,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
    PREFETCH: tl.constexpr, PF_CHUNK: tl.constexpr, PF_LANES: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    blocks_per_head: tl.constexpr = HALF // PAIRS
    head = tl.program_id(0) // blocks_per_head           # of the Hq + 2 Hkv heads of q|k|v
    lo = (tl.program_id(0) % blocks_per_head) * PAIRS + tl.arange(0, PAIRS)   # dims j < D/2
    hi = lo + HALF                                                           # their partners
    feat_lo, feat_hi = head * HEAD_DIM + lo, head * HEAD_DIM + hi      # weight rows
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)   # this program's block of rows
    row_ok = rows < M
    acc_lo = tl.zeros([BLOCK_M, PAIRS], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, PAIRS], tl.float32)
    # Weights are read before the wait (under PDL the stream starts while the previous kernel
    # drains), as in small_m_linear; x only after it.
    ks = tl.arange(0, BLOCK_K)
    w_lo = _weight_tile(w_ptr, feat_lo, ks, K, stride_wn, BLOCK_M)
    w_hi = _weight_tile(w_ptr, feat_hi, ks, K, stride_wn, BLOCK_M)
    prefetch_l2(pf_ptr, pf_bytes, PREFETCH, PF_CHUNK, PF_LANES)   # the next kernel's weights
    await_previous_kernel(GDC)
    acc_lo, acc_hi = _accumulate(acc_lo, acc_hi, w_lo, w_hi, x_ptr, rows, row_ok, ks, K,
                                 stride_x, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        acc_lo, acc_hi = _accumulate(
            acc_lo, acc_hi, _weight_tile(w_ptr, feat_lo, ks, K, stride_wn, BLOCK_M),
            _weight_tile(w_ptr, feat_hi, ks, K, stride_wn, BLOCK_M), x_ptr, rows, row_ok, ks, K,
            stride_x, BLOCK_M)

    ok = row_ok[:, None]
    if head < NUM_HEADS + NUM_KV_HEADS:
        # rotate-half RoPE: out[j] = x[j] cos[j] - x[j + D/2] sin[j],
        #                   out[j + D/2] = x[j + D/2] cos[j + D/2] + x[j] sin[j + D/2]
        at = rows[:, None] * stride_cos
        cos_lo = tl.load(cos_ptr + at + lo[None, :], mask=ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + at + lo[None, :], mask=ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + at + hi[None, :], mask=ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + at + hi[None, :], mask=ok, other=0.0).to(tl.float32)
        out_lo = acc_lo * cos_lo - acc_hi * sin_lo
        out_hi = acc_hi * cos_hi + acc_lo * sin_hi
    else:
        out_lo, out_hi = acc_lo, acc_hi
    if head < NUM_HEADS:
        q_at = q_ptr + rows[:, None] * stride_q + head * HEAD_DIM
        tl.store(q_at + lo[None, :], out_lo.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(q_at + hi[None, :], out_hi.to(q_ptr.dtype.element_ty), mask=ok)
    else:
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        plane = tl.load(planes_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        write = (slot >= 0)[:, None]                        # padding rows write nothing
        slot = tl.maximum(slot, 0)
        dst = kv_ptr + plane * stride_p + (slot // block_size) * stride_b \
            + (slot % block_size) * stride_s
        if head < NUM_HEADS + NUM_KV_HEADS:
            dst += (head - NUM_HEADS) * stride_h
        else:
            dst += stride_kv + (head - NUM_HEADS - NUM_KV_HEADS) * stride_h
        tl.store(dst[:, None] + lo[None, :], out_lo.to(kv_ptr.dtype.element_ty), mask=write)
        tl.store(dst[:, None] + hi[None, :], out_hi.to(kv_ptr.dtype.element_ty), mask=write)


def check_pairs(tiles, head_dim: int) -> tuple[int, int, int, int]:
    """(PAIRS, BLOCK_K, num_warps, num_stages) from one-row GEMV tiles: BLOCK_N = 2 PAIRS rows
    per program, PAIRS a power of two dividing D / 2; ValueError otherwise."""
    block_n, block_k, warps, stages = tiles[:4]
    if len(tiles) == 5 and tiles[4] != 1:
        raise ValueError(f"rope_kv_linear has no split-K, got tiles {tiles!r}")
    pairs = block_n // 2
    if block_n % 2 or pairs & (pairs - 1) or (head_dim // 2) % pairs or head_dim % 2:
        raise ValueError(f"BLOCK_N={block_n} must be twice a power of two that divides "
                         f"head_dim / 2 = {head_dim / 2}")
    return pairs, block_k, warps, stages


def rope_kv_linear(x, w_qkv, cos, sin, kv_cache, layer, planes, slots, num_heads, num_kv_heads,
                   head_dim, tiles=None, *, pdl=False, prefetch=None):
    """Triton version of rope_kv_linear_ref for 1 <= M <= MAX_ROWS rows: x [M, K],
    w_qkv [(Hq + 2 Hkv) D, K], cos/sin [M, D], planes int32 [M], slots int [M] (tiles: GEMV
    tiles, see small_batch.TILES, the FMA ones for M > 1; pdl: kernels/pdl.py; prefetch:
    (weight, nbytes), kernels/l2_prefetch.py). -> q [M, Hq, D]."""
    n_out, k = w_qkv.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rope_kv_linear takes 1..{MAX_ROWS} rows x [M, {k}], "
                         f"got {tuple(x.shape)}")
    if n_out != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"w_qkv has {n_out} rows, not (Hq + 2 Hkv) * D = "
                         f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    if x.dtype != w_qkv.dtype or not (x.is_contiguous() and w_qkv.stride(-1) == 1):
        raise ValueError("x and w_qkv must share one dtype and be contiguous in their last dim")
    if cos.shape != (m, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [M, D] = [{m}, {head_dim}], contiguous in D, with "
                         f"one layout")
    if kv_cache.shape[-1] != head_dim or kv_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim must match and be contiguous")
    if kv_cache.shape[-2] != num_kv_heads or not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"the cache has {kv_cache.shape[-2]} KV heads and "
                         f"{kv_cache.shape[0]} layers; asked for {num_kv_heads} and layer {layer}")
    if planes.numel() != m or slots.numel() != m:
        raise ValueError(f"planes and slots must hold one entry per row ({m})")
    pairs, block_k, warps, stages = check_pairs(tiles or tiles_for(m, n_out, k, fma=True),
                                                head_dim)
    block_m = block_rows(m, fma=True)
    launch = launch_options(pdl, x.device)
    pf_args, pf_meta = prefetch_args(prefetch, placeholder=w_qkv)
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    layer_cache = kv_cache[layer]   # [2, P, NB, BS, Hkv, D]
    _rope_kv_linear_kernel[(n_out // (2 * pairs), triton.cdiv(m, block_m))](
        x, w_qkv, cos, sin, q, layer_cache, planes, slots, m, k, x.stride(0), w_qkv.stride(0),
        cos.stride(0), q.stride(0), kv_cache.shape[4], *layer_cache.stride()[:5], *pf_args,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAIRS=pairs,
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pf_meta,
        **launch,
    )
    return q
