"""Engine hooks: per-round observers (trace collection).

Observers cost nothing when none is registered: the engine builds a RoundEvent only if at least
one observer is attached, and computes per-round logits only if one asked for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class RoundEvent:
    """One engine step = one round for every scheduled token (T tokens, flattened rows).

    All tensors are indexed by token; request_ids / sample_indices are Python lists of length T.
    A token is a prompt position (is_decode False: prefill or post-update recompute) or the
    single decode token of a sequence.
    """
    rounds: torch.Tensor          # int64 [T], 1-based round just completed
    request_ids: list[str]
    sample_indices: list[int]     # which of the request's n samples
    positions: torch.Tensor       # int64 [T]
    hidden: torch.Tensor          # [T, H]: h_r (after model.norm), model dtype
    gate_logits: torch.Tensor     # fp32 [T]: exit-gate logit g_r
    exits: torch.Tensor           # bool [T]: the token leaves after this round
    is_decode: torch.Tensor       # bool [T]
    weight_version: int
    logits: torch.Tensor | None = None   # fp32 [T, V] lm_head(h_r), if an observer asked

    @classmethod
    def build(cls, seqs, row_sizes, rounds, positions, hidden, gate_logits, exits,
              weight_version, logits=None) -> "RoundEvent":
        """From the step's rows (each sequence's span holds row_sizes[i] tokens)."""
        per_token = [seq for seq, n in zip(seqs, row_sizes) for _ in range(n)]
        return cls(rounds=rounds, request_ids=[s.request_id for s in per_token],
                   sample_indices=[s.index for s in per_token], positions=positions,
                   hidden=hidden, gate_logits=gate_logits, exits=exits,
                   is_decode=torch.tensor([s.span.exit_rounds is None for s in per_token]),
                   weight_version=weight_version, logits=logits)


RoundObserver = Callable[[RoundEvent], None]


@dataclass
class ObserverHandle:
    fn: RoundObserver
    with_logits: bool
