"""RMSNorm and Ouro's fused "sandwich" residual step.

Ouro applies a second RMSNorm to each sublayer's output before the residual add, and the next
sublayer starts with its own RMSNorm. add_rmsnorm fuses both norms and the add into one pass:
    h_new = h + rmsnorm(x) * w_post
    y     = rmsnorm(h_new) * w_next
RMSNorm follows Hugging Face exactly: normalize in fp32, cast back to the input dtype, THEN
multiply by the weight (in bf16 the rounding order changes results). Inputs are 2-D [N, hidden].
"""

import torch
import triton
import triton.language as tl

from .pdl import await_previous_kernel, launch_options


def rmsnorm_ref(x, w, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * w


def add_rmsnorm_ref(h, x, w_post, w_next, eps):
    h_new = h + rmsnorm_ref(x, w_post, eps)
    return h_new, rmsnorm_ref(h_new, w_next, eps)


@triton.jit
def _normalize(x, hidden, eps):
    """fp32 value of the normalized row rounded to x's dtype (HF order: round, then weight)."""
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / hidden  # masked lanes were loaded as 0: they add nothing
    return (x32 * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, eps, hidden, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, _normalize(x, hidden, eps) * w, mask=mask)


@triton.jit
def _add_rmsnorm_kernel(
    h_ptr, x_ptr, w_post_ptr, w_next_ptr, h_out_ptr, y_ptr, eps, hidden,
    stride_h, stride_x, stride_h_out, stride_y, BLOCK: tl.constexpr, GDC: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # The weights are read before the wait (no kernel of a round writes them, pdl.py), so
    # their likely L2 misses overlap the previous kernel's tail; h and x only after it.
    w_post = tl.load(w_post_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w_next = tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    await_previous_kernel(GDC)
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    # Each torch op of the reference computes in fp32 and rounds to the tensor dtype; round at
    # the same points so bf16 results match it bit for bit (up to rsqrt / summation order).
    branch = (_normalize(x, hidden, eps) * w_post).to(h.dtype).to(tl.float32)
    h_new = (h.to(tl.float32) + branch).to(h.dtype)
    tl.store(h_out_ptr + row * stride_h_out + cols, h_new, mask=mask)
    tl.store(y_ptr + row * stride_y + cols, _normalize(h_new, hidden, eps) * w_next, mask=mask)


def _check_rows(*tensors):
    dtype = tensors[0].dtype
    assert all(t.dtype == dtype for t in tensors), "inputs and weights must share one dtype"
    assert all(t.stride(-1) == 1 for t in tensors), "hidden dim must be contiguous"


def rmsnorm(x, w, eps):
    """Triton version of rmsnorm_ref; x [N, hidden], w [hidden], same dtype."""
    _check_rows(x, w)
    y = torch.empty_like(x)
    hidden = x.shape[1]
    _rmsnorm_kernel[(x.shape[0],)](
        x, w, y, eps, hidden, x.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(hidden),
    )
    return y


def add_rmsnorm(h, x, w_post, w_next, eps, *, pdl=False, num_warps=None):
    """Triton version of add_rmsnorm_ref -> (h_new, y); all tensors share one dtype (pdl:
    kernels/pdl.py; num_warps: default 8 from hidden 2048 on, else 4)."""
    _check_rows(h, x, w_post, w_next)
    launch = launch_options(pdl, h.device)
    h_new, y = torch.empty_like(h), torch.empty_like(h)
    hidden = h.shape[1]
    _add_rmsnorm_kernel[(h.shape[0],)](
        h, x, w_post, w_next, h_new, y, eps, hidden,
        h.stride(0), x.stride(0), h_new.stride(0), y.stride(0),
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=num_warps or (8 if hidden >= 2048 else 4),
        # Without this the compiler fuses (normed * w_post) + h into one bf16 FMA, skipping the
        # rounding of the product that torch does: ~25% of h_new would differ by one bf16 step.
        enable_fp_fusion=False, **launch,
    )
    return h_new, y
