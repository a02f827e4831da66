"""Probe: does programmatic dependent launch (PDL) shorten a W1-shaped decode round?

A chain shaped like one Ouro-1.4B round at one row (24 layers; each: RMSNorm, q/k/v GEMV,
an attention stand-in, o GEMV, add + RMSNorm, gate/up GEMV, SiLU*up + down GEMV, residual add),
all Triton kernels, captured in one CUDA graph, timed with and without PDL. With PDL every kernel
lets its successor launch at once (gdc_launch_dependents) and waits for its predecessor
(gdc_wait) only before it touches activations; the GEMVs load their first weight tile before the
wait, so the weight stream starts while the previous kernel drains. Outputs must be bit-identical
(same arithmetic, only the launch order changes). Last line: JSON.
"""
import json
import statistics

import torch
import triton
import triton.language as tl

H, QKV, FF, L = 2048, 6144, 5632, 24


@triton.jit
def _gemv(x_ptr, w_ptr, o_ptr, N, K, SILU_MUL: tl.constexpr, GDC: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    w_next = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(ks < K)[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = w_next
        kk = k0 + ks
        nk = kk + BK
        w_next = tl.load(w_ptr + cols[:, None] * K + nk[None, :], mask=(nk < K)[None, :], other=0.0)
        if SILU_MUL:
            g = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + kk, mask=kk < K, other=0.0).to(tl.float32)
            x = g * tl.sigmoid(g) * u
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(o_ptr + cols, acc.to(o_ptr.dtype.element_ty))


@triton.jit
def _norm(x_ptr, r_ptr, w_ptr, o_ptr, N, ADD: tl.constexpr, GDC: tl.constexpr,
          B: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(r_ptr + i, mask=i < N, other=0.0).to(tl.float32)
        tl.store(r_ptr + i, x.to(r_ptr.dtype.element_ty), mask=i < N)
    y = x * tl.rsqrt(tl.sum(x * x) / N + 1e-6) * tl.load(w_ptr + i, mask=i < N).to(tl.float32)
    tl.store(o_ptr + i, y.to(o_ptr.dtype.element_ty), mask=i < N)


@triton.jit
def _attn_stand_in(qkv_ptr, o_ptr, N, GDC: tl.constexpr, B: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0) * B + tl.arange(0, B)
    q = tl.load(qkv_ptr + i).to(tl.float32)
    k = tl.load(qkv_ptr + N + i).to(tl.float32)
    v = tl.load(qkv_ptr + 2 * N + i).to(tl.float32)
    tl.store(o_ptr + i, (tl.sigmoid(q * k) * v).to(o_ptr.dtype.element_ty))


def round_fn(ws, bufs, gdc):
    x, res, qkv, att, gu, hid = bufs
    kw = dict(GDC=gdc, launch_pdl=gdc)
    for (wqkv, wo, wgu, wd, n1, n2) in ws:
        _norm[(1,)](x, res, n1, hid, H, ADD=True, B=H, **kw)
        _gemv[(QKV // 4,)](hid, wqkv, qkv, QKV, H, SILU_MUL=False, BN=4, BK=1024, num_warps=4, **kw)
        _attn_stand_in[(H // 256,)](qkv, att, H, B=256, **kw)
        _gemv[(H // 4,)](att, wo, x, H, H, SILU_MUL=False, BN=4, BK=1024, num_warps=8, **kw)
        _norm[(1,)](x, res, n2, hid, H, ADD=True, B=H, **kw)
        _gemv[(2 * FF // 4,)](hid, wgu, gu, 2 * FF, H, SILU_MUL=False, BN=4, BK=512, num_warps=2, **kw)
        _gemv[(H // 4,)](gu, wd, x, H, FF, SILU_MUL=True, BN=4, BK=1024, num_warps=8, **kw)


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ws = [(torch.randn(QKV, H, device=dev, dtype=dt) / 45, torch.randn(H, H, device=dev, dtype=dt) / 45,
           torch.randn(2 * FF, H, device=dev, dtype=dt) / 45, torch.randn(H, FF, device=dev, dtype=dt) / 75,
           1 + torch.rand(H, device=dev, dtype=dt) / 10, 1 + torch.rand(H, device=dev, dtype=dt) / 10)
          for _ in range(L)]
    weight_bytes = sum(t.numel() * 2 for w in ws for t in w[:4])
    x0 = torch.randn(H, device=dev, dtype=dt)
    results, outs = {}, {}
    for gdc in (False, True):
        bufs = [x0.clone(), torch.zeros(H, device=dev, dtype=dt), torch.empty(QKV, device=dev, dtype=dt),
                torch.empty(H, device=dev, dtype=dt), torch.empty(2 * FF, device=dev, dtype=dt),
                torch.empty(H, device=dev, dtype=dt)]
        start = [b.clone() for b in bufs]
        round_fn(ws, bufs, gdc)          # compile
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            round_fn(ws, bufs, gdc)
        for b, s in zip(bufs, start):
            b.copy_(s)
        g.replay()
        torch.cuda.synchronize()
        outs[gdc] = bufs[0].clone()
        times = []
        for _ in range(7):
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            for _ in range(50):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 50)
        ms = statistics.median(times)
        results["pdl" if gdc else "plain"] = {"ms_per_round": ms, "gb_s": weight_bytes / ms / 1e6}
        print(f"{'PDL' if gdc else 'no PDL'}: {ms:.3f} ms per round, {weight_bytes / ms / 1e6:.0f} GB/s")
    results["identical"] = bool(torch.equal(outs[False], outs[True]))
    results["speedup"] = results["plain"]["ms_per_round"] / results["pdl"]["ms_per_round"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
