"""Every Triton kernel compiles for an H100 / H200 (sm_90) on a machine without a GPU.

The other kernel tests run the kernels under Triton's interpreter, which accepts some programs
the compiler refuses (a `break`, types that change across branches). Here Triton's own compiler
and ptxas build each kernel for sm_90 at Ouro-1.4B's shapes in bf16, with the launch options and
constexprs its wrapper passes (the tiles it picks, programmatic dependent launch, L2 prefetch,
a shared-prefix plan). Pointers and strides are taken as divisible by 16, as a launch
specialises them. It runs in a subprocess: this process may have imported Triton in
interpreter mode."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from rltlab.kernels import (activation, fused_norm, greedy, kv_copy, paged_attention,
                                rope_gemv, shared_prefix, small_batch)

    HIDDEN, INTER, HEADS, DIM, VOCAB = 2048, 5632, 16, 128, 49152
    BF16 = {"x_ptr", "w_ptr", "q_ptr", "k_ptr", "v_ptr", "pf_ptr", "kv_ptr", "qkv_ptr",
            "cos_ptr", "sin_ptr", "k_out_ptr", "gu_ptr", "h_ptr", "w_post_ptr", "w_next_ptr",
            "h_out_ptr", "y_ptr", "logits_ptr"}
    FP32 = {"lse_ptr", "part_ptr", "partials_ptr", "qk_scale", "eps"}

    def build(kernel, num_warps=4, num_stages=3, fp_fusion=True, types=None, **constexprs):
        types = {**{n: "*bf16" for n in BF16}, **{n: "*fp32" for n in FP32},
                 "qk_scale": "fp32", "eps": "fp32", **(types or {})}
        signature = {name: "constexpr" if name in constexprs else
                     types.get(name, "*i32" if name.endswith("_ptr") else "i32")
                     for name in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if name not in constexprs
                   and (name.endswith("_ptr") or name.startswith("stride"))}
        triton.compile(ASTSource(kernel, signature, constexprs, aligned),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages,
                                "enable_fp_fusion": fp_fusion})
        print("compiled", kernel.__name__)

    # decode and prefill attention, the shared-prefix plan's kernel and the split merge
    tiles = dict(BLOCK_N=64, HEAD_DIM=DIM, BLOCK_D=DIM, DOT_DTYPE=tl.bfloat16,
                 INPUT_PRECISION="tf32")
    for has_start in (False, True):
        build(paged_attention._decode_kernel, 4, 2, GROUP=1, BLOCK_G=16, GDC=True,
              PREFETCH=True, PF_CHUNK=4096, PF_LANES=128, HAS_START=has_start, **tiles)
    build(shared_prefix._shared_prefix_kernel, 4, 2, GROUP=1, MEMBERS=16, BLOCK_M=16,
          BLOCK_G=16, **tiles)
    build(paged_attention._merge_splits_kernel, HEAD_DIM=DIM, BLOCK_D=DIM, BLOCK_S=4, GDC=True)
    build(paged_attention._prefill_kernel, 4, 2, GROUP=1, BLOCK_M=64, **tiles)

    # the few-row GEMVs at the tiles their wrapper picks, and the fused q/k/v + RoPE + K/V write
    slots = {"slots_ptr": "*i64"}
    for rows, n, k, act in ((1, HIDDEN, HIDDEN, None), (1, 2 * INTER, HIDDEN, None),
                            (1, HIDDEN, INTER, "silu_mul"), (16, HIDDEN, INTER, "silu_mul")):
        block_n, block_k, warps, stages, split = small_batch.check_tiles(
            small_batch.tiles_for(rows, n, k), rows, n, k)
        build(small_batch._small_m_linear_kernel, warps, stages, SILU_MUL=act == "silu_mul",
              BLOCK_M=small_batch.block_rows(rows, False), BLOCK_N=block_n, BLOCK_K=block_k,
              SPLIT_K=split, IEEE=False, GDC=True, PREFETCH=True, PF_CHUNK=4096, PF_LANES=128)
    pairs, block_k, warps, stages = rope_gemv.check_pairs(
        small_batch.tiles_for(1, 3 * HIDDEN, HIDDEN, fma=True), DIM)
    build(rope_gemv._rope_kv_linear_kernel, warps, stages, types=slots, NUM_HEADS=HEADS,
          NUM_KV_HEADS=HEADS, HEAD_DIM=DIM, PAIRS=pairs, BLOCK_M=1, BLOCK_K=block_k, GDC=True,
          PREFETCH=True, PF_CHUNK=4096, PF_LANES=128)
    build(small_batch._rope_write_kv_kernel, types=slots, NUM_HEADS=HEADS, NUM_KV_HEADS=HEADS,
          HEAD_DIM=DIM, BLOCK_H=HEADS, BLOCK_KV=HEADS, BLOCK_D=DIM, K_OUT=True, GDC=True)

    # norms, activation, greedy sampling, K/V copies
    build(fused_norm._rmsnorm_kernel, BLOCK=HIDDEN)
    build(fused_norm._add_rmsnorm_kernel, 8, fp_fusion=False, BLOCK=HIDDEN, GDC=True)
    build(activation._silu_mul_kernel, BLOCK=1024)
    build(greedy._greedy_kernel, 16, types={"tokens_ptr": "*i64", "finite_ptr": "*i8"},
          BLOCK=greedy.BLOCK, NO_INDEX=2 ** 31 - 1)
    build(kv_copy._last_exited_copy_kernel, types=slots, NUM_KV_HEADS=HEADS, HEAD_DIM=DIM,
          BLOCK_H=HEADS, BLOCK_D=DIM)
    build(kv_copy._write_kv_kernel, types=slots, NUM_KV_HEADS=HEADS, HEAD_DIM=DIM,
          BLOCK_H=HEADS, BLOCK_D=DIM)
""")

KERNELS = (["_decode_kernel"] * 2 + ["_shared_prefix_kernel", "_merge_splits_kernel",
           "_prefill_kernel"] + ["_small_m_linear_kernel"] * 4
           + ["_rope_kv_linear_kernel", "_rope_write_kv_kernel", "_rmsnorm_kernel",
              "_add_rmsnorm_kernel", "_silu_mul_kernel", "_greedy_kernel",
              "_last_exited_copy_kernel", "_write_kv_kernel"])


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_every_kernel_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[1::2] == KERNELS
