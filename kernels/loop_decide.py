"""The device loop's decision after each tree program (rltlab.engine.device_loop), in one kernel.

After a program, the loop appends its output row to a ring the host reads, counts it, and
decides on the device whether another program runs and whether that one verifies the lookup
chain's rows: TreeGraph.run's own rules. As ~25 small torch ops captured into a graph, that
decision cost more device time a program than the host's turn it replaces: the first device
loop ran 7% slower than the host loop on an H100 (docs/benchmarks/2026-12-06-s30-h100.md). Here
it is one program of one block.

A program's output row (int64, width = span + 5): [n | path tokens (span) | bonus | finite |
live | hits]. The emitted tokens are the first n path tokens and the bonus; a stop token among
them ends the loop (the stops row is padded with -1, compared as given).
"""

import torch
import triton
import triton.language as tl


def loop_decide_ref(out: torch.Tensor, left: torch.Tensor, count: torch.Tensor,
                    ring: torch.Tensor, limit: torch.Tensor, stops: torch.Tensor,
                    flags: torch.Tensor, span: int, adaptive: bool) -> None:
    """In place: ring[count] = out; count += 1; flags = [go on, next rows] (int32).

    out [span + 5] int64 (a program's row); left [1] (the next program's tokens left); count,
    limit [1] int64 (programs so far, at most); ring [capacity, span + 5] int64; stops [S]
    int64. go on: live, finite, tokens left, no stop token emitted, count < limit. Next rows:
    hits > 0 where adaptive, else 1."""
    n, path, bonus = out[0], out[1: 1 + span], out[1 + span: 2 + span]
    finite, live, hits = out[2 + span], out[3 + span], out[4 + span]
    ring.index_copy_(0, count, out[None])
    count.add_(1)
    levels = torch.arange(span, device=out.device)
    stopped = (torch.isin(path, stops) & (levels < n)).any() | torch.isin(bonus, stops).any()
    go = (live > 0) & (finite > 0) & (left[0] > 0) & ~stopped & (count[0] < limit[0])
    rows = hits > 0 if adaptive else torch.ones_like(go)
    flags.copy_(torch.stack([go, rows]).int())


@triton.jit
def _decide_kernel(out_ptr, left_ptr, count_ptr, ring_ptr, limit_ptr, stops_ptr, flags_ptr,
                   capacity, SPAN: tl.constexpr, NUM_STOPS: tl.constexpr,
                   ADAPTIVE: tl.constexpr, BLOCK: tl.constexpr):
    width = SPAN + 5
    lanes = tl.arange(0, BLOCK)
    inside = lanes < width
    row = tl.load(out_ptr + lanes, mask=inside, other=0)
    at = tl.load(count_ptr)
    # the scalar as a block: the interpreter refuses a scalar term in a mask
    tl.store(ring_ptr + at * width + lanes, row, mask=inside & (at + 0 * lanes < capacity))
    tl.store(count_ptr, at + 1)
    n = tl.load(out_ptr)
    emitted = ((lanes >= 1) & (lanes <= SPAN) & (lanes - 1 < n)) | (lanes == SPAN + 1)
    stopped = 0
    for s in tl.static_range(NUM_STOPS):
        hit = emitted & (row == tl.load(stops_ptr + s))
        stopped = stopped | tl.max(hit.to(tl.int32), axis=0)
    finite = tl.load(out_ptr + SPAN + 2)
    live = tl.load(out_ptr + SPAN + 3)
    hits = tl.load(out_ptr + SPAN + 4)
    go = (live > 0) & (finite > 0) & (tl.load(left_ptr) > 0) & (stopped == 0) & \
        (at + 1 < tl.load(limit_ptr))
    tl.store(flags_ptr, go.to(tl.int32))
    if ADAPTIVE:
        tl.store(flags_ptr + 1, (hits > 0).to(tl.int32))
    else:
        tl.store(flags_ptr + 1, 1)


def loop_decide(out: torch.Tensor, left: torch.Tensor, count: torch.Tensor, ring: torch.Tensor,
                limit: torch.Tensor, stops: torch.Tensor, flags: torch.Tensor, span: int,
                adaptive: bool) -> None:
    """Triton version of loop_decide_ref (same arguments, contiguous int64 tensors, flags
    int32); a count past the ring's capacity writes no row."""
    width = span + 5
    if out.shape != (width,) or ring.dim() != 2 or ring.shape[1] != width:
        raise ValueError(f"loop_decide takes a row of span + 5 = {width} values and a ring of "
                         f"such rows, got {tuple(out.shape)} and {tuple(ring.shape)}")
    if any(t.dtype != torch.int64 for t in (out, left, count, ring, limit, stops)) or \
            flags.dtype != torch.int32:
        raise ValueError("loop_decide takes int64 rows, counts and stops and int32 flags")
    if not all(t.is_contiguous() for t in (out, ring, stops, flags)):
        raise ValueError("loop_decide takes contiguous rows, ring, stops and flags")
    _decide_kernel[(1,)](out, left, count, ring, limit, stops, flags, ring.shape[0],
                         SPAN=span, NUM_STOPS=stops.numel(), ADAPTIVE=bool(adaptive),
                         BLOCK=triton.next_power_of_2(width), num_warps=1)
