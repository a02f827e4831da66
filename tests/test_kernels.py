"""Kernels: Triton (under TRITON_INTERPRET=1 on CPU) vs torch reference vs naive float64 loops.

Run: TRITON_INTERPRET=1 pytest tests/test_kernels.py (this module sets it by default).
"""

import os

# triton.jit chooses interpreter vs compiler when a kernel is defined, so set this before import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import (  # noqa: E402
    add_rmsnorm, add_rmsnorm_ref, last_exited_copy, last_exited_copy_ref,
    paged_decode_attention, paged_decode_attention_ref, paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_ref, rmsnorm, rmsnorm_ref, triton_available, write_kv, write_kv_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_available(DEVICE),
    reason="no GPU, and rltlab.kernels was imported before TRITON_INTERPRET=1 was set",
)
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=1.6e-2)
# The interpreter rounds fp32 -> bf16 toward zero (GPUs and torch round to nearest even), so each
# of add_rmsnorm's rounding points may land one bf16 step away; at |branch| in [4, 8) that is
# 2**-5, which survives the residual add even where h + branch cancels to a small value.
NORM_BF16 = dict(atol=4e-2, rtol=1.6e-2)


def make_kv(layers, planes, blocks, block_size, heads, dim, dtype=torch.float32, transposed=False,
            seed=0):
    """Random kv_cache [L, 2, P, NB, BS, H, D]; transposed=True gives a non-contiguous view whose
    block_size and head dims are swapped in memory."""
    g = torch.Generator().manual_seed(seed)
    shape = (layers, 2, planes, blocks, heads, block_size, dim) if transposed else \
        (layers, 2, planes, blocks, block_size, heads, dim)
    kv = torch.randn(shape, generator=g).to(dtype)
    return (kv.transpose(4, 5) if transposed else kv).to(DEVICE)


