"""The decode attention kernels compile for an H100 / H200 (sm_90) on a machine without a GPU.

The other kernel tests run the kernels under Triton's interpreter, which accepts some programs
the compiler refuses (control flow around loads, types that change across branches). Here
Triton's own compiler and ptxas build them for sm_90 at Ouro-1.4B's head shape in bf16, with
the branches the engine takes (a shared-prefix plan, programmatic dependent launch). It runs in
a subprocess: this process may have imported Triton in interpreter mode."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from rltlab.kernels import paged_attention, shared_prefix

    TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pf_ptr": "*bf16",
             "out_ptr": "*fp32", "lse_ptr": "*fp32", "part_ptr": "*fp32", "qk_scale": "fp32"}

    def build(kernel, **constexprs):
        signature = {name: "constexpr" if name in constexprs else
                     TYPES.get(name, "*i32" if name.endswith("_ptr") else "i32")
                     for name in kernel.arg_names}
        # as a launch specialises them: pointers and strides divisible by 16
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                   if name not in constexprs and (name.endswith("_ptr") or name.startswith("stride"))}
        triton.compile(ASTSource(kernel, signature, constexprs, aligned),
                       target=GPUTarget("cuda", 90, 32))
        print("compiled", kernel.__name__)

    tiles = dict(BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, DOT_DTYPE=tl.bfloat16,
                 INPUT_PRECISION="tf32")
    for has_start in (False, True):
        build(paged_attention._decode_kernel, GROUP=1, BLOCK_G=16, GDC=True, PREFETCH=True,
              PF_CHUNK=4096, PF_LANES=128, HAS_START=has_start, **tiles)
    build(shared_prefix._shared_prefix_kernel, GROUP=1, MEMBERS=16, BLOCK_M=16, BLOCK_G=16,
          **tiles)
    build(paged_attention._merge_splits_kernel, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=4, GDC=True)
""")


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_decode_attention_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled", "_decode_kernel"] * 2 + [
        "compiled", "_shared_prefix_kernel", "compiled", "_merge_splits_kernel"]
