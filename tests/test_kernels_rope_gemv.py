"""The q/k/v GEMV with RoPE and the K/V write in its epilogue (kernels/rope_gemv.py) under
TRITON_INTERPRET=1, against its torch reference (the unfused GEMV + rope_write_kv references) and
the model's RoPE: one row, and several rows with their own positions, planes and slots. fp32:
atol/rtol 1e-5. bf16: one bf16 step."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import rope_kv_linear, rope_kv_linear_ref, triton_available  # noqa: E402
from rltlab.model.architecture import apply_rope, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE),
                                reason="needs a GPU or TRITON_INTERPRET=1 before import")
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=1.6e-2)
HEADS, KV_HEADS, BLOCK_SIZE = 4, 2, 4


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _case(head_dim, *, slot=9, plane=2, position=13, k=72, dtype=torch.float32, seed=0):
    """One row: x [1, K] (K not a multiple of the tiles' BLOCK_K), w_qkv, RoPE at `position`,
    and a random cache of 2 layers x 3 planes x 4 blocks."""
    x = _randn(1, k, seed=seed, dtype=dtype)
    w = (_randn((HEADS + 2 * KV_HEADS) * head_dim, k, seed=seed + 1) / k ** 0.5).to(dtype)
    cos, sin = rope_cos_sin(torch.tensor([position], device=DEVICE), head_dim, 10000.0, dtype)
    cache = _randn(2, 2, 3, 4, BLOCK_SIZE, KV_HEADS, head_dim, seed=seed + 2, dtype=dtype)
    planes = torch.tensor([plane], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([slot], device=DEVICE)
    return x, w, cos, sin, cache, planes, slots


# (head_dim, tiles): the default one-row tiles (BLOCK_N 4: 2 pairs per program, BLOCK_K 1024),
# 4 pairs with two K tiles, and 1 pair of a head_dim whose half (6) is no power of two.
CASES = [(16, None), (16, (8, 32, 4, 2)), (12, (2, 64, 2, 2)), (12, None)]


@pytest.mark.parametrize("head_dim,tiles", CASES)
def test_matches_reference_and_the_models_rope_fp32(head_dim, tiles):
    x, w, cos, sin, cache, planes, slots = _case(head_dim)
    ref_cache = cache.clone()
    q = rope_kv_linear(x, w, cos, sin, cache, 1, planes, slots, HEADS, KV_HEADS, head_dim,
                       tiles=tiles)
    q_ref = rope_kv_linear_ref(x, w, cos, sin, ref_cache, 1, planes, slots, HEADS, KV_HEADS,
                               head_dim)
    torch.testing.assert_close(q, q_ref, **FP32)
    torch.testing.assert_close(cache, ref_cache, **FP32)
    # Against float64 math and the model's RoPE: what the cache slot and q must hold.
    qkv = (x.double() @ w.double().T).float()[0]
    k_end = (HEADS + KV_HEADS) * head_dim
    c, s = cos[:, None], sin[:, None]
    torch.testing.assert_close(
        q, apply_rope(qkv[: HEADS * head_dim].view(1, HEADS, head_dim), c, s), **FP32)
    torch.testing.assert_close(
        cache[1, 0, 2, 9 // BLOCK_SIZE, 9 % BLOCK_SIZE],
        apply_rope(qkv[HEADS * head_dim: k_end].view(1, KV_HEADS, head_dim), c, s)[0], **FP32)
    torch.testing.assert_close(cache[1, 1, 2, 9 // BLOCK_SIZE, 9 % BLOCK_SIZE],
                               qkv[k_end:].view(KV_HEADS, head_dim), **FP32)


def test_writes_only_its_slot_and_a_padding_row_writes_nothing():
    x, w, cos, sin, cache, planes, slots = _case(16, seed=3)
    before = cache.clone()
    rope_kv_linear(x, w, cos, sin, cache, 0, planes, slots, HEADS, KV_HEADS, 16)
    written = torch.zeros(3, 4, BLOCK_SIZE, dtype=torch.bool)
    written[2, 9 // BLOCK_SIZE, 9 % BLOCK_SIZE] = True
    written = written.to(DEVICE)
    assert torch.equal(cache[1], before[1])
    assert torch.equal(cache[0][:, ~written], before[0][:, ~written])
    assert not torch.equal(cache[0][:, written], before[0][:, written])
    padding = torch.tensor([-1], device=DEVICE)
    before = cache.clone()
    q = rope_kv_linear(x, w, cos, sin, cache, 0, planes, padding, HEADS, KV_HEADS, 16)
    assert torch.equal(cache, before)
    q_ref = rope_kv_linear_ref(x, w, cos, sin, before.clone(), 0, planes, padding, HEADS,
                               KV_HEADS, 16)
    torch.testing.assert_close(q, q_ref, **FP32)


def test_bf16_within_one_step():
    x, w, cos, sin, cache, planes, slots = _case(16, k=256, dtype=torch.bfloat16, seed=5)
    ref_cache = cache.clone()
    q = rope_kv_linear(x, w, cos, sin, cache, 1, planes, slots, HEADS, KV_HEADS, 16)
    q_ref = rope_kv_linear_ref(x, w, cos, sin, ref_cache, 1, planes, slots, HEADS, KV_HEADS, 16)
    torch.testing.assert_close(q.float(), q_ref.float(), **BF16)
    torch.testing.assert_close(cache.float(), ref_cache.float(), **BF16)


def test_bad_input_is_refused_before_anything_is_written():
    x, w, cos, sin, cache, planes, slots = _case(12, seed=7)
    before = cache.clone()
    bad = {
        "1..64 rows": dict(x=x.expand(65, -1).contiguous()),
        "cos/sin must": dict(x=x.expand(2, -1).contiguous()),    # one row's cos/sin
        "rows, not": dict(w=w[:-1]),
        "cos/sin": dict(cos=cos[:, :-1]),
        "KV heads": dict(kv_heads=1, w=w[: (HEADS + 2) * 12]),   # the cache has 2
        "one entry": dict(slots=torch.tensor([1, 2], device=DEVICE)),
        "power of two": dict(tiles=(8, 64, 4, 2)),       # 4 pairs do not divide 12 / 2
        "split-K": dict(tiles=(4, 64, 4, 2, 2)),
    }
    for message, override in bad.items():
        args = dict(x=x, w=w, cos=cos, sin=sin, slots=slots, kv_heads=KV_HEADS, tiles=None)
        args.update(override)
        with pytest.raises(ValueError, match=message):
            rope_kv_linear(args["x"], args["w"], args["cos"], sin, cache, 1, planes,
                           args["slots"], HEADS, args["kv_heads"], 12, tiles=args["tiles"])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("rows,tiles", [(2, None), (5, None), (5, (16, 64, 4, 2)),
                                        (16, (4, 32, 4, 2)), (16, (2, 128, 4, 2)), (21, None),
                                        (37, (8, 32, 4, 2))])
def test_rows_each_at_their_own_position_plane_and_slot_fp32(rows, tiles):
    """Rows in one or more blocks (21, 37: partial last block), a padding row (slot -1), K not a
    multiple of BLOCK_K: q and the cache equal the reference, and row m's own RoPE."""
    head_dim, k = 16, 72
    x = _randn(rows, k, seed=rows)
    w = _randn((HEADS + 2 * KV_HEADS) * head_dim, k, seed=rows + 1) / k ** 0.5
    positions = torch.randperm(60, generator=torch.Generator().manual_seed(rows))[:rows]
    cos, sin = rope_cos_sin(positions.to(DEVICE), head_dim, 10000.0, torch.float32)
    cache = _randn(2, 2, 3, 12, BLOCK_SIZE, KV_HEADS, head_dim, seed=rows + 2)
    planes = torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(rows),
                           dtype=torch.int32).to(DEVICE)
    slots = torch.randperm(12 * BLOCK_SIZE, generator=torch.Generator().manual_seed(rows + 3))
    slots = slots[:rows].to(DEVICE)
    slots[rows // 2] = -1
    ref_cache = cache.clone()
    q = rope_kv_linear(x, w, cos, sin, cache, 1, planes, slots, HEADS, KV_HEADS, head_dim,
                       tiles=tiles)
    q_ref = rope_kv_linear_ref(x, w, cos, sin, ref_cache, 1, planes, slots, HEADS, KV_HEADS,
                               head_dim)
    torch.testing.assert_close(q, q_ref, **FP32)
    torch.testing.assert_close(cache, ref_cache, **FP32)
    assert not torch.equal(cache, _randn(2, 2, 3, 12, BLOCK_SIZE, KV_HEADS, head_dim,
                                         seed=rows + 2))          # rows were written
    qkv = (x.double() @ w.double().T).float()
    torch.testing.assert_close(
        q, apply_rope(qkv[:, : HEADS * head_dim].view(rows, HEADS, head_dim), cos[:, None],
                      sin[:, None]), **FP32)
