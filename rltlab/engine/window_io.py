"""What round windows (round_window.py) and token windows (token_window.py) share: a window's
static index with every row a padding row, its upload, sampling the exiting rows on the device,
the one read-back, and handing the tokens to the engine."""
from __future__ import annotations

import numpy as np
import torch

from rltlab.common.device import tensor_to_device
from rltlab.engine.sampling import sample_on_device
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
    chosen log-probs or NaN); the tokens become the rows' pending tokens."""
    logits = engine.runner.logits(hidden.index_select(0, rows))
    drawn = sample_on_device(logits, [seq.params for seq in seqs],
                             [seq.generator for seq in seqs], engine.config.logprobs_mode)
    pending.index_copy_(0, rows, drawn.tokens)
    logp = drawn.logprobs if drawn.logprobs is not None else \
        torch.full_like(logits[:, 0], float("nan"))
    return drawn.tokens, torch.isfinite(logits).all(dim=-1), logp


def read_back(outs) -> tuple[list[int], list[bool], list[float]]:
    """sample_rows' results of a whole window, in step order, in one read-back."""
    if not outs:
        return [], [], []
    return tuple(torch.cat([out[k] for out in outs]).tolist() for k in range(3))


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
