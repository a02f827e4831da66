"""kernels.silu_mul (Triton, under TRITON_INTERPRET=1 on CPU) vs its torch reference vs float64.
Tolerances: fp32 1e-6 relative; bf16 one bf16 step (the interpreter rounds toward zero)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from rltlab.kernels import silu_mul, silu_mul_ref, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="no GPU and no interpreter")


@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 1000), (3, 2816)])
def test_silu_mul_matches_reference_and_float64(rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    # a strided view (rows of a wider buffer), values over SiLU's whole range
    wide = (torch.randn(rows, 2 * inter + 6, generator=gen) * 4).to(DEVICE)
    gate_up = wide[:, 3: 3 + 2 * inter]
    got = silu_mul(gate_up)
    torch.testing.assert_close(got, silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), g / (1 + torch.exp(-g)) * u, rtol=1e-6, atol=1e-6)


def test_silu_mul_bf16_within_one_rounding_step():
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(4, 2 * 640, generator=gen) * 3).to(DEVICE).bfloat16()
    got, want = silu_mul(gate_up), silu_mul_ref(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(4, 7), (2, 3, 8)])
def test_silu_mul_rejects_odd_or_non_2d_input(shape):
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul(torch.randn(*shape, device=DEVICE))
