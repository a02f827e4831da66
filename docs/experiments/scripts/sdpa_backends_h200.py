"""Issue 17 (prefill at >= 60% of the matmul rate, W3 at >= 80% of its ceiling): how fast is
each SDPA backend on the fused prefill's attention shapes? FlashAttention-2 ran at ~206 TFLOP/s
in a W3 prefill profile (docs/benchmarks/2026-12-02-h200.md), ~13% of a 1K-token prefill's
time. Per backend and shape (B prompts of S tokens from position 0, Ouro-1.4B heads, bf16,
causal): ms per call, TFLOP/s (causal: 2 * B * H * S^2 * D), and the largest difference from
the fp32 math backend. A shape's first call (where cuDNN builds its plan) is timed apart.
Last line: JSON.

    python docs/experiments/scripts/sdpa_backends_h200.py
"""
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
SHAPES = [(16, 1024), (1, 1024), (7, 1024), (128, 128), (16, 512)]   # (prompts, tokens)
HEADS, HEAD_DIM = 16, 128   # Ouro-1.4B: 16 query and 16 key/value heads of 128


def timed_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> dict:
    torch.manual_seed(0)
    results = []
    for b, s in SHAPES:
        q, k, v = (torch.randn(b, HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        flops = 2 * b * HEADS * s * s * HEAD_DIM   # QK^T and PV, half of them under the mask
        for name, backend in BACKENDS.items():
            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = call()
                torch.cuda.synchronize()
                first_ms = 1e3 * (time.perf_counter() - t0)
                ms = timed_ms(call)
            except RuntimeError as err:   # backend not available for this shape / build
                results.append({"backend": name, "prompts": b, "tokens": s,
                                "error": str(err)[:200]})
                continue
            row = {"backend": name, "prompts": b, "tokens": s, "first_call_ms": round(first_ms, 3),
                   "ms": round(ms, 4), "tflop_s": round(flops / ms / 1e9, 1),
                   "max_abs_diff_vs_fp32_math": float((out.float() - ref).abs().max())}
            results.append(row)
            print(json.dumps(row), flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}


if __name__ == "__main__":
    print(json.dumps(main()))
