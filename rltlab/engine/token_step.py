"""Whole-token decode steps: every round of a fixed-depth token in one launch.

In the round-per-step loop a batch-1 token costs R engine steps, and on a GPU the last one ends
with the host reading the sampled token while the device idles (~1.3 ms per token on the H200,
docs/benchmarks/2026-11-29-engine-static-h200.md). When nothing needs to look between rounds,
`step()` hands over to `FusedTokenStep.step()`, which runs rounds 1..D of every running
sequence's pending token through the static decoder as one unit (one CUDA graph per batch bucket
and depth: `StaticDecoder.run_token`) and samples: one host round trip per token.

It applies when the engine has the static decode path, no round observers and no proposer, is
not paused, no waiting request could be admitted, and every running sequence sits at a decode
boundary (pending token sampled, every earlier position final) under the host-decided `fixed`
policy, all at the same depth D. Then the result is the round-per-step result by construction:
the same rounds through the same decoder, the same LAST_EXITED copies, the same sampler; tests
compare both token for token. Anything else steps one round at a time.

Phase: sequences that start their tokens in different steps (prefills finish in different
steps; a prefill always runs R rounds, so at depth D with R % D != 0 they never line up again)
would never all sit at a boundary together. So when the only thing standing in the way is
decode tokens still in flight, `hold()` names the sequences already at a boundary: they start no
new token until the others finish theirs (fewer than D steps), and from then on the batch steps
whole tokens. Holding changes when a sequence computes, never what it computes.
"""
from __future__ import annotations

from rltlab.engine.exit_policies import FixedDepth
from rltlab.engine.sequence import Sequence


class FusedTokenStep:
    def __init__(self, engine):
        self.engine = engine

    def depth(self, seq: Sequence) -> int | None:
        """The host-fixed depth of the sequence's next token, or None (the policy decides)."""
        p = seq.params
        if not isinstance(self.engine.policy(p.exit_policy), FixedDepth):
            return None
        return min(p.exit_policy_args.get("depth", p.max_loops), p.max_loops,
                   self.engine.num_rounds)

    def ready(self) -> int | None:
        """The common depth if this step can run whole tokens, else None."""
        seqs = self._candidates()
        if seqs is None or any(not seq.at_token_boundary for seq in seqs):
            return None
        return self._common_depth(seqs)

    def hold(self) -> frozenset[int]:
        """Sequences at a boundary to keep waiting this round step: every running sequence is
        either at a boundary or inside a decode token of the same host-fixed depth."""
        seqs = self._candidates()
        if seqs is None or self._common_depth(seqs) is None:
            return frozenset()
        waiting = [seq for seq in seqs if seq.at_token_boundary]
        in_flight = [seq for seq in seqs if not seq.at_token_boundary]
        if not waiting or not all(seq.span is not None and seq.span.exit_rounds is None
                                  for seq in in_flight):
            return frozenset()
        return frozenset(seq.seq_id for seq in waiting)

    def _candidates(self) -> list[Sequence] | None:
        """The running sequences, or None if the engine state rules whole tokens out."""
        eng = self.engine
        sch = eng.scheduler
        if eng.paused or eng.observers or eng.proposer is not None or not sch.running \
                or sch.can_admit():
            return None
        return sch.running

    def _common_depth(self, seqs: list[Sequence]) -> int | None:
        depths = {self.depth(seq) for seq in seqs}
        return depths.pop() if len(depths) == 1 and None not in depths else None

    def step(self, depth: int):
        eng = self.engine
        seqs = list(eng.scheduler.running)
        eng._failed = {}
        hidden = eng.runner.run_token(seqs, depth)
        for seq in seqs:
            seq.num_computed = seq.num_tokens
        eng._sample([(seq, hidden[i], depth) for i, seq in enumerate(seqs)])
        eng._finish_failed(seqs)
        return eng._drain_outputs()
