"""rltlab.common.profiling: kernel names land in their classes, and a call's profile is
consistent with itself (on the CPU, operators stand in for kernels)."""
import pytest
import torch

from rltlab.common.profiling import KERNEL_CLASSES, host_pauses, host_profile, phase_profile


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "matmul"),
    ("_small_m_linear_kernel", "matmul"),
    ("_rope_kv_linear_kernel", "matmul"),   # RoPE in a GEMV's epilogue: the GEMV's time
    ("aten::mm", "matmul"),
    ("_paged_decode_attention_kernel", "attention"),
    ("_decode_kernel", "attention"),        # kernels/paged_attention.py's decode and its merge
    ("_merge_splits_kernel", "attention"),
    ("flash_fwd_kernel", "attention"),
    ("_fused_add_rmsnorm_kernel", "norm_rope_act"),
    ("_argmax_finite_kernel", "sampling"),
    ("void at::native::index_elementwise_kernel", "copy_index"),
    ("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", "other"),
])
def test_phase_profile_kernel_classes(name, kind):
    found = next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), "other")
    assert found == kind


def test_phase_profile_attributes_a_matmul_heavy_call_to_matmul():
    """On the CPU the operators stand in for kernels: a call that is mostly one large matmul
    has matmul as its heaviest class, and its figures are consistent."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    out = phase_profile(lambda: [a @ b for _ in range(20)])
    classes = out["kernel_ms_by_class"]
    assert max(classes, key=classes.get) == "matmul"
    assert out["kernel_ms"] == pytest.approx(sum(classes.values()), abs=0.05)
    assert 0.0 <= out["idle_pct"] <= 100.0 and out["launches"] >= 20
    assert out["top_kernels"][0][0] == "aten::mm"


def test_host_profile_names_the_function_that_takes_the_time():
    """cProfile's heaviest function by own time is the Python loop that spins; its own time is
    its cumulative time (it calls nothing) and within the call's wall time."""
    def spin():
        total = 0
        for i in range(400_000):
            total += i * i
        return total

    out = host_profile(lambda: [spin(), sum(range(1000))], top=3)
    name, calls, own_ms, cumulative_ms = out["functions"][0]
    assert name.startswith("spin (test_profiling.py:") and calls == 1
    assert 0 < own_ms == pytest.approx(cumulative_ms, rel=0.01)
    assert cumulative_ms <= out["wall_ms"]


def test_host_pauses_counts_garbage_collections_inside_the_block_only():
    import gc
    gc.collect()   # (outside: not counted)
    with host_pauses() as counts:
        cycles = []
        for _ in range(3):
            a, b = [], []
            a.append(b), b.append(a)   # a reference cycle only the collector frees
            cycles.append(a)
            gc.collect()
    gc.collect()   # after the block: not counted
    assert counts["gc_collections"] == 3
    assert counts["gc_s"] >= 0
    assert not torch.cuda.is_available() or {"device_allocs", "alloc_retries"} <= set(counts)
