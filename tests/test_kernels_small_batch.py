"""Small-batch decode kernels (kernels/small_batch.py) under TRITON_INTERPRET=1 vs their torch
references and float64 math. fp32: atol/rtol 1e-5. bf16 (one-row GEMV, RoPE): one bf16 step.

The interpreter's tl.dot on bf16 inputs is not faithful, so the several-row GEMV path is checked
here in fp32 (FMA products, blocks of up to 16 rows) and in bf16 (tl.dot) on the GPU by
`python -m rltlab.bench.gemv`. The interpreter
runs a grid's programs one after another, so it checks split-K's arithmetic and its order of
summation, not the memory ordering between programs on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rltlab.kernels import (  # noqa: E402
    rope_write_kv, rope_write_kv_ref, small_m_linear, small_m_linear_ref, triton_available,
)
from rltlab.kernels import small_batch  # noqa: E402
from rltlab.kernels.pdl import INTERPRETED  # noqa: E402
from rltlab.model.architecture import apply_rope, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE),
                                reason="needs a GPU or TRITON_INTERPRET=1 before import")
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=1.6e-2)


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


# (rows, tiles): None = the tuned default tiles; 17 and 37 rows take 2 and 3 row blocks.
SHAPES = [(1, None), (1, (8, 64, 4, 2)), (1, (16, 32, 2, 3)), (2, None), (2, (16, 32, 2, 2)),
          (5, (16, 64, 4, 3)), (5, (1, 64, 4, 2)), (16, None), (16, (1, 256, 4, 2)),
          (16, (8, 32, 4, 4)), (17, None), (37, (4, 64, 4, 2))]


@pytest.mark.parametrize("rows,tiles", SHAPES)
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_small_m_linear_matches_reference_fp32(rows, tiles, act):
    n, k = 40, 200   # neither a multiple of any tile: exercises the masks
    x = _randn(rows, 2 * k if act else k, seed=rows)
    w = _randn(n, k, seed=100 + rows) / k ** 0.5
    out = small_m_linear(x, w, act, tiles=tiles)
    torch.testing.assert_close(out, small_m_linear_ref(x, w, act), **FP32)
    xd = x.double()
    if act:
        xd = F.silu(xd[:, :k]) * xd[:, k:]
    torch.testing.assert_close(out.double(), xd @ w.double().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_small_m_linear_one_row_bf16(act):
    n, k = 48, 256
    x = _randn(1, 2 * k if act else k, seed=3, dtype=torch.bfloat16)
    w = (_randn(n, k, seed=4) / k ** 0.5).to(torch.bfloat16)
    out = small_m_linear(x, w, act, tiles=(8, 128, 4, 3))
    assert out.dtype == torch.bfloat16
    expected = small_m_linear_ref(x.float(), w.float(), act)   # fp32 math on the bf16 inputs
    torch.testing.assert_close(out.float(), expected, **BF16)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's bf16 tl.dot is not faithful")
@pytest.mark.parametrize("rows", [5, 16, 20, 37])
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_small_m_linear_rows_bf16_on_the_gpu(rows, act):
    """bf16 rows through tl.dot in 16-row blocks (20, 37: a partial last block) on a GPU."""
    n, k = 48, 256
    x = _randn(rows, 2 * k if act else k, seed=rows, dtype=torch.bfloat16)
    w = (_randn(n, k, seed=rows + 1) / k ** 0.5).to(torch.bfloat16)
    out = small_m_linear(x, w, act)
    expected = small_m_linear_ref(x.float(), w.float(), act)
    torch.testing.assert_close(out.float(), expected, **BF16)


def test_small_m_linear_rejects_bad_input():
    w = _randn(8, 16, seed=0)
    with pytest.raises(ValueError, match="1..64 rows"):
        small_m_linear(_randn(65, 16, seed=1), w)
    with pytest.raises(ValueError, match="needs 32"):
        small_m_linear(_randn(2, 16, seed=1), w, "silu_mul")
    with pytest.raises(ValueError, match="act must be"):
        small_m_linear(_randn(2, 16, seed=1), w, "gelu")
    with pytest.raises(ValueError, match="one dtype"):
        small_m_linear(_randn(2, 16, seed=1, dtype=torch.bfloat16), w)


# (N, K, one-row split-K tiles): N not a multiple of BLOCK_N, K not of BLOCK_K * SPLIT_K; the
# last case gives every split exactly one BLOCK_K tile.
SPLIT_K_CASES = [(36, 200, (8, 32, 4, 2, 2)), (36, 200, (16, 32, 2, 3, 3)),
                 (50, 300, (4, 64, 4, 2, 4)), (20, 64, (8, 16, 4, 2, 4))]


def _one_row_case(n, k, act, seed, dtype=torch.float32):
    x = _randn(1, 2 * k if act else k, seed=seed, dtype=dtype)
    w = (_randn(n, k, seed=seed + 1) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("n,k,tiles", SPLIT_K_CASES)
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_split_k_matches_reference_fp32(n, k, tiles, act):
    x, w = _one_row_case(n, k, act, seed=n + k)
    out = small_m_linear(x, w, act, tiles=tiles)
    torch.testing.assert_close(out, small_m_linear_ref(x, w, act), **FP32)
    xd = x.double()
    if act:
        xd = F.silu(xd[:, :k]) * xd[:, k:]
    torch.testing.assert_close(out.double(), xd @ w.double().T, **FP32)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_split_k_is_deterministic_and_leaves_counters_zero(act):
    x, w = _one_row_case(36, 200, act, seed=11)
    first = small_m_linear(x, w, act, tiles=(8, 32, 4, 2, 3))
    _, counters = small_batch.split_k_workspace(x.device)
    assert not counters.any()   # a following call or graph replay starts clean
    second = small_m_linear(x, w, act, tiles=(8, 32, 4, 2, 3))
    assert torch.equal(first, second)
    assert not counters.any()


@pytest.mark.skipif(not INTERPRETED, reason="bit-exact vs separate launches: interpreter only")
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_split_k_sums_the_splits_partials_in_order(act):
    """Split s covers K tiles [s T / S, (s + 1) T / S); its partial is the SPLIT_K = 1 product
    of that K slice, and the output is exactly partial 0 + partial 1 + ... in fp32."""
    n, k, block_k, splits = 36, 200, 32, 3
    x, w = _one_row_case(n, k, act, seed=12)
    out = small_m_linear(x, w, act, tiles=(8, block_k, 4, 2, splits))
    k_tiles = -(-k // block_k)
    expected = torch.zeros(1, n, device=DEVICE)
    for split in range(splits):
        begin = split * k_tiles // splits * block_k
        end = min((split + 1) * k_tiles // splits * block_k, k)
        x_slice = x[:, begin:end]
        if act:   # [gate | up] of the slice
            x_slice = torch.cat([x_slice, x[:, k + begin:k + end]], dim=1)
        expected += small_m_linear(x_slice.contiguous(), w[:, begin:end], act, (8, block_k, 4, 2))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_split_k_one_row_bf16(act):
    x, w = _one_row_case(48, 256, act, seed=3, dtype=torch.bfloat16)
    out = small_m_linear(x, w, act, tiles=(8, 32, 4, 3, 4))
    assert out.dtype == torch.bfloat16
    expected = small_m_linear_ref(x.float(), w.float(), act)   # fp32 math on the bf16 inputs
    torch.testing.assert_close(out.float(), expected, **BF16)


def test_split_k_rejects_bad_tiles_before_launching(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"launched with grid {grid}")

    monkeypatch.setattr(small_batch, "_small_m_linear_kernel", NoLaunch())
    x, w = _one_row_case(8, 64, None, seed=0)
    for tiles, message in [((8, 32, 4, 2, 0), "SPLIT_K must be >= 1"),
                           ((8, 32, 4, 2, 3), "SPLIT_K=3 leaves a split without a BLOCK_K tile"),
                           ((8, 32, 4), "tiles are"), ((8, 32, 4, 2, 2, 1), "tiles are")]:
        with pytest.raises(ValueError, match=message):
            small_m_linear(x, w, tiles=tiles)
    wide = _randn(1, 16, seed=2).expand(1 << 21, 16)   # N = 2^21 rows of one copy
    for rows, tiles in [(1, (1, 8, 4, 2, 2)),     # 2^21 column blocks > SPLIT_K_COUNTERS
                        (1, (64, 2, 4, 2, 8)),    # 8 x 2^21 partials > SPLIT_K_PARTIALS
                        (3, (256, 2, 4, 2, 2))]:  # 2 x 3 x 2^21 partials, likewise
        with pytest.raises(ValueError, match="exceeds the split-K workspace"):
            small_m_linear(_randn(rows, 16, seed=3), wide, tiles=tiles)


# (rows, N, K, split-K tiles) of several rows: one row block (2, 5, 16 rows) and several (20 and
# 37 rows: 2 and 3 blocks of 16, the last one ragged), N and K ragged against the tiles.
MULTI_ROW_SPLIT_K = [(2, 36, 200, (8, 32, 4, 2, 2)), (5, 50, 300, (4, 64, 4, 2, 4)),
                     (16, 36, 200, (8, 32, 4, 2, 3)), (20, 40, 160, (16, 32, 4, 2, 2)),
                     (37, 24, 96, (8, 16, 4, 2, 6))]


@pytest.mark.parametrize("rows,n,k,tiles", MULTI_ROW_SPLIT_K)
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_split_k_of_several_rows_matches_reference_fp32(rows, n, k, tiles, act):
    x = _randn(rows, 2 * k if act else k, seed=rows + n)
    w = _randn(n, k, seed=rows + n + 1) / k ** 0.5
    out = small_m_linear(x, w, act, tiles=tiles)
    torch.testing.assert_close(out, small_m_linear_ref(x, w, act), **FP32)
    assert torch.equal(small_m_linear(x, w, act, tiles=tiles), out)   # deterministic
    assert not small_batch.split_k_workspace(x.device)[1].any()   # counters back at zero


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's bf16 tl.dot is not faithful")
@pytest.mark.parametrize("rows", [5, 16, 37])
def test_split_k_of_several_rows_bf16(rows):
    x = _randn(rows, 2 * 256, seed=rows, dtype=torch.bfloat16)
    w = (_randn(48, 256, seed=rows + 1) / 16).to(torch.bfloat16)
    out = small_m_linear(x, w, "silu_mul", tiles=(16, 32, 4, 3, 4))
    assert out.dtype == torch.bfloat16
    expected = small_m_linear_ref(x.float(), w.float(), "silu_mul")
    torch.testing.assert_close(out.float(), expected, **BF16)


def _rope_case(dtype, head_dim=12, num_heads=4, num_kv_heads=2, seed=0):
    n, layers, planes, blocks, block_size = 5, 2, 3, 4, 4
    qkv = _randn(n, (num_heads + 2 * num_kv_heads) * head_dim, seed=seed, dtype=dtype)
    positions = torch.tensor([3, 9, 0, 14, 7], device=DEVICE)
    cos, sin = rope_cos_sin(positions, head_dim, 10000.0, dtype)
    plane_ids = torch.tensor([0, 2, 1, 0, 2], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([1, 5, -1, 15, 8], device=DEVICE)   # row 2 is padding
    cache = _randn(layers, 2, planes, blocks, block_size, num_kv_heads, head_dim, seed=seed + 1,
                   dtype=dtype)
    return qkv, cos, sin, cache, plane_ids, slots


@pytest.mark.parametrize("head_dim", [12, 16])
def test_rope_write_kv_matches_reference_fp32(head_dim):
    qkv, cos, sin, cache, planes, slots = _rope_case(torch.float32, head_dim)
    ref_cache = cache.clone()
    q = rope_write_kv(qkv, cos, sin, cache, 1, planes, slots, 4, 2, head_dim)
    q_ref = rope_write_kv_ref(qkv, cos, sin, ref_cache, 1, planes, slots, 4, 2, head_dim)
    torch.testing.assert_close(q, q_ref, **FP32)
    torch.testing.assert_close(cache, ref_cache, **FP32)
    # The reference itself against the model's RoPE, and the cache rows it should have written.
    k = qkv[:, 4 * head_dim: 6 * head_dim].view(-1, 2, head_dim)
    torch.testing.assert_close(q_ref, apply_rope(qkv[:, : 4 * head_dim].view(-1, 4, head_dim),
                                                 cos[:, None], sin[:, None]), **FP32)
    k_roped = apply_rope(k, cos[:, None], sin[:, None])
    for row in (0, 1, 3, 4):
        slot, plane = int(slots[row]), int(planes[row])
        torch.testing.assert_close(ref_cache[1, 0, plane, slot // 4, slot % 4], k_roped[row])
        torch.testing.assert_close(ref_cache[1, 1, plane, slot // 4, slot % 4],
                                   qkv[row, 6 * head_dim:].view(2, head_dim))


def test_rope_write_kv_k_out_holds_every_rows_roped_k():
    qkv, cos, sin, cache, planes, slots = _rope_case(torch.float32, 12, seed=5)
    assert (slots < 0).any()   # a padding row: no cache write, but k_out still gets its k
    ref_cache = cache.clone()
    k_out = _randn(qkv.shape[0], 2, 12, seed=9)
    k_ref = _randn(qkv.shape[0], 2, 12, seed=10)
    q = rope_write_kv(qkv, cos, sin, cache, 1, planes, slots, 4, 2, 12, k_out=k_out)
    q_ref = rope_write_kv_ref(qkv, cos, sin, ref_cache, 1, planes, slots, 4, 2, 12, k_out=k_ref)
    k_roped = apply_rope(qkv[:, 48:72].view(-1, 2, 12), cos[:, None], sin[:, None])
    torch.testing.assert_close(k_out, k_roped, **FP32)
    torch.testing.assert_close(k_ref, k_roped, **FP32)
    torch.testing.assert_close(q, q_ref, **FP32)
    torch.testing.assert_close(cache, ref_cache, **FP32)
    with pytest.raises(ValueError, match="k_out"):
        rope_write_kv(qkv, cos, sin, cache, 1, planes, slots, 4, 2, 12, k_out=k_out[:, :1])


def test_rope_write_kv_padding_row_and_other_layers_untouched():
    qkv, cos, sin, cache, planes, slots = _rope_case(torch.float32, seed=7)
    before = cache.clone()
    rope_write_kv(qkv, cos, sin, cache, 0, planes, slots, 4, 2, 12)
    assert torch.equal(cache[1], before[1])
    written = torch.zeros_like(cache[0, 0, :, :, :, 0, 0], dtype=torch.bool)
    for row in (0, 1, 3, 4):
        slot = int(slots[row])
        written[int(planes[row]), slot // 4, slot % 4] = True
    assert torch.equal(cache[0, :, ~written], before[0, :, ~written])
    assert not torch.equal(cache[0, :, written], before[0, :, written])


def test_rope_write_kv_bf16():
    qkv, cos, sin, cache, planes, slots = _rope_case(torch.bfloat16, head_dim=16, seed=3)
    ref_cache = cache.clone()
    q = rope_write_kv(qkv, cos, sin, cache, 1, planes, slots, 4, 2, 16)
    q_ref = rope_write_kv_ref(qkv, cos, sin, ref_cache, 1, planes, slots, 4, 2, 16)
    torch.testing.assert_close(q.float(), q_ref.float(), **BF16)
    torch.testing.assert_close(cache.float(), ref_cache.float(), **BF16)


def test_rope_write_kv_rejects_bad_shapes():
    qkv, cos, sin, cache, planes, slots = _rope_case(torch.float32)
    with pytest.raises(ValueError, match="not \\[N"):
        rope_write_kv(qkv[:, :-1], cos, sin, cache, 1, planes, slots, 4, 2, 12)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_write_kv(qkv, cos[:3], sin[:3], cache, 1, planes, slots, 4, 2, 12)


def test_tiles_for_takes_the_smallest_row_tier_with_an_entry():
    """fp32 rounds of 2..64 rows take a shape's ("few_rows_fma", N, K, T) entry of the smallest
    tier T >= rows that has one, else the shape's entry without a tier; one row, other shapes
    and bf16 rows do not."""
    tiles, tiles_for = small_batch.TILES, small_batch.tiles_for
    for rows in (2, 5, 8):
        assert tiles_for(rows, 1152, 384, fma=True) == tiles["few_rows_fma", 1152, 384, 8]
        assert tiles_for(rows, 384, 384, fma=True) == tiles["few_rows_fma", 384, 384, 8]
        assert tiles_for(rows, 384, 1024, fma=True) == tiles["few_rows_fma", 384, 1024, 16]
        assert tiles_for(rows, 2048, 384, fma=True) == tiles["few_rows_fma", 2048, 384]
    for rows in (9, 16):
        assert tiles_for(rows, 1152, 384, fma=True) == tiles["few_rows_fma", 1152, 384, 16]
        assert tiles_for(rows, 384, 384, fma=True) == tiles["few_rows_fma"]
    assert tiles_for(17, 1152, 384, fma=True) == tiles["few_rows_fma", 1152, 384]
    assert tiles_for(17, 384, 1024, fma=True) == tiles["few_rows_fma", 384, 1024]
    assert tiles_for(1, 1152, 384, fma=True) == tiles["one_row"]
    assert tiles_for(5, 1152, 384) == tiles["few_rows"]
