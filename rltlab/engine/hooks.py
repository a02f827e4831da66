"""Engine hooks: per-round observers and the decode capture (trace collection).

Observers cost nothing when none is registered: the engine builds a RoundEvent only if at least
one observer is attached, and computes per-round logits only if one asked for them. An observer
sees every round as it happens, so the engine steps round by round while one is attached.

The decode capture (LLMEngine.set_decode_capture) hands over what an observer would see of the
decode tokens, h_r and the gate logit of every round, without stopping whole-token steps and
token windows (rltlab.engine.token_step, token_window): their launch also writes each round's
h_r and gate logit into a device buffer inside the same graph (StaticDecoder's round capture),
and the engine passes copies of the launched rows on after the launch, without reading the
device. Decode tokens stepped round by round (beside a prefill, or at mixed depths) reach it
one round at a time. Prompt positions are never captured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

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


class DecodeCapture(Protocol):
    """What LLMEngine.set_decode_capture hands every decode token's rounds to. Tensors are on
    the engine's device and owned by the callee (copies, never overwritten later); hidden
    states are h_r after model.norm in the model's dtype, gate logits fp32. Nothing is read
    back to the host on the way."""

    def tokens(self, seqs: list, positions: list[int], hidden: torch.Tensor,
               gate_logits: torch.Tensor, weight_version: int) -> None:
        """Whole tokens: row i of hidden [n, D, H] and gate_logits [n, D] holds rounds 1..D
        of seqs[i]'s token at input position positions[i] (D: their depth)."""

    def round(self, seqs: list, positions: list[int], rounds: list[int], hidden: torch.Tensor,
              gate_logits: torch.Tensor, weight_version: int) -> None:
        """One round step's decode tokens: row i of hidden [n, H] and gate_logits [n] is round
        rounds[i] (1-based) of seqs[i]'s token at input position positions[i]."""
