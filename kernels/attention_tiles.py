"""What the paged attention kernels share: one online-softmax step over a tile of keys gathered
through a block table, a key range's normalized result and log-sum-exp (the decode kernels'
splits), and the tl.dot operand settings (kernels/paged_attention.py,
kernels/shared_prefix.py)."""

import torch
import triton
import triton.language as tl

from .pdl import INTERPRETED

LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_config(dtype):
    """(operand dtype, input_precision) for tl.dot.

    bf16/fp16 dots use tensor cores; fp32 ones stay exact (tf32 would miss a 1e-5 tolerance).
    The interpreter's tl.dot multiplies the raw bits of 16-bit floats, so it gets fp32 operands.
    """
    dot_dtype = tl.float32 if INTERPRETED else _TL_DTYPES[dtype]
    return dot_dtype, "ieee" if dot_dtype == tl.float32 else "tf32"


def dot_block_d(head_dim: int) -> int:
    """BLOCK_D of a head dimension in the attention tiles: a power of two, and at least the
    K of 16 that a compiled tl.dot needs (the interpreter takes any; the d < HEAD_DIM masks
    zero the padding)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def attend_tile(
    q, m, l, acc, k_base, v_base, bt_ptr, n, n_mask, visible, block_size,
    stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, qk_scale,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One online-softmax step of queries q [M, D] over the keys at positions n [N].

    Keys are gathered position by position through the block table, so the tile size does not
    depend on block_size. visible [M, N] masks keys out; every row must see a key in its first
    tile (m is -inf until then).
    """
    page = tl.load(bt_ptr + n // block_size, mask=n_mask, other=0).to(tl.int64)
    off = n % block_size
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + (page * stride_kb + off * stride_ks)[:, None] + d[None, :],
                mask=kv_mask, other=0.0).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    v = tl.load(v_base + (page * stride_vb + off * stride_vs)[:, None] + d[None, :],
                mask=kv_mask, other=0.0).to(DOT_DTYPE)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=INPUT_PRECISION)
    return m_new, l, acc


@triton.jit
def attend_range(
    q, start, end, k_base, v_base, bt_ptr, block_size,
    stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Queries q [BLOCK_M, D] over the keys at positions start..end-1, every one visible to
    every query -> (normalized output [BLOCK_M, BLOCK_D] fp32, log2-sum-exp [BLOCK_M]). An
    empty range gives zeros with lse = -inf, so a split merge gives it zero weight."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        m, l, acc = attend_tile(
            q, m, l, acc, k_base, v_base, bt_ptr, n, n_mask, n_mask[None, :], block_size,
            stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, qk_scale,
            DOT_DTYPE, INPUT_PRECISION)
    has_keys = l > 0
    l_safe = tl.where(has_keys, l, 1.0)
    return acc / l_safe[:, None], tl.where(has_keys, m + tl.log2(l_safe), float("-inf"))
