"""Greedy tokens from logits in one pass: each row's argmax (first index among equal maxima, as
torch.argmax) and whether all its logits are finite.

The engine's windows sample the rows that exit in every round step. For rows that are all greedy,
with nothing filtered and no log-probs asked for, the general sampler (rltlab.engine.sampling)
still converts the [rows, vocab] logits to fp32, then runs torch's argmax and an isfinite + all
reduction over them: with about 46 of W7's 128 rows exiting per step, that work and its
launches cost ~4% of W7's decode phase. Here one
program per row streams the row once in the logits' own dtype, keeps per lane the first index of
its running maximum, and reduces the lanes at the end.

A row with a NaN or infinite logit reports finite = False; its token is then unspecified (the
engine fails such rows, as it does on the general path).
"""

import torch
import triton
import triton.language as tl

BLOCK = 8192
_NO_INDEX = 2 ** 31 - 1


def greedy_tokens_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax int64 [N], all finite bool [N]) of logits [N, V]."""
    return logits.float().argmax(dim=-1), torch.isfinite(logits).all(dim=-1)


@triton.jit
def _greedy_kernel(logits_ptr, tokens_ptr, finite_ptr, V, stride, BLOCK: tl.constexpr,
                   NO_INDEX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], NO_INDEX, tl.int32)
    finite = tl.full([BLOCK], 1, tl.int32)
    for start in range(0, V, BLOCK):
        at = start + lanes
        inside = at < V
        x = tl.load(logits_ptr + row * stride + at, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        # A lane sees its indices in increasing order: a strict > keeps the first of equal maxima.
        better = x > best
        best = tl.where(better, x, best)
        best_at = tl.where(better, at, best_at)
        ok = (x == x) & (tl.abs(x) != float("inf"))   # not NaN, not +-inf
        finite = finite & (ok | ~inside).to(tl.int32)
    top = tl.max(best, axis=0)
    tl.store(tokens_ptr + row, tl.min(tl.where(best == top, best_at, NO_INDEX), axis=0)
             .to(tl.int64))
    tl.store(finite_ptr + row, (tl.min(finite, axis=0) > 0).to(tl.int8))


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of greedy_tokens_ref: logits [N, V] (any float dtype, last dim contiguous,
    V < 2^31)."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not logits.is_floating_point():
        raise ValueError(f"greedy_tokens takes float logits [N, V] contiguous in V, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    n, vocab = logits.shape
    if vocab >= _NO_INDEX:
        raise ValueError(f"greedy_tokens takes fewer than 2^31 - 1 logits per row, got {vocab}")
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    finite = torch.empty(n, dtype=torch.int8, device=logits.device)
    if n:
        _greedy_kernel[(n,)](logits, tokens, finite, vocab, logits.stride(0),
                             BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
                             NO_INDEX=_NO_INDEX, num_warps=16)
    return tokens, finite.view(torch.bool)   # 0 / 1 bytes: a bool tensor without a copy
