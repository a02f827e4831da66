"""L2 prefetch of the next weights, issued by the kernel before them (one-row decode rounds).

A one-row round streams ~103 MB of weights per layer through four GEMVs, with the attention,
its split merge and two norms in between: ~9 us per layer in which HBM idles (eager
profile). Each GEMV also ramps up and drains with few loads in
flight. Here a kernel asks the memory system to bring the first bytes of the *next* GEMV's
weight into L2 while it runs (Hopper's ``cp.async.bulk.prefetch.L2``: a hint, no data enters
the SM, nothing waits on it), so that the next GEMV reads them from L2.

``prefetch_l2`` gives each program of the calling kernel its share of the byte range: chunks
of CHUNK bytes, dealt round-robin over the programs and, within a program, over LANES lanes
(one per thread). Weights are never written during a round, so it runs before the PDL wait.
A prefetch changes no result, only where bytes come from; the engine turns it on only where it
compiles (CUDA, compute capability >= 9.0, not the interpreter).
"""

import torch
import triton
import triton.language as tl

from .pdl import pdl_available

CHUNK = 4096                     # bytes per prefetch instruction (a multiple of 16)
LANES = 128                      # prefetch instructions per program per pass


@triton.jit
def lane_chunks(first, programs, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Byte offsets and sizes of the chunks first, first + programs, ... (one per lane); a lane
    past the end gets size 0."""
    chunk = (first + tl.arange(0, LANES) * programs).to(tl.int64)
    size = tl.minimum(tl.maximum(nbytes - chunk * CHUNK, 0), CHUNK).to(tl.int32)
    return chunk * CHUNK, size


@triton.jit
def prefetch_l2(base_ptr, nbytes, PREFETCH: tl.constexpr, CHUNK: tl.constexpr,
                LANES: tl.constexpr):
    """This program's share of bytes [0, nbytes) from base_ptr into L2 (PREFETCH: on/off)."""
    if PREFETCH:
        pid = tl.program_id(0) + tl.num_programs(0) * (
            tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        base = base_ptr.to(tl.int64)
        for first in range(pid, tl.cdiv(nbytes, CHUNK), programs * LANES):
            offset, size = lane_chunks(first, programs, nbytes, CHUNK, LANES)
            # Size 0 (past the end) predicates the instruction off.
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(prefetch: tuple[torch.Tensor, int] | None, placeholder: torch.Tensor
                  ) -> tuple[tuple, dict]:
    """((pf_ptr, pf_bytes), constexprs) of a launch that prefetches ``prefetch`` = (weight,
    nbytes): the first nbytes of weight (None: off, with ``placeholder``, any tensor of the
    launch, standing in for the pointer); ValueError where it cannot run."""
    off = {"PREFETCH": False, "PF_CHUNK": CHUNK, "PF_LANES": LANES}
    if prefetch is None or prefetch[1] == 0:
        return (placeholder, 0), off
    weight, nbytes = prefetch
    if nbytes < 0 or nbytes % 16 or nbytes > weight.nbytes:
        raise ValueError(f"prefetch of {nbytes} bytes: must be a multiple of 16 within the "
                         f"weight's {weight.nbytes} bytes")
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError("the prefetched weight must be contiguous and 16-byte aligned")
    if not pdl_available(weight.device):
        raise ValueError("L2 prefetch needs a CUDA device of compute capability >= 9.0 and "
                         f"compiled (not interpreted) Triton kernels; got {weight.device}")
    return (weight, nbytes), {**off, "PREFETCH": True}


def prefetch_bytes(weight: torch.Tensor, budget: int) -> int:
    """The first min(budget, size) bytes of weight, rounded down to 16 (0: off)."""
    return min(budget, weight.nbytes) // 16 * 16
