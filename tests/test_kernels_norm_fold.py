"""small_m_linear(..., then_add_rmsnorm=...) under TRITON_INTERPRET=1: the launch's last program
runs the sandwich step on the product (kernels/small_batch.py). Against the two launches it
replaces (small_m_linear, then add_rmsnorm): bit-identical in the interpreter; against the torch
references: fp32 atol/rtol 1e-5, bf16 one step. The interpreter runs programs one after
another, so this checks the arrival count and the counter's reset, not memory ordering on a GPU
(that is the H200 runs' one-row exactness check, docs/benchmarks/)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import (add_rmsnorm, add_rmsnorm_ref, small_m_linear,  # noqa: E402
                            small_m_linear_ref, triton_available)
from rltlab.kernels import small_batch  # noqa: E402
from rltlab.kernels.pdl import INTERPRETED  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE),
                                reason="needs a GPU or TRITON_INTERPRET=1 before import")
FP32 = dict(atol=1e-5, rtol=1e-5)
EPS = 1e-6


def _case(rows, n, k, act, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)

    x = rand(rows, 2 * k if act else k)
    w = rand(n, k, scale=k ** -0.5)
    h = rand(rows, n)
    return x, w, (h, rand(n, scale=0.1, shift=1.0), rand(n, scale=0.1, shift=1.0), EPS)


# (rows, N, K, tiles): split-K and not, N not a multiple of BLOCK_N, 2..16 rows (tl.dot).
CASES = [(1, 40, 200, (8, 32, 4, 2, 3)), (1, 40, 200, (8, 64, 4, 2)),
         (1, 36, 100, (4, 32, 4, 2, 2)), (3, 40, 200, (16, 32, 2, 2)), (16, 24, 64, None)]


@pytest.mark.parametrize("rows,n,k,tiles", CASES)
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_folded_norm_matches_reference_fp32(rows, n, k, tiles, act):
    x, w, norm = _case(rows, n, k, act, seed=rows + n + k)
    h_new, y = small_m_linear(x, w, act, tiles, then_add_rmsnorm=norm)
    h_ref, y_ref = add_rmsnorm_ref(norm[0], small_m_linear_ref(x, w, act), *norm[1:])
    torch.testing.assert_close(h_new, h_ref, **FP32)
    torch.testing.assert_close(y, y_ref, **FP32)


@pytest.mark.skipif(not INTERPRETED, reason="bit-exact vs separate launches: interpreter only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [(8, 32, 4, 2, 3), (8, 64, 4, 2)])
def test_folded_norm_is_the_two_launches_it_replaces(dtype, tiles):
    x, w, norm = _case(1, 40, 200, "silu_mul", seed=5, dtype=dtype)
    folded = small_m_linear(x, w, "silu_mul", tiles, then_add_rmsnorm=norm)
    separate = add_rmsnorm(norm[0], small_m_linear(x, w, "silu_mul", tiles), *norm[1:])
    assert all(torch.equal(a, b) for a, b in zip(folded, separate))


def test_folded_norm_one_row_bf16():
    x, w, norm = _case(1, 48, 256, None, seed=3, dtype=torch.bfloat16)
    h_new, y = small_m_linear(x, w, None, (8, 32, 4, 3, 4), then_add_rmsnorm=norm)
    assert h_new.dtype == y.dtype == torch.bfloat16
    h_ref, y_ref = add_rmsnorm_ref(norm[0], small_m_linear_ref(x, w), *norm[1:])
    step = dict(atol=2e-2, rtol=1.6e-2)   # one bf16 step
    torch.testing.assert_close(h_new.float(), h_ref.float(), **step)
    torch.testing.assert_close(y.float(), y_ref.float(), **step)


def test_consecutive_folds_each_normalize_and_leave_the_counter_zero():
    """The last program resets the arrival counter: the next launch (or graph replay) counts
    from zero, so its last program normalizes too."""
    _, counters = small_batch.split_k_workspace(DEVICE)
    for seed, tiles in [(1, (8, 64, 4, 2)), (2, (8, 32, 4, 2, 3)), (3, (8, 64, 4, 2))]:
        x, w, norm = _case(1, 40, 200, None, seed=seed)
        h_new, y = small_m_linear(x, w, None, tiles, then_add_rmsnorm=norm)
        h_ref, y_ref = add_rmsnorm_ref(norm[0], small_m_linear_ref(x, w), *norm[1:])
        torch.testing.assert_close(y, y_ref, **FP32)
        torch.testing.assert_close(h_new, h_ref, **FP32)
        assert not counters.any()


def test_folded_norm_rejects_bad_input_before_launching(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"launched with grid {grid}")

    monkeypatch.setattr(small_batch, "_small_m_linear_kernel", NoLaunch())
    x, w, (h, w_post, w_next, eps) = _case(2, 40, 200, None, seed=0)
    for bad, message in [((h[:1], w_post, w_next, eps), "needs h \\[2, 40\\]"),
                         ((h, w_post[:39], w_next, eps), "weights \\[40\\]"),
                         ((h.double(), w_post, w_next, eps), "x's dtype"),
                         ((h, w_post, torch.stack([w_next, w_next], 1)[:, 0], eps),
                          "contiguous")]:
        with pytest.raises(ValueError, match=message):
            small_m_linear(x, w, then_add_rmsnorm=bad)
