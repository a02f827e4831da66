"""Loop-level continuous batching.

Every engine step runs ONE round of the shared layers for a batch of rows; each running
sequence contributes at most one row: its current span at its own next round. Rows at
different rounds, prefill chunks and decode tokens share the batch.

Scheduling order per step, under max_num_batched_tokens (query tokens) and max_num_seqs:
  1. spans already in flight (started at an earlier round) continue; they always fit, because
     a span's active tokens only shrink and every batch fit the budget;
  2. running sequences without a span start their next one (a chunk sized to what is left);
  3. waiting sequences are admitted FCFS while blocks for their whole lifetime are free; the
     samples of one request are admitted together and prefill their prompt once (groups.py).
"""
from __future__ import annotations

from collections import deque

import torch

from rltlab.engine import groups
from rltlab.engine.block_manager import BlockManager
from rltlab.engine.config import EngineConfig
from rltlab.engine.sequence import Sequence, SeqStatus, Span


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, num_rounds: int):
        self.config, self.block_manager, self.num_rounds = config, block_manager, num_rounds
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """A waiting sequence would be admitted now (free slots and blocks for it)."""
        return bool(self._admissible())

    def _admissible(self) -> list[Sequence]:
        return groups.admissible(self.waiting, self.running, self.config.max_num_seqs,
                                 self.block_manager)

    def schedule(self, hold: frozenset[int] = frozenset()) -> list[Sequence]:
        """The sequences that run one round this step (their .span says which tokens).
        hold: ids of running sequences that take no round this step (whole-token steps let
        sequences at a token boundary wait for the rest of the batch, token_step.py; round
        windows keep decode rows, in flight or not, out of the prefill rows' steps,
        round_window.py)."""
        budget = self.config.max_num_batched_tokens
        rows: list[Sequence] = []
        in_flight = [s for s in self.running if s.span is not None and s.span.round > 0
                     and s.seq_id not in hold]
        for seq in in_flight:
            if seq.span.num_active <= budget:
                rows.append(seq)
                budget -= seq.span.num_active
        for seq in self.running:
            if seq.seq_id in hold or (seq.share is not None and seq.share.waits(seq)):
                continue
            if budget > 0 and (seq.span is None or seq.span.round == 0):
                if self._start_span(seq, budget):
                    rows.append(seq)
                    budget -= seq.span.num_active
        while budget > 0 and (family := self._admissible()):
            for seq in family:
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            groups.allocate(family, self.block_manager)
            seq = family[0]   # the others wait for its prompt (groups.ShareGroup)
            if self._start_span(seq, budget):
                rows.append(seq)
                budget -= seq.span.num_active
        return rows

    def _start_span(self, seq: Sequence, budget: int) -> bool:
        """Give seq its next span (at most `budget` tokens); False if it gets none."""
        span = seq.span if seq.span is not None else self._next_span(seq)
        if span.length > budget:
            if span.exit_rounds is None:
                return False
            span = self._next_span(seq, limit=budget)   # a shorter chunk
        seq.span = span
        return True

    def _next_span(self, seq: Sequence, limit: int | None = None) -> Span:
        start, known = seq.num_computed, seq.num_tokens
        fixed_end = known if seq.num_output_tokens == 0 else known - 1
        if start >= fixed_end:   # the last token, already sampled: decode it
            assert start == known - 1, (start, known)
            return Span(start, 1, None, emits=True)
        length = min(fixed_end - start, self.config.prefill_chunk, limit or fixed_end)
        # one list for the chunk (a per-position call cost ~10 ms per 16 1K-token prompts)
        exits = torch.tensor(seq.fixed_exit_rounds(start, start + length, self.num_rounds))
        emits = seq.num_output_tokens == 0 and start + length == known
        return Span(start, length, exits, emits)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.span = None
