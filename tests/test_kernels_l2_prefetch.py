"""L2 prefetch of the next weights in one-row rounds (kernels/l2_prefetch.py): how a kernel's
programs share the byte range (under TRITON_INTERPRET=1), the host-side checks, and which weight
each kernel of a layer prefetches (rltlab.engine.static_decode.prefetch_plan). The prefetch
instruction itself only compiles for Hopper; the GPU checks were a script in the tree at
093d100 (one_row_exactness.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rltlab.engine import ExecutionConfig  # noqa: E402
from rltlab.engine.static_decode import prefetch_plan  # noqa: E402
from rltlab.kernels import prefetch_bytes, triton_available  # noqa: E402
from rltlab.kernels.l2_prefetch import lane_chunks, prefetch_args  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _record_chunks_kernel(offsets_ptr, sizes_ptr, nbytes, PASSES: tl.constexpr,
                          CHUNK: tl.constexpr, LANES: tl.constexpr):
    """prefetch_l2's loop, storing each lane's (offset, size) instead of prefetching."""
    pid = tl.program_id(0) + tl.num_programs(0) * tl.program_id(1)
    programs = tl.num_programs(0) * tl.num_programs(1)
    lanes = tl.arange(0, LANES)
    step = 0
    for first in range(pid, tl.cdiv(nbytes, CHUNK), programs * LANES):
        offset, size = lane_chunks(first, programs, nbytes, CHUNK, LANES)
        at = (pid * PASSES + step) * LANES + lanes
        tl.store(offsets_ptr + at, offset)
        tl.store(sizes_ptr + at, size)
        step += 1


@pytest.mark.skipif(not triton_available(DEVICE), reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("nbytes, grid, chunk, lanes", [
    (16, (1, 1), 64, 4),            # less than one chunk
    (64 * 37 + 48, (3, 2), 64, 4),  # ragged last chunk, two passes for some programs
    (64 * 24, (5, 1), 64, 8),       # chunks fewer than lanes x programs
    (1 << 14, (2, 3), 256, 4),      # several passes for every program
])
def test_programs_prefetch_every_byte_exactly_once(nbytes, grid, chunk, lanes):
    programs = grid[0] * grid[1]
    passes = triton.cdiv(triton.cdiv(nbytes, chunk), programs * lanes)
    offsets = torch.full((programs, passes, lanes), -1, dtype=torch.int64, device=DEVICE)
    sizes = torch.full((programs, passes, lanes), -1, dtype=torch.int32, device=DEVICE)
    _record_chunks_kernel[grid](offsets, sizes, nbytes, PASSES=passes, CHUNK=chunk, LANES=lanes)
    assert (sizes >= 0).all(), "a pass that should run did not"
    covered = torch.zeros(nbytes, dtype=torch.int32)
    for offset, size in zip(offsets.flatten().tolist(), sizes.flatten().tolist()):
        assert 0 <= size <= chunk and size % 16 == 0
        covered[offset:offset + size] += 1
    assert (covered == 1).all(), "a byte prefetched twice or never"


def _layers(n=3, dtype=torch.bfloat16):
    shapes = dict(w_qkv=(96, 64), w_o=(64, 64), w_gate_up=(256, 64), w_down=(64, 128))
    return [{name: torch.randn(*shape).to(dtype) for name, shape in shapes.items()}
            for _ in range(n)]


def test_each_kernel_prefetches_the_head_of_the_next_gemvs_weight():
    layers = _layers()
    budget = 10_000   # below some weights' size, above others': not a multiple of 16
    plan = prefetch_plan(layers, budget)
    for i, entry in enumerate(plan):
        expected = {"attention": layers[i]["w_o"], "w_o": layers[i]["w_gate_up"],
                    "w_gate_up": layers[i]["w_down"],
                    "w_down": layers[(i + 1) % len(layers)]["w_qkv"]}
        assert entry.keys() == expected.keys()
        for kernel, weight in expected.items():
            got, nbytes = entry[kernel]
            assert got is weight, (i, kernel)
            size = weight.numel() * weight.element_size()
            assert nbytes == min(size, budget // 16 * 16) and nbytes % 16 == 0
    with pytest.raises(ValueError, match="prefetches nothing"):
        prefetch_plan(layers, 15)


def test_prefetch_bytes_rounds_down_and_caps_at_the_size():
    w = torch.randn(8, 8)   # 256 bytes
    assert prefetch_bytes(w, 100) == 96
    assert prefetch_bytes(w, 10_000) == 256


def test_prefetch_arguments_refuse_what_cannot_run():
    w = torch.randn(8, 8)
    for off in (None, (w, 0)):
        args, meta = prefetch_args(off, placeholder=w)
        assert args[0] is w and args[1] == 0 and meta["PREFETCH"] is False
    for nbytes in (8, -16, 1024):   # not a multiple of 16; negative; past the weight
        with pytest.raises(ValueError, match="multiple of 16"):
            prefetch_args((w, nbytes), placeholder=w)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_args((w.t(), 64), placeholder=w)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        with pytest.raises(ValueError, match="compute capability"):
            prefetch_args((w, 64), placeholder=w)


@pytest.mark.parametrize("value", [-1, True, "8", 1024])
def test_engine_config_checks_the_prefetch_budget(value):
    with pytest.raises(ValueError, match="l2_prefetch_mb"):
        ExecutionConfig(l2_prefetch_mb=value)
