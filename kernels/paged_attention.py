"""Paged attention over a depth-aware (per-round "plane") KV cache.

Per layer the cache is k_cache / v_cache: [num_planes, num_blocks, block_size, Hkv, D]. A token's
key at position ``pos`` of a sequence lives at block ``block_table[pos // block_size]``, offset
``pos % block_size``, in the plane of the round that reads it. Query head ``h`` reads KV head
``h // (Hq // Hkv)`` (GQA, same grouping as Hugging Face ``repeat_kv``).

The Triton kernels gather keys position by position through the block table, so the key tile
size is independent of ``block_size`` (any block size works, power of two or not).
"""

import torch
import triton
import triton.language as tl

from .attention_tiles import LOG2E, attend_range, attend_tile, dot_block_d, dot_config
from .l2_prefetch import prefetch_args, prefetch_l2
from .pdl import await_previous_kernel, launch_options
from .shared_prefix import SharedPrefix, launch_shared_prefix, prefix_splits

# Launch settings (tuned in bf16 at head_dim 128; see docs/kernels.md).
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def _gather_keys(cache, plane, block_table, positions, block_size):
    """cache[plane, block_table[pos // bs], pos % bs] for each position -> [L, Hkv, D]."""
    pages = block_table[positions // block_size].long()
    return cache[plane, pages, positions % block_size]


def _attend(q, k, v, mask, scale):
    """q [M, Hq, D], k/v [L, Hkv, D], mask [M, L] (True = visible) -> [M, Hq, D] in q.dtype."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(dim=-1), v).to(q.dtype)


def paged_decode_attention_ref(q, k_cache, v_cache, planes, block_tables, context_lens, scale):
    """One query token per row; row b reads plane planes[b], keys 0..context_lens[b]-1."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[2]
    for b in range(q.shape[0]):
        positions = torch.arange(int(context_lens[b]), device=q.device)
        plane = int(planes[b])
        k = _gather_keys(k_cache, plane, block_tables[b], positions, block_size)
        v = _gather_keys(v_cache, plane, block_tables[b], positions, block_size)
        visible = torch.ones(1, len(positions), dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, visible, scale)[0]
    return out


def paged_decode_attention_torch(q, k_cache, v_cache, planes, block_tables, context_lens, scale,
                                 max_elements: int = 1 << 24):
    """paged_decode_attention_ref batched, the path off CUDA: the rows' keys gathered together,
    padded to the longest context and masked, instead of one gather and two einsums per row
    (a CPU closed loop on the tiny model ran 5.6x faster: docs/kernels.md). Rows go in groups
    of at most max_elements gathered key elements, so memory stays bounded."""
    out = torch.empty_like(q)
    rows, block_size = q.shape[0], k_cache.shape[2]
    if rows == 0:
        return out
    lens = context_lens.long()
    kv_heads, dim = k_cache.shape[3], k_cache.shape[4]
    group = q.shape[1] // kv_heads
    longest = int(lens.max())
    positions = torch.arange(longest, device=q.device)
    block_of, offset = positions // block_size, positions % block_size
    per_row = max(1, max_elements // max(1, longest * kv_heads * dim))
    for lo in range(0, rows, per_row):
        hi = min(rows, lo + per_row)
        # entries past a row's blocks may be anything: clamped into range, then masked
        pages = block_tables[lo:hi, block_of].long().clamp(0, k_cache.shape[1] - 1)
        plane = planes[lo:hi].long()[:, None]
        k = k_cache[plane, pages, offset].float()   # [B, L, Hkv, D]
        v = v_cache[plane, pages, offset].float()
        scores = torch.einsum("bhgd,blhd->bhgl", q[lo:hi].float().view(hi - lo, kv_heads, group,
                                                                       dim), k) * scale
        visible = positions[None, :] < lens[lo:hi, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        attn = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), v)
        out[lo:hi] = attn.reshape(hi - lo, q.shape[1], dim).to(q.dtype)
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, plane, block_table, start_pos, scale):
    """Causal chunk of one sequence: query i (position start_pos+i) sees keys 0..start_pos+i."""
    num_q = q.shape[0]
    positions = torch.arange(start_pos + num_q, device=q.device)
    k = _gather_keys(k_cache, plane, block_table, positions, k_cache.shape[2])
    v = _gather_keys(v_cache, plane, block_table, positions, k_cache.shape[2])
    query_pos = start_pos + torch.arange(num_q, device=q.device)
    return _attend(q, k, v, positions[None, :] <= query_pos[:, None], scale)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, planes_ptr, bt_ptr, ctx_ptr, start_ptr, out_ptr, lse_ptr,
    qk_scale, block_size, tiles_per_split, num_slots,
    stride_qb, stride_qh,
    stride_kp, stride_kb, stride_ks, stride_kh,
    stride_vp, stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_oh, stride_os, pf_ptr, pf_bytes,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, GDC: tl.constexpr,
    PREFETCH: tl.constexpr, PF_CHUNK: tl.constexpr, PF_LANES: tl.constexpr,
    HAS_START: tl.constexpr,
):
    # One program = (row, kv head, split of the key range). Its GQA group of query heads forms
    # the M side of tl.dot (padded to >= 16 rows), so every K/V element is read once per row.
    # Decode is memory bound, but the dot path gets Triton's pipelined loads: it ran 2.7x
    # faster than a broadcast-multiply-reduce over the same tiles (B=128).
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The o projection's weights into L2 while HBM would idle (kernels/l2_prefetch.py).
    prefetch_l2(pf_ptr, pf_bytes, PREFETCH, PF_CHUNK, PF_LANES)
    # Context lengths and planes come from the round's index, which no kernel of a PDL chain
    # writes (the host's copy lands before the chain starts): read before the wait (pdl.py).
    ctx = tl.load(ctx_ptr + row)
    plane = tl.load(planes_ptr + row).to(tl.int64)
    # With a shared-prefix plan (kernels/shared_prefix.py) a row in a group (start > 0) has
    # all of its attention done by its group's programs, own keys included.
    first = 0
    if HAS_START:
        first = tl.load(start_ptr + row)
    await_previous_kernel(GDC)
    if first == 0:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)
        # An empty split (start >= ctx) gives zeros with lse = -inf: zero weight in the merge.
        out, lse = attend_range(
            q, start, end, k_ptr + plane * stride_kp + kv_head * stride_kh,
            v_ptr + plane * stride_vp + kv_head * stride_vh, bt_ptr + row * stride_btb,
            block_size, stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, qk_scale,
            BLOCK_G, BLOCK_N, BLOCK_D, DOT_DTYPE, INPUT_PRECISION)
        out_offs = row * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(out_ptr + out_offs, out, mask=g_mask[:, None] & d_mask[None, :])
        # lse is a contiguous [B, Hq, num_slots] buffer (num_slots >= the splits).
        lse_offs = (row * GROUP * tl.num_programs(1) + heads) * num_slots + split
        tl.store(lse_ptr + lse_offs, lse, mask=g_mask)
        if HAS_START:
            # A row in no group gets nothing from the shared-range slots: zero weight there.
            if split == 0:
                for extra in range(tl.num_programs(2), num_slots):
                    tl.store(lse_ptr + lse_offs + extra, float("-inf"), mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr,
):
    await_previous_kernel(GDC)
    # Combine per-split softmax results: weight each split's normalized output by exp2(lse).
    pid = tl.program_id(0)  # row * num_heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(lse_ptr + pid * num_splits + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always has keys: the max is finite
    part = tl.load(part_ptr + (pid * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    part = tl.where((w > 0)[:, None], part, 0.0)   # a slot with no keys may be unwritten
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    row = pid // num_heads
    head = pid % num_heads
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out, mask=d_mask)


def _default_num_splits(work_items, max_context_len, block_n, device):
    """Split the key range until there are ~4 programs per SM (at least one key tile per split).

    Decode at small batch has few (row, kv head) programs; without splitting most SMs idle and
    a single program walks the whole context (B=1, 8K keys: ~10x faster with splits).
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(max_context_len, block_n), (4 * sms) // work_items))


def paged_decode_attention(q, k_cache, v_cache, planes, block_tables, context_lens, scale, *,
                           max_context_len=None, num_splits=None, block_n=None, pdl=False,
                           prefetch=None, shared: SharedPrefix | None = None,
                           num_prefix_splits=None):
    """Triton version of paged_decode_attention_ref (same arguments and result).

    max_context_len: host-side upper bound on context_lens (default: block table capacity);
    only used to size the key-range split. num_splits / block_n override the heuristics.
    pdl: launch with programmatic dependent launch (kernels/pdl.py).
    prefetch: (weight, nbytes) to bring into L2 for a later kernel (kernels/l2_prefetch.py).
    shared: rows whose prompt K/V is read once per group (kernels/shared_prefix.py);
    num_prefix_splits overrides the split of its shared range.
    """
    launch = launch_options(pdl, q.device)
    pf_args, pf_meta = prefetch_args(prefetch, placeholder=q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, \
        "head_dim must be contiguous"
    assert block_tables.stride(-1) == 1, "block table rows must be contiguous"
    block_n = block_n or DECODE_CONFIG["block_n"]
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    num_tiles = triton.cdiv(max_context_len, block_n)
    if num_splits is None:
        num_splits = _default_num_splits(batch * num_kv_heads, max_context_len, block_n, q.device)
    num_splits, tiles_per_split = _split_range(num_splits, num_tiles)
    if shared is not None:
        prefix = _split_range(num_prefix_splits or prefix_splits(
            batch, num_kv_heads, max_context_len, block_n, q.device), num_tiles)
    else:
        prefix = (0, 1)
    slots = num_splits + prefix[0]
    dot_dtype, precision = dot_config(k_cache.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(batch, num_heads, slots, device=q.device, dtype=torch.float32)
    # With one split the kernel writes the final result (cast to q.dtype) straight into out.
    part = out.unsqueeze(2) if slots == 1 else torch.empty(
        batch, num_heads, slots, head_dim, device=q.device, dtype=torch.float32)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, planes, block_tables, context_lens,
        context_lens if shared is None else shared.start, part, lse,   # (start unread: no plan)
        scale * LOG2E, block_size, tiles_per_split, slots,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:4], *v_cache.stride()[:4],
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), *pf_args,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=dot_block_d(head_dim),
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
        num_warps=DECODE_CONFIG["num_warps"], num_stages=DECODE_CONFIG["num_stages"], **pf_meta,
        HAS_START=shared is not None, **launch,
    )
    if shared is not None:
        launch_shared_prefix(q, k_cache, v_cache, planes, block_tables, context_lens, shared,
                             part, lse, (num_splits, tiles_per_split), prefix, scale * LOG2E,
                             block_n, (dot_dtype, precision), DECODE_CONFIG["num_warps"],
                             DECODE_CONFIG["num_stages"])
    if slots > 1:
        _merge_splits_kernel[(batch * num_heads,)](
            part, lse, out, num_heads, slots, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(slots), **launch,
        )
    return out


def _split_range(splits: int, num_tiles: int) -> tuple[int, int]:
    """(splits, tiles per split) covering num_tiles key tiles in about `splits` parts."""
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(splits, num_tiles)))
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr,
    qk_scale, start_pos, num_q, block_size,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # Flash-attention forward for one (query tile, query head), keys gathered via the block table.
    head = tl.program_id(1)
    kv_head = head // GROUP
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + i[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=(i < num_q)[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = start_pos + i

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: this tile's last query sees keys up to its own position, never past the chunk.
    kv_end = start_pos + tl.minimum((tl.program_id(0) + 1) * BLOCK_M, num_q)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        # Key 0 is visible to every row, so each row sees a key in the first tile.
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        m, l, acc = attend_tile(
            q, m, l, acc, k_base, v_base, bt_ptr, n, n_mask, visible, block_size,
            stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, qk_scale,
            DOT_DTYPE, INPUT_PRECISION)

    out = acc / l[:, None]
    tl.store(out_ptr + i[:, None] * stride_ot + head * stride_oh + d[None, :], out,
             mask=(i < num_q)[:, None] & d_mask[None, :])


def paged_prefill_attention(q, k_cache, v_cache, plane, block_table, start_pos, scale, *,
                            block_m=None, block_n=None):
    """Triton version of paged_prefill_attention_ref (plane and start_pos are Python ints).

    block_m / block_n override PREFILL_CONFIG's query / key tile sizes.
    """
    block_m = block_m or PREFILL_CONFIG["block_m"]
    block_n = block_n or PREFILL_CONFIG["block_n"]
    num_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, \
        "head_dim must be contiguous"
    assert block_table.stride(-1) == 1, "block table must be contiguous"
    # Slice the plane on the host: the kernel sees one plane, [num_blocks, block_size, Hkv, D].
    k_plane, v_plane = k_cache[plane], v_cache[plane]
    out = torch.empty_like(q)
    dot_dtype, precision = dot_config(k_cache.dtype)
    _prefill_kernel[(triton.cdiv(num_q, block_m), num_heads)](
        q, k_plane, v_plane, block_table, out,
        scale * LOG2E, start_pos, num_q, block_size,
        q.stride(0), q.stride(1),
        *k_plane.stride()[:3], *v_plane.stride()[:3],
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=dot_block_d(head_dim),
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
        num_warps=PREFILL_CONFIG["num_warps"], num_stages=PREFILL_CONFIG["num_stages"],
    )
    return out
