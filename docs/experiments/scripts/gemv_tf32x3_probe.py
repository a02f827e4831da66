"""Probe (sixteenth session): can tensor cores make fp32 matmuls of 5-37 rows cheaper than the
FMA rows of kernels/small_batch.py without giving up fp32 accuracy? tl.dot with
input_precision="tf32x3" splits each fp32 operand into a TF32 high and low part and sums three
TF32 MMAs: ~fp32 accuracy on tensor cores. Single-pass "tf32" is timed beside it for speed only
(its 10-bit mantissa would change the engine's greedy tokens).

For the embedded model's four matmuls (q/k/v, o, gate/up, down; SiLU * up left out) with one
weight copy per layer, at each row count: per shape the best tiles of a small sweep (a graph of
the L layers' launches), then one round's 4 x L matmuls in one CUDA graph for cuBLAS, the FMA
rows (small_m_linear, its TILES) and the best tf32x3 / tf32 tiles; max abs error of each
against float64. A probe: nothing in the library uses this kernel. Last line: JSON.

    python docs/experiments/scripts/gemv_tf32x3_probe.py --rows 5 16 37
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rltlab.bench.gemv import graph_ms
from rltlab.kernels import small_m_linear
from rltlab.model.config import OuroConfig


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :],
                    mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :],
                    mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def dot_linear(x, w, precision, tiles):
    block_m, block_n, block_k, warps, stages = tiles
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _dot_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, out, m, n, k, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


TILES = [(bm, bn, bk, 4, 3) for bm, bn, bk in itertools.product((16, 32), (16, 32), (32, 64))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="artifacts/ouro-tiny/config.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 16, 37])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    cfg = OuroConfig.from_json_file(args.config)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h),
              "o": (h, cfg.num_attention_heads * d), "gate_up": (2 * cfg.intermediate_size, h),
              "down": (h, cfg.intermediate_size)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = cfg.num_hidden_layers
    weights = {name: [torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
                      for _ in range(layers)] for name, (n, k) in shapes.items()}
    result = {"config": args.config, "device": torch.cuda.get_device_name(), "rows": {}}
    for m in args.rows:
        xs = {name: torch.randn(m, k, device="cuda", generator=gen)
              for name, (n, k) in shapes.items()}
        best = {}
        for precision in ("tf32x3", "tf32"):
            for name in shapes:
                timed = {}
                for tiles in TILES:
                    try:
                        timed[tiles] = graph_ms(lambda: [dot_linear(xs[name], w, precision, tiles)
                                                         for w in weights[name]], args.repeats)
                    except Exception as err:   # a tile shape the compiler refuses
                        print(f"skip {precision} {name} {tiles}: {repr(err)[:80]}")
                best[precision, name] = min(timed, key=timed.get)
        paths = {"cublas": lambda x, w, name: F.linear(x, w),
                 "fma_rows": lambda x, w, name: small_m_linear(x, w),
                 **{p: (lambda x, w, name, p=p: dot_linear(x, w, p, best[p, name]))
                    for p in ("tf32x3", "tf32")}}
        row = {"tiles": {f"{p} {n}": best[p, n] for p, n in best}}
        for label, fn in paths.items():
            row[f"{label}_ms"] = round(graph_ms(lambda: [fn(xs[name], w, name) for name in shapes
                                                         for w in weights[name]], args.repeats), 4)
            row[f"{label}_max_abs_err"] = max(
                float((fn(xs[name], weights[name][0], name).double()
                       - xs[name].double() @ weights[name][0].double().T).abs().max())
                for name in shapes)
        result["rows"][m] = row
        print(f"rows={m}: {json.dumps(row)}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