def shuffled_block_tables(rows, max_blocks, num_blocks, seed=0):
    """Each row gets distinct, randomly ordered physical blocks (rows may share blocks)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(rows)]
                       ).to(torch.int32).to(DEVICE)


def naive_attention(q, k_cache, v_cache, plane, block_table, num_keys, scale):
    """One query row [Hq, D] over keys 0..num_keys-1, gathered one by one, softmax in float64."""
    block_size = k_cache.shape[2]
    pages = [int(block_table[pos // block_size]) for pos in range(num_keys)]
    keys = torch.stack([k_cache[plane, pages[p], p % block_size] for p in range(num_keys)]).double()
    vals = torch.stack([v_cache[plane, pages[p], p % block_size] for p in range(num_keys)]).double()
    group = q.shape[0] // k_cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        scores = keys[:, h // group] @ q[h].double() * scale
        weights = torch.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ vals[:, h // group]
    return out


# (Hq, Hkv, D, block_size, context_lens, planes); context lengths cross block boundaries.
DECODE_CASES = [
    (4, 2, 32, 4, [1, 7, 13, 33], [0, 2, 1, 2]),   # GQA group 2
    (2, 2, 32, 8, [9, 16, 40], [1, 0, 2]),          # MHA (Ouro), bigger blocks
    (6, 2, 24, 5, [23, 3], [2, 1]),                 # group 3, head_dim and block size not pow2
    (4, 2, 8, 4, [11, 2], [1, 2]),                  # head_dim 8: padded to tl.dot's K of 16
]


@pytest.mark.parametrize("hq,hkv,dim,block_size,ctx,planes", DECODE_CASES)
def test_decode_ref_matches_naive(hq, hkv, dim, block_size, ctx, planes):
    k_cache, v_cache = make_kv(1, 3, 24, block_size, hkv, dim)[0]
    bt = shuffled_block_tables(len(ctx), 9, 24)
    q = torch.randn(len(ctx), hq, dim, device=DEVICE)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    planes_t = torch.tensor(planes, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_ref(q, k_cache, v_cache, planes_t, bt, ctx_t, 0.2)
    for b in range(len(ctx)):
        expected = naive_attention(q[b].cpu(), k_cache.cpu(), v_cache.cpu(), planes[b], bt[b],
                                   ctx[b], 0.2)
        torch.testing.assert_close(out[b].cpu().double(), expected, **FP32)


@pytest.mark.parametrize("max_elements", [1 << 24, 1])
@pytest.mark.parametrize("hq,hkv,dim,block_size,ctx,planes", DECODE_CASES)
def test_decode_batched_torch_matches_ref(hq, hkv, dim, block_size, ctx, planes, max_elements):
    """The CPU engine's batched decode attention against the per-row reference: keys of all rows
    gathered together and masked past each row's context; block-table entries past a row's
    blocks hold out-of-range garbage; max_elements 1 runs one row per group. fp32, 1e-5."""
    kv = make_kv(2, 3, 24, block_size, hkv, dim, transposed=(dim == 24), seed=3)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    bt = shuffled_block_tables(len(ctx), 9, 24, seed=4)
    for row, n in enumerate(ctx):   # past the row's last block: anything, even out of range
        bt[row, -(-n // block_size):] = 10_000 * (row + 1)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(ctx), hq, dim, generator=gen).to(DEVICE)
    args = (q, k_cache, v_cache, torch.tensor(planes, dtype=torch.int32, device=DEVICE), bt,
            torch.tensor(ctx, dtype=torch.int32, device=DEVICE), dim ** -0.5)
    want = paged_decode_attention_ref(*args)
    torch.testing.assert_close(paged_decode_attention_torch(*args, max_elements=max_elements),
                               want, **FP32)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hq,hkv,dim,block_size,ctx,planes", DECODE_CASES)
def test_decode_triton_matches_ref(hq, hkv, dim, block_size, ctx, planes, num_splits):
    # Non-contiguous cache view on the last case: strides must be honoured.
    kv = make_kv(2, 3, 24, block_size, hkv, dim, transposed=(dim == 24), seed=1)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    bt = shuffled_block_tables(len(ctx), 9, 24, seed=2)
    q = torch.randn(len(ctx), hq, dim, device=DEVICE)
    args = (q, k_cache, v_cache, torch.tensor(planes, dtype=torch.int32, device=DEVICE), bt,
            torch.tensor(ctx, dtype=torch.int32, device=DEVICE), dim ** -0.5)
    out = paged_decode_attention(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **FP32)


@needs_triton
def test_decode_triton_bf16_default_tiling():
    kv = make_kv(1, 4, 16, 8, 2, 32, dtype=torch.bfloat16, seed=3)
    bt = shuffled_block_tables(3, 8, 16, seed=4)
    q = torch.randn(3, 4, 32, device=DEVICE).to(torch.bfloat16)
    args = (q, kv[0, 0], kv[0, 1], torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE), bt,
            torch.tensor([64, 5, 30], dtype=torch.int32, device=DEVICE), 32 ** -0.5)
    out = paged_decode_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), paged_decode_attention_ref(*args).float(), **BF16)


# (Hq, Hkv, D, block_size, start_pos, num_queries)
PREFILL_CASES = [(4, 2, 32, 4, 0, 21), (2, 2, 32, 8, 13, 19), (6, 2, 24, 5, 7, 9),
                 (4, 2, 8, 4, 3, 10)]


@pytest.mark.parametrize("hq,hkv,dim,block_size,start,num_q", PREFILL_CASES)
def test_prefill_ref_matches_naive_and_decode(hq, hkv, dim, block_size, start, num_q):
    k_cache, v_cache = make_kv(1, 3, 24, block_size, hkv, dim, seed=5)[0]
    bt = shuffled_block_tables(1, 9, 24, seed=6)[0]
    q = torch.randn(num_q, hq, dim, device=DEVICE)
    out = paged_prefill_attention_ref(q, k_cache, v_cache, 1, bt, start, 0.2)
    for i in range(num_q):
        expected = naive_attention(q[i].cpu(), k_cache.cpu(), v_cache.cpu(), 1, bt,
                                   start + i + 1, 0.2)
        torch.testing.assert_close(out[i].cpu().double(), expected, **FP32)
    # The chunk's last query is a decode step over start + num_q keys.
    last = paged_decode_attention_ref(
        q[-1:], k_cache, v_cache, torch.tensor([1], dtype=torch.int32, device=DEVICE), bt[None],
        torch.tensor([start + num_q], dtype=torch.int32, device=DEVICE), 0.2)
    torch.testing.assert_close(out[-1:], last, **FP32)


@needs_triton
@pytest.mark.parametrize("hq,hkv,dim,block_size,start,num_q", PREFILL_CASES)
def test_prefill_triton_matches_ref(hq, hkv, dim, block_size, start, num_q):
    kv = make_kv(1, 3, 24, block_size, hkv, dim, transposed=(dim == 24), seed=7)
    bt = shuffled_block_tables(1, 9, 24, seed=8)[0]
    q = torch.randn(num_q, hq, dim, device=DEVICE)
    args = (q, kv[0, 0], kv[0, 1], 2, bt, start, dim ** -0.5)
    out = paged_prefill_attention(*args, block_m=16, block_n=16)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), **FP32)


@needs_triton
def test_prefill_triton_bf16_default_tiling():
    kv = make_kv(1, 2, 16, 8, 2, 32, dtype=torch.bfloat16, seed=9)
    bt = shuffled_block_tables(1, 12, 16, seed=10)[0]
    q = torch.randn(70, 4, 32, device=DEVICE).to(torch.bfloat16)
    args = (q, kv[0, 0], kv[0, 1], 1, bt, 20, 32 ** -0.5)
    out = paged_prefill_attention(*args)
    torch.testing.assert_close(out.float(), paged_prefill_attention_ref(*args).float(), **BF16)


SENTINEL = 12345.0


def poisoned_kv_and_exits(dtype=torch.float32):
    """Cache whose non-exiting slots hold a sentinel; 5 exiting tokens plus one padding row."""
    kv = make_kv(3, 4, 6, 4, 2, 8, dtype=dtype, seed=11)
    slots = torch.tensor([5, 0, 17, 22, 9, -1], device=DEVICE)
    exit_planes = torch.tensor([0, 2, 1, 3, 0, 1], dtype=torch.int32, device=DEVICE)
    flat = kv.view(3, 2, 4, 24, 2, 8)
    others = torch.ones(24, dtype=torch.bool)
    others[slots[slots >= 0].cpu()] = False
    flat[:, :, :, others.to(DEVICE)] = SENTINEL
    return kv, slots, exit_planes, others


def naive_last_exited_copy(kv, slots, exit_planes):
    flat = kv.clone().view(kv.shape[0], 2, kv.shape[2], -1, *kv.shape[5:])
    for slot, exit_plane in zip(slots.tolist(), exit_planes.tolist()):
        if slot < 0:  # padding row
            continue
        for plane in range(exit_plane + 1, kv.shape[2]):
            flat[:, :, plane, slot] = flat[:, :, exit_plane, slot]
    return flat.view(kv.shape)


def test_last_exited_copy_ref_matches_naive():
    kv, slots, exit_planes, others = poisoned_kv_and_exits()
    expected = naive_last_exited_copy(kv, slots, exit_planes)
    before = kv.clone()
    last_exited_copy_ref(kv, slots, exit_planes)
    assert torch.equal(kv, expected)
    assert not torch.equal(kv, before)  # something was copied
    assert torch.equal(kv.view(3, 2, 4, 24, 2, 8)[:, :, :, others.to(DEVICE)],
                       before.view(3, 2, 4, 24, 2, 8)[:, :, :, others.to(DEVICE)])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_exited_copy_triton_matches_ref(dtype):
    kv, slots, exit_planes, others = poisoned_kv_and_exits(dtype)
    expected = kv.clone()
    last_exited_copy_ref(expected, slots, exit_planes)
    last_exited_copy(kv, slots, exit_planes)
    assert torch.equal(kv, expected)
    touched = kv.view(3, 2, 4, 24, 2, 8)[:, :, :, ~others.to(DEVICE)]
    assert not (touched == SENTINEL).any()  # nothing read from a poisoned slot


@pytest.mark.parametrize("per_row_planes", [False, True])
def test_write_kv(per_row_planes):
    kv = make_kv(2, 3, 5, 4, 2, 8, seed=12)
    slots = torch.tensor([3, -1, 12, 7], device=DEVICE)
    planes = torch.tensor([2, 0, 1, 0], dtype=torch.int32, device=DEVICE) if per_row_planes else 1
    k, v = torch.randn(2, 4, 2, 8, device=DEVICE)
    expected = kv.clone()
    for n, slot in enumerate(slots.tolist()):
        plane = int(planes[n]) if per_row_planes else planes
        if slot >= 0:
            expected[1, 0, plane, slot // 4, slot % 4] = k[n]
            expected[1, 1, plane, slot // 4, slot % 4] = v[n]
    ref = kv.clone()
    write_kv_ref(ref, 1, planes, slots, k, v)
    assert torch.equal(ref, expected)
    if triton_available(kv):
        write_kv(kv, 1, planes, slots, k, v)
        assert torch.equal(kv, expected)


def naive_rmsnorm(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("hidden", [64, 2047, 2048])
def test_norm_refs_match_naive(hidden):
    h, x = torch.randn(2, 3, hidden, device=DEVICE)
    w_post, w_next = torch.rand(2, hidden, device=DEVICE) + 0.5
    torch.testing.assert_close(rmsnorm_ref(x, w_post, 1e-6).double(),
                               naive_rmsnorm(x, w_post, 1e-6), **FP32)
    h_new, y = add_rmsnorm_ref(h, x, w_post, w_next, 1e-6)
    expected_h = h.double() + naive_rmsnorm(x, w_post, 1e-6)
    torch.testing.assert_close(h_new.double(), expected_h, **FP32)
    torch.testing.assert_close(y.double(), naive_rmsnorm(expected_h, w_next, 1e-6), **FP32)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, NORM_BF16)])
@pytest.mark.parametrize("hidden", [64, 2047, 2048])
def test_norm_triton_matches_ref(hidden, dtype, tol):
    # Row-strided views (a slice of wider rows) check that strides are honoured.
    h = torch.randn(3, hidden + 3, device=DEVICE).to(dtype)[:, :hidden]
    x = (torch.randn(3, hidden, device=DEVICE) * 3).to(dtype)
    w_post, w_next = (torch.rand(2, hidden, device=DEVICE) + 0.5).to(dtype)
    torch.testing.assert_close(rmsnorm(x, w_post, 1e-6), rmsnorm_ref(x, w_post, 1e-6), **tol)
    for got, want in zip(add_rmsnorm(h, x, w_post, w_next, 1e-6),
                         add_rmsnorm_ref(h, x, w_post, w_next, 1e-6)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
