"""Decode attention that reads a shared prompt's K/V once per group instead of once per row.

The n samples of a request (rltlab/engine/groups.py, the GRPO shape) point their block tables at
the same physical blocks for the prompt. Plain paged decode attention (paged_attention.py)
reads those blocks once per row: at 512-token prompts, n = 8 and ~100 generated tokens, ~85% of
a decode step's K/V traffic is the same prompt read eight times over, and decode at c = 128 is
bound by that traffic (W5 in rltlab.bench.engine).

Here a decode step splits each grouped row's keys at the group's shared length L, and one
program per (group, kv head, split) does both parts of its members' attention:
  * positions [0, L): it loads each K/V tile of its share of the range once and scores it
    against every member's queries together (members x GQA heads form the M side of tl.dot),
    writing one partial softmax result per member and split;
  * positions [L, ctx): the members' own keys, a few tiles each (the tokens generated so far).
    The group's programs share them out, (member, key-range split) by (member, split), so a
    member's own pass runs where the group's prefix pass ran, not as a program of its own: as
    one program per row and head (paged_attention._decode_kernel from start = L), these passes
    were a few dependent tile loads each, latency-bound, and took more time than the prefix;
  * the split merge (log-sum-exp weighted) combines both, as it combines key-range splits.
The result is the same attention; only the summation order differs. Rows in no group take
paged_attention._decode_kernel as before.

SharedPrefix is the plan; shared_prefix_plan builds it on the host from what a decode step
stages anyway (planes, context lengths, block tables). Two rows may share [0, L) when they read
the same plane and their block tables name the same physical blocks for every position below
L, and L is below both context lengths: they then read the very same memory there, whatever it
holds. L is capped one position short of the shortest context, so every row keeps a key of
its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .attention_tiles import attend_range, dot_block_d

# Rows per group program: members x GQA heads fill the M side of tl.dot (16 = its minimum);
# a larger set of rows sharing a prefix is split into several groups.
MAX_MEMBERS = 16


@dataclass
class SharedPrefix:
    """Per decode row b (all int32 tensors on the attention's device):
    start [B]: where the row's own keys begin, after its group's shared prefix (0 if it is in
    no group: _decode_kernel then reads all of its keys);
    and per group g, in the order of their first rows (g < the number of groups; a group's
    first row is at least g, so the groups of rows < n sit in slots < n):
    length [B]: the length L of group g's shared prefix, 0 past the last group;
    members [B, MAX_MEMBERS]: group g's rows, its first row (the leader) first, padded with
    -1."""
    start: torch.Tensor
    length: torch.Tensor
    members: torch.Tensor

    def rows(self, n: int) -> SharedPrefix:
        return SharedPrefix(self.start[:n], self.length[:n], self.members[:n])


def shared_prefix_plan(planes: np.ndarray, context_lens: np.ndarray, tables: np.ndarray,
                       block_size: int, start: np.ndarray, length: np.ndarray,
                       members: np.ndarray) -> int:
    """Fill start / length / members (numpy views of the rows' plan, any size >= rows) for
    the rows given by planes / context_lens / tables [rows, blocks]. Rows that read the same
    plane and the same first block form a group (in row order, up to MAX_MEMBERS each); its
    shared length is the common run of identical leading blocks, times block_size, capped at
    the shortest context minus one (at least 1: the rows share their first block and each
    context holds 2+ positions). Groups take slots 0, 1, ... of length / members in the order
    of their leaders. Returns the number of groups."""
    rows = len(planes)
    start[:], length[:], members[:] = 0, 0, -1
    if rows < 2:
        return 0
    keys: dict[tuple[int, int], list[int]] = {}
    for row in range(rows):
        if context_lens[row] > 1:
            keys.setdefault((int(planes[row]), int(tables[row, 0])), []).append(row)
    groups = 0
    for same in keys.values():
        for lo in range(0, len(same), MAX_MEMBERS):
            chunk = same[lo: lo + MAX_MEMBERS]
            if len(chunk) < 2:
                continue
            shortest = int(context_lens[chunk].min())
            blocks = -(-(shortest - 1) // block_size)   # blocks holding positions < shortest-1
            common = np.all(tables[chunk, :blocks] == tables[chunk[0], :blocks], axis=0)
            run = blocks if common.all() else int(np.argmin(common))
            shared = min(run * block_size, shortest - 1)
            start[chunk] = shared
            length[groups] = shared
            members[groups, : len(chunk)] = chunk
            groups += 1
    return groups


@triton.jit
def _shared_prefix_kernel(
    q_ptr, k_ptr, v_ptr, planes_ptr, bt_ptr, ctx_ptr, length_ptr, members_ptr, out_ptr, lse_ptr,
    num_rows, num_heads, qk_scale, block_size, tiles_per_split, slot0, num_slots, own_splits,
    own_tiles_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_kb, stride_ks, stride_kh,
    stride_vp, stride_vb, stride_vs, stride_vh,
    stride_btb, stride_mb,
    stride_ob, stride_oh, stride_os,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # One program = (kv head, split of the shared range) x group slot, the group slot the
    # slowest axis: the groups' programs are dispatched first, the empty slots' (length 0) after
    # them, while the last groups run. A group whose leader is past the launch's rows has none
    # of its rows in it.
    splits = tl.num_programs(0) // (num_heads // GROUP)
    kv_head = tl.program_id(0) // splits
    split = tl.program_id(0) % splits
    group_slot = tl.program_id(1)
    length = tl.load(length_ptr + group_slot)
    leader = tl.load(members_ptr + group_slot * stride_mb)
    if (length > 0) & (leader < num_rows):
        m_idx = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        member_j = m_idx // GROUP
        in_group = member_j < MEMBERS
        member = tl.load(members_ptr + group_slot * stride_mb + member_j, mask=in_group,
                         other=-1)
        valid = in_group & (member >= 0) & (member < num_rows)
        member = tl.where(valid, member, 0)
        heads = kv_head * GROUP + m_idx % GROUP
        q = tl.load(q_ptr + member[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
        plane = tl.load(planes_ptr + leader).to(tl.int64)
        k_base = k_ptr + plane * stride_kp + kv_head * stride_kh
        v_base = v_ptr + plane * stride_vp + kv_head * stride_vh
        first = split * tiles_per_split * BLOCK_N
        # An empty split (first >= length) writes lse = -inf: zero weight in the merge.
        out, lse = attend_range(
            q, first, tl.minimum(first + tiles_per_split * BLOCK_N, length), k_base, v_base,
            bt_ptr + leader * stride_btb, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
            d, d_mask, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, DOT_DTYPE, INPUT_PRECISION)
        slot = slot0 + split
        out_offs = (member[:, None] * stride_ob + heads[:, None] * stride_oh + slot * stride_os
                    + d[None, :])
        tl.store(out_ptr + out_offs, out, mask=valid[:, None] & d_mask[None, :])
        lse_offs = (member * num_heads + heads) * num_slots + slot
        tl.store(lse_ptr + lse_offs, lse, mask=valid)

        # The members' own keys [length, ctx): work item (member j, own split c) -> slot c of
        # member j, the slots _decode_kernel fills for a row in no group; items are dealt out
        # to the group's programs in turn.
        g = tl.arange(0, BLOCK_G)
        g_mask = g < GROUP
        own_heads = kv_head * GROUP + g
        for item in range(split, MEMBERS * own_splits, splits):
            j = item // own_splits
            c = item % own_splits
            row = tl.load(members_ptr + group_slot * stride_mb + j)
            if (row >= 0) & (row < num_rows):
                ctx = tl.load(ctx_ptr + row)
                start = length + c * own_tiles_per_split * BLOCK_N
                q_row = tl.load(q_ptr + row * stride_qb + own_heads[:, None] * stride_qh
                                + d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                                other=0.0).to(DOT_DTYPE)
                own, own_lse = attend_range(
                    q_row, start, tl.minimum(start + own_tiles_per_split * BLOCK_N, ctx),
                    k_base, v_base, bt_ptr + row * stride_btb, block_size, stride_kb, stride_ks,
                    stride_vb, stride_vs, d, d_mask, qk_scale, BLOCK_G, BLOCK_N, BLOCK_D,
                    DOT_DTYPE, INPUT_PRECISION)
                tl.store(out_ptr + row * stride_ob + own_heads[:, None] * stride_oh
                         + c * stride_os + d[None, :], own,
                         mask=g_mask[:, None] & d_mask[None, :])
                tl.store(lse_ptr + (row * num_heads + own_heads) * num_slots + c, own_lse,
                         mask=g_mask)


def prefix_splits(rows: int, num_kv_heads: int, max_context_len: int, block_n: int,
                  device) -> int:
    """Splits of the shared range: ~4 programs per SM if the rows formed groups of 8 (the
    count of groups is the device's to know; the grid is fixed for a CUDA graph)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    work = max(1, -(-rows // 8) * num_kv_heads)
    return max(1, min(triton.cdiv(max_context_len, block_n), (4 * sms) // work))


def launch_shared_prefix(q, k_cache, v_cache, planes, block_tables, context_lens,
                         shared: SharedPrefix, part, lse, own: tuple[int, int],
                         prefix: tuple[int, int], scale_log2, block_n: int, dot: tuple,
                         num_warps: int, num_stages: int) -> None:
    """The groups' attention, written into their members' part / lse slots (part
    [B, Hq, slots, D] fp32, lse [B, Hq, slots]): own = (splits, tiles per split) of the
    members' own keys, in slots 0 .. splits - 1 as paged_attention._decode_kernel's key-range
    splits; prefix = (splits, tiles per split) of the shared range, in the slots after
    them."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    group = num_heads // num_kv_heads
    assert shared.members.stride(-1) == 1 and shared.members.shape[1] == MAX_MEMBERS
    block_m = max(16, triton.next_power_of_2(MAX_MEMBERS * group))
    _shared_prefix_kernel[(num_kv_heads * prefix[0], batch)](
        q, k_cache, v_cache, planes, block_tables, context_lens, shared.length, shared.members,
        part, lse, batch, num_heads, scale_log2, k_cache.shape[2], prefix[1], own[0],
        lse.shape[2], *own,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:4], *v_cache.stride()[:4],
        block_tables.stride(0), shared.members.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        GROUP=group, MEMBERS=MAX_MEMBERS, BLOCK_M=block_m,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=dot_block_d(head_dim),
        DOT_DTYPE=dot[0], INPUT_PRECISION=dot[1], num_warps=num_warps, num_stages=num_stages,
    )
