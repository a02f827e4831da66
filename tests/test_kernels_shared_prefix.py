"""Shared-prefix decode attention (kernels/shared_prefix.py): the plan, and the Triton kernels
under TRITON_INTERPRET=1 against paged_decode_attention_ref on random groups of rows whose block
tables share their leading blocks."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import (  # noqa: E402
    MAX_MEMBERS, SharedPrefix, paged_decode_attention, paged_decode_attention_ref,
    shared_prefix_plan, triton_available,
)

needs_triton = pytest.mark.skipif(not triton_available("cpu"),
                                  reason="rltlab.kernels was imported before TRITON_INTERPRET=1")
FP32 = dict(atol=1e-5, rtol=1e-5)


def grouped_rows(group_sizes, prompt, lengths, block_size, max_blocks, num_blocks, seed=0):
    """Block tables [rows, max_blocks] int32: the rows of each group share the physical blocks of
    their first `prompt` positions' full blocks (as rltlab.engine.groups leaves them), and own
    the rest; plus each row's context length drawn from lengths."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    shared_blocks = prompt // block_size
    tables, ctx = [], []
    for size in group_sizes:
        common = [free.pop() for _ in range(shared_blocks)]
        for _ in range(size):
            tables.append(common + [free.pop() for _ in range(max_blocks - shared_blocks)])
            ctx.append(int(torch.randint(*lengths, (1,), generator=g)))
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)


def plan_for(planes, ctx, tables, block_size, rows=None):
    rows = rows or len(planes)
    start, length = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    members = np.full((rows, MAX_MEMBERS), -1, np.int32)
    groups = shared_prefix_plan(planes.numpy(), ctx.numpy(), tables.numpy(), block_size, start,
                                length, members)
    return groups, SharedPrefix(torch.from_numpy(start), torch.from_numpy(length),
                                torch.from_numpy(members))


def test_plan_groups_rows_by_plane_and_shared_blocks():
    tables, ctx = grouped_rows([3, 1, 2], prompt=40, lengths=(45, 60), block_size=8,
                               max_blocks=8, num_blocks=64)
    planes = torch.tensor([0, 0, 1, 0, 2, 2], dtype=torch.int32)   # row 2 reads another plane
    groups, plan = plan_for(planes, ctx, tables, 8)
    assert groups == 2   # rows (0, 1) and rows (4, 5); row 2 and row 3 stand alone
    # groups in slots 0, 1, ... in the order of their first rows
    assert plan.members[0, :3].tolist() == [0, 1, -1] and plan.members[1, :3].tolist() == [4, 5, -1]
    assert (plan.members[2:] == -1).all()
    assert plan.length.tolist() == [40, 40, 0, 0, 0, 0]
    assert plan.start.tolist() == [40, 40, 0, 0, 40, 40]


def test_plan_caps_the_shared_length_below_the_shortest_context():
    tables, _ = grouped_rows([2], prompt=32, lengths=(40, 41), block_size=8, max_blocks=6,
                             num_blocks=32)
    ctx = torch.tensor([20, 50], dtype=torch.int32)   # row 0 reads only 20 positions
    _, plan = plan_for(torch.zeros(2, dtype=torch.int32), ctx, tables, 8)
    assert plan.length[0] == 19 and plan.start.tolist() == [19, 19]


def test_plan_splits_groups_larger_than_max_members():
    n = MAX_MEMBERS + 3
    tables, ctx = grouped_rows([n], prompt=16, lengths=(20, 30), block_size=8, max_blocks=4,
                               num_blocks=64)
    groups, plan = plan_for(torch.zeros(n, dtype=torch.int32), ctx, tables, 8)
    assert groups == 2 and (plan.members[0] >= 0).sum() == MAX_MEMBERS
    assert plan.members[1, :4].tolist() == [MAX_MEMBERS, MAX_MEMBERS + 1, MAX_MEMBERS + 2, -1]


@needs_triton
@pytest.mark.parametrize("hq,hkv,block_size,prompt,num_splits,prefix_splits", [
    (4, 4, 8, 40, 1, 1), (4, 2, 16, 48, 3, 2), (6, 2, 8, 24, 2, 3), (4, 4, 8, 16, 1, 5)])
def test_shared_prefix_attention_matches_ref(hq, hkv, block_size, prompt, num_splits,
                                             prefix_splits):
    """Every row's attention, grouped or not, for any split of the shared range and of the
    rows' own keys: the group programs deal the members' own splits out among themselves
    (with 5 prefix splits over a 16-key prefix, some programs get only own keys)."""
    dim, planes_n, max_blocks = 32, 3, 10
    tables, ctx = grouped_rows([4, 1, 3, 2], prompt, (prompt + 1, max_blocks * block_size),
                               block_size, max_blocks, num_blocks=96, seed=hq + prompt)
    rows = len(ctx)
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, planes_n, 96, block_size, hkv, dim, generator=g)
    q = torch.randn(rows, hq, dim, generator=g)
    planes = torch.randint(0, planes_n, (rows,), generator=g, dtype=torch.int32)
    planes[:4] = 1    # the first group reads one plane; the others may be split by theirs
    groups, plan = plan_for(planes, ctx, tables, block_size)
    assert groups >= 1 and int((plan.start > 0).sum()) >= 4
    want = paged_decode_attention_ref(q, kv[0], kv[1], planes, tables, ctx, dim ** -0.5)
    got = paged_decode_attention(q, kv[0], kv[1], planes, tables, ctx, dim ** -0.5,
                                 num_splits=num_splits, block_n=16, shared=plan,
                                 num_prefix_splits=prefix_splits)
    torch.testing.assert_close(got, want, **FP32)


@needs_triton
@pytest.mark.parametrize("n", [2, 5])
def test_rows_past_the_launch_are_left_out_of_their_group(n):
    """A launch over the first n rows (a ragged round) must not read members beyond them: with
    n = 5 the second group (rows 4, 5) keeps one row in the launch."""
    block_size, dim = 8, 16
    tables, ctx = grouped_rows([4, 2], 32, (33, 60), block_size, 8, num_blocks=60)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 1, 60, block_size, 2, dim, generator=g)
    q = torch.randn(6, 2, dim, generator=g)
    planes = torch.zeros(6, dtype=torch.int32)
    _, plan = plan_for(planes, ctx, tables, block_size)
    want = paged_decode_attention_ref(q[:n], kv[0], kv[1], planes[:n], tables[:n], ctx[:n],
                                      dim ** -0.5)
    got = paged_decode_attention(q[:n], kv[0], kv[1], planes[:n], tables[:n], ctx[:n],
                                 dim ** -0.5, block_n=8, shared=plan.rows(n))
    torch.testing.assert_close(got, want, **FP32)
