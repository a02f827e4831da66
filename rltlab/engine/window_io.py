"""What round windows (round_window.py) and token windows (token_window.py) share: a window's
static index with every row a padding row, its upload, sampling the exiting rows on the device,
the one read-back, handing the tokens to the engine, and chaining.

Chaining (ExecutionConfig.window_chain): after a window is launched, the host plans the next one
(both kinds plan ahead) and reads this one back, and the device idles from the read-back until
the next window is launched (a few percent of a window; ~6% at c = 1). When the next window has
exactly the same rows, nothing the read-back tells the host can change it: no row reaches its
length limit in this window (the plan knows), so no slot frees and no admission is due (none
was when this window started). A row that stops at EOS or a stop token is only learnt from
the read-back; it computes on through the chained window and its tokens there are dropped,
as tokens after a stop inside one window are. So the next window is launched first, then this
one is read back and its tokens handed over while the device runs the next; the chain ends when
a row stops or fails, when the rows change, after window_chain windows (aborts and new requests
wait for the step to end), or when any row streams (its tokens go out once per window).
Each window's device inputs that the host has not read yet (the rows' pending tokens, and for
round windows the states of rows inside a token) are carried on the device; everything else
is what the plan made ahead already holds. Each window's copy to the host is queued right
behind its own work (queue_read_back), before the next window: queued later, the read-back
would wait for the chained window too, and the chain would overlap nothing. Measured: a gain at
c = 1, none beyond noise at c = 128 (docs/results.md E13)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rltlab.common.device import tensor_to_device
from rltlab.engine.sampling import plain_greedy, sample_on_device
from rltlab.engine.sequence import Sequence


def padded_index(static, seqs: list[Sequence]) -> np.ndarray:
    """One step's StaticDecoder index with the rows' block tables and every row a padding row
    (slot -1: no K/V write) until a step sets it."""
    b, nb = static.max_batch, static.max_blocks
    base = np.zeros(4 * b + b * nb, dtype=np.int32)
    static._stage_padding(base, 0)
    tables = base[4 * b:].reshape(b, nb)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = seq.block_table
    return base


def upload_index(index: np.ndarray, device: torch.device) -> torch.Tensor:
    """Every step's index [steps, ...] to the device in one copy that does not wait for it."""
    return tensor_to_device(torch.from_numpy(index), device)


def sample_rows(engine, hidden: torch.Tensor, pending: torch.Tensor, rows: torch.Tensor,
                seqs: list[Sequence]):
    """The exiting rows' tokens from their h (hidden[rows]), drawn on the device by the
    engine's sampler (each row with its own params and generator) -> (tokens, logits finite,
    chosen log-probs or NaN); the tokens become the rows' pending tokens. Rows that are all
    greedy, unfiltered and without log-probs take the argmax in one kernel (runner.greedy):
    the same tokens, without the sampler's fp32 copy and reductions."""
    params = [seq.params for seq in seqs]
    if plain_greedy(params, engine.model_config.vocab_size):
        tokens, finite = engine.runner.greedy(hidden.index_select(0, rows))
        pending.index_copy_(0, rows, tokens)
        return tokens, finite, torch.full(tokens.shape, float("nan"), device=tokens.device)
    logits = engine.runner.logits(hidden.index_select(0, rows))
    drawn = sample_on_device(logits, params,
                             [seq.generator for seq in seqs], engine.config.logprobs_mode)
    pending.index_copy_(0, rows, drawn.tokens)
    logp = drawn.logprobs if drawn.logprobs is not None else \
        torch.full_like(logits[:, 0], float("nan"))
    return drawn.tokens, torch.isfinite(logits).all(dim=-1), logp


def may_chain(engine, seqs: list[Sequence], next_rows: int, chained: int) -> bool:
    """Whether the window planned ahead (for next_rows rows) may be launched before the one
    just launched (the chained-th of this step, 0-based) is read back: see the module
    docstring."""
    return (next_rows == len(seqs) and chained + 1 < engine.config.execution.window_chain
            and not any(seq.request.stream for seq in seqs))


def stopped(engine, seqs: list[Sequence]) -> bool:
    """After a window's tokens were handed over: did a row stop or fail in it?"""
    return any(seq.is_finished or seq.seq_id in engine._failed for seq in seqs)


@dataclass
class ReadBack:
    """A window's sampled tokens, finite flags and log-probs on their way to the host."""
    tensors: tuple            # three host tensors (pinned on CUDA), valid once `ready` passed
    ready: object | None      # torch.cuda.Event recorded after the copies (None: already there)


def queue_read_back(outs) -> ReadBack:
    """sample_rows' results of a whole window, in step order, on their way to the host: one
    concatenation each, queued with a non-blocking copy into pinned memory right behind the
    window's own work, so a window chained after it (queued next) never delays the copy."""
    if not outs:
        return ReadBack((torch.empty(0),) * 3, None)
    parts = [torch.cat([out[k] for out in outs]) for k in range(3)]
    if parts[0].device.type != "cuda":
        return ReadBack(tuple(parts), None)
    host = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                 for p in parts)
    ready = torch.cuda.Event()
    ready.record()
    return ReadBack(host, ready)


def read_back(pending: ReadBack) -> tuple[list[int], list[bool], list[float]]:
    """Wait for a queued read-back (only for its own copies) -> (tokens, finite, log-probs)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    return tuple(t.tolist() for t in pending.tensors)


def accept(engine, seq: Sequence, token: int, finite: bool, logprob: float, depth: int) -> bool:
    """Hand one drawn token to the engine; False once the row takes no more (it stopped
    earlier in the window, so later tokens are dropped, or its logits were not finite)."""
    if seq.is_finished or seq.seq_id in engine._failed:
        return False
    if not finite:
        engine._failed[seq.seq_id] = "non-finite logits"
        return False
    engine._accept_token(seq, token, logprob if seq.params.logprobs is not None else None,
                         None, depth)
    return True
