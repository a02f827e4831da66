"""KV cache writes and LAST_EXITED finalize copies.

kv_cache: [num_layers, 2 (k, v), num_planes, num_blocks, block_size, Hkv, D]. A token's slot is
block_id * block_size + offset_in_block; plane p (0-based) holds round p + 1. A negative slot marks
a padding row (e.g. a CUDA-graph batch padded to a fixed size) and is skipped by every function.
"""

import torch
import triton
import triton.language as tl


def _split_slots(slots, block_size):
    slots = slots.long()
    return slots // block_size, slots % block_size


def last_exited_copy_ref(kv_cache, slots, exit_planes):
    """In place: for every layer, k and v, plane p > exit_planes[n]: copy plane exit_planes[n]."""
    keep = slots >= 0
    exit_planes = exit_planes[keep].long()
    block, offset = _split_slots(slots[keep], kv_cache.shape[4])
    src = kv_cache[:, :, exit_planes, block, offset]  # [L, 2, N, Hkv, D], a copy
    for plane in range(1, kv_cache.shape[2]):
        deeper = exit_planes < plane
        kv_cache[:, :, plane, block[deeper], offset[deeper]] = src[:, :, deeper]


@triton.jit
def _last_exited_copy_kernel(
    kv_ptr, slots_ptr, exit_planes_ptr,
    num_planes, block_size,
    stride_l, stride_kv, stride_p, stride_b, stride_s, stride_h, stride_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program = (token, layer * 2 + k/v): read the exit plane's row once, store it to every
    # deeper plane.
    token = tl.program_id(0)
    layer_kv = tl.program_id(1).to(tl.int64)  # layer * stride_l overflows int32 on real caches
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        exit_plane = tl.load(exit_planes_ptr + token)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        base = (kv_ptr + (layer_kv // 2) * stride_l + (layer_kv % 2) * stride_kv
                + (slot // block_size) * stride_b + (slot % block_size) * stride_s
                + h[:, None] * stride_h + d[None, :] * stride_d)
        src = base + exit_plane.to(tl.int64) * stride_p
        row = tl.load(src, mask=mask)
        dst = src
        for _ in range(exit_plane + 1, num_planes):
            dst += stride_p  # 64-bit pointer arithmetic: no int32 overflow on big caches
            tl.store(dst, row, mask=mask)


def last_exited_copy(kv_cache, slots, exit_planes):
    """Triton version of last_exited_copy_ref (in place). slots: int64 [N],
    exit_planes: int32 [N]."""
    num_layers, _, num_planes, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if slots.numel() == 0:
        return
    _last_exited_copy_kernel[(slots.numel(), num_layers * 2)](
        kv_cache, slots, exit_planes, num_planes, block_size, *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _planes_per_row(planes, num_rows, device):
    """An int plane (all rows) or an int32 [N] tensor -> int tensor [N]."""
    if isinstance(planes, int):
        return torch.full((num_rows,), planes, dtype=torch.int32, device=device)
    return planes


def write_kv_ref(kv_cache, layer, planes, slots, k, v):
    """In place: kv_cache[layer, 0/1, planes[n], slot n] = k[n] / v[n]; k, v: [N, Hkv, D]."""
    planes = _planes_per_row(planes, slots.numel(), slots.device)
    keep = slots >= 0
    block, offset = _split_slots(slots[keep], kv_cache.shape[4])
    planes = planes[keep].long()
    kv_cache[layer, 0, planes, block, offset] = k[keep].to(kv_cache.dtype)
    kv_cache[layer, 1, planes, block, offset] = v[keep].to(kv_cache.dtype)


@triton.jit
def _write_kv_kernel(
    kv_ptr, planes_ptr, slots_ptr, k_ptr, v_ptr,
    block_size,
    stride_kv, stride_p, stride_b, stride_s, stride_h, stride_d,
    stride_kn, stride_kh, stride_vn, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot >= 0:
        plane = tl.load(planes_ptr + n).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (kv_ptr + plane * stride_p + (slot // block_size) * stride_b
               + (slot % block_size) * stride_s + h[:, None] * stride_h + d[None, :] * stride_d)
        k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_kv, v, mask=mask)


def write_kv(kv_cache, layer, planes, slots, k, v):
    """Triton version of write_kv_ref. k, v: [N, Hkv, D] with contiguous head_dim."""
    num_kv_heads, head_dim = kv_cache.shape[5], kv_cache.shape[6]
    assert k.stride(-1) == v.stride(-1) == 1, "head_dim of k and v must be contiguous"
    if slots.numel() == 0:
        return
    planes = _planes_per_row(planes, slots.numel(), slots.device)
    layer_cache = kv_cache[layer]  # view [2, P, NB, BS, Hkv, D]
    _write_kv_kernel[(slots.numel(),)](
        layer_cache, planes, slots, k, v, kv_cache.shape[4], *layer_cache.stride(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
