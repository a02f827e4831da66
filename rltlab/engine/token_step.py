"""Whole-token decode steps: every round of a fixed-depth token in one launch.

In the round-per-step loop a batch-1 token costs R engine steps, and on a GPU the last one ends
with the host reading the sampled token while the device idles (~1.3 ms per token at the
Ouro-1.4B shape). When nothing needs to look between rounds,
`step()` hands over to `FusedTokenStep.step()`, which runs rounds 1..D of every running
sequence's pending token through the static decoder as one unit (one CUDA graph per batch bucket
and depth: `StaticDecoder.run_token`) and samples: one host round trip per token.

It applies when the engine has the static decode path, no round observers and no proposer, is
not paused, no waiting request could be admitted, and every running sequence sits at a decode
boundary (pending token sampled, every earlier position final) under a policy that fixes the
token's depth on the host before it starts: `fixed` (its depth) or `trace` (the replayed depth
of this output token). Then the result is the round-per-step result by construction: the same
rounds through the same decoder, the same LAST_EXITED copies, the same sampler; tests compare
both token for token. Anything else steps one round at a time.

The decode capture (LLMEngine.set_decode_capture, hooks.py) keeps whole tokens of one depth:
their launch also captures every round's h_r and gate logit, handed over after the launch.
Whole tokens of mixed depths capture nothing, so while it is set they step round by round.

Mixed depths: when the rows' depths differ (exit replay, or requests at different fixed depths),
the step runs them deepest first and each round only over the rows still going
(ModelRunner.run_token with one depth per row): a row at depth 2 costs two rounds, and the batch
still takes one host round trip per token. Stepping such a batch round by round instead would
leave the rows out of phase for good (each restarts at its own round), at one host step per round.

Phase: sequences that start their tokens in different steps (prefills finish in different
steps; a prefill always runs R rounds, so at depth D with R % D != 0 they never line up again)
would never all sit at a boundary together. So when the only thing standing in the way is
decode tokens still in flight, `hold()` names the sequences already at a boundary: they start no
new token until the others finish theirs (fewer than R steps), and from then on the batch steps
whole tokens. Holding changes when a sequence computes, never what it computes.
"""
from __future__ import annotations

from rltlab.engine.exit_policies import FixedDepth, TraceReplay
from rltlab.engine.sequence import Sequence


class FusedTokenStep:
    def __init__(self, engine):
        self.engine = engine

    def depth(self, seq: Sequence, index: int | None = None) -> int | None:
        """The host-fixed depth of the input token that samples output token `index` (default:
        the next, num_output_tokens), or None (the policy decides). The round-step engine
        exits at min(policy's round, max_loops, R): so does this."""
        p, R = seq.params, self.engine.num_rounds
        policy = self.engine.policy(p.exit_policy)
        if isinstance(policy, FixedDepth):
            target = p.exit_policy_args.get("depth", p.max_loops)
        elif isinstance(policy, TraceReplay):
            depths = p.exit_policy_args["depths"]
            i = seq.num_output_tokens if index is None else index
            target = depths[i] if i < len(depths) else p.exit_policy_args.get("fallback", R)
        else:
            return None
        return min(target, p.max_loops, R)

    def ready(self) -> int | list[int] | None:
        """The depth of every running sequence's next token if this step can run whole tokens
        (one int when they agree, else one per sequence in running order), else None."""
        seqs = self._candidates()
        if seqs is None or any(not seq.at_token_boundary for seq in seqs):
            return None
        depths = self._depths(seqs)
        if depths is None:
            return None
        if len(set(depths)) == 1:
            return depths[0]
        return None if self.engine.capture is not None else depths

    def hold(self) -> frozenset[int]:
        """Sequences at a boundary to keep waiting this round step: every running sequence is
        either at a boundary or inside a decode token, all under host-fixed depths."""
        seqs = self._candidates()
        if seqs is None or self._depths(seqs) is None:
            return frozenset()
        waiting = [seq for seq in seqs if seq.at_token_boundary]
        in_flight = [seq for seq in seqs if not seq.at_token_boundary]
        if not waiting or not all(seq.span is not None and seq.span.exit_rounds is None
                                  for seq in in_flight):
            return frozenset()
        return frozenset(seq.seq_id for seq in waiting)

    def _candidates(self) -> list[Sequence] | None:
        """The running sequences, or None if the engine state rules whole tokens out."""
        sch = self.engine.scheduler
        if not self.host_may_plan() or not sch.running or sch.can_admit():
            return None
        return sch.running

    def host_may_plan(self) -> bool:
        """Nothing needs to look between rounds: not paused, no round observers, no proposer
        (also the round windows' precondition, round_window.py)."""
        eng = self.engine
        return not (eng.paused or eng.observers or eng.proposer is not None)

    def _depths(self, seqs: list[Sequence]) -> list[int] | None:
        depths = [self.depth(seq) for seq in seqs]
        return None if None in depths else depths

    def step(self, depth: int | list[int]):
        """Run every running sequence's pending token whole (`depth`: ready()'s answer)."""
        eng = self.engine
        seqs = list(eng.scheduler.running)
        eng._failed = {}
        capture = eng.capture is not None   # ready(): then one depth for all
        hidden = eng.runner.run_token(seqs, depth, capture=capture)
        if capture:
            eng._capture_tokens(seqs, [seq.num_tokens - 1 for seq in seqs], depth)
        for seq in seqs:
            seq.num_computed = seq.num_tokens
        depths = [depth] * len(seqs) if isinstance(depth, int) else depth
        eng._sample([(seq, hidden[i], d) for i, (seq, d) in enumerate(zip(seqs, depths))])
        eng._finish_failed(seqs)
        return eng._drain_outputs()
