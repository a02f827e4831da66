"""Whole-prompt steps: a step whose rows are all fresh prompts runs their R rounds at once.

Every prompt position runs all R rounds and exits at R (REFERENCE.md section 2: full-depth
prefill), so nothing between a prompt's rounds needs the host: no exit to decide, no
LAST_EXITED copy, no token to sample before round R. Round steps still spend one engine step
per round on it, each with its own scheduling, input building and read-back. At c = 1 on the
H200 the embedded model's 32 held-out prompts took 77-84 ms in such steps, against 374 ms for
all their 721 decoded tokens (docs/benchmarks/2026-12-04-s17-h200.md, call 5).

Here one runner call (ModelRunner.run_prompts) runs rounds 1..R of every row, as one CUDA graph
per padded bucket where prefill graphs run (prefill_graphs.py), and token 0 is sampled from h_R
as the R-th round step samples it. The rounds' arithmetic is the round steps' own, so tokens,
log-probs and the K/V of every plane are the same.

Only where the step holds every running sequence: at c = 1, and when a batch starts. In a
closed loop whose prompts are admitted while other rows decode (held meanwhile, prefill_first),
W7 at the Ouro-1.4B shape ran 0.973x as fast paired with whole-prompt steps there as with round
steps (4 rounds, 3 slower; docs/benchmarks/2026-12-04-s18-h200.md, cause not found), so such
admissions keep round steps.

Not taken either (round steps run, as before): a prompt split into chunks (prefill_chunk), spans
recomputed after a weight update, round observers (they see every round), select_only
semantics, and EngineConfig.whole_prompt_steps = False.
"""
from __future__ import annotations

from rltlab.engine.groups import fork_followers
from rltlab.engine.sequence import Sequence


class WholePrompts:
    def __init__(self, engine):
        self.engine = engine
        self.steps = 0   # steps taken here (the tests read it)

    def fits(self, seqs: list[Sequence]) -> bool:
        """Every scheduled row is a fresh whole prompt, no other sequence runs (samples waiting
        for a prompt of the step aside), and nothing must see the rounds."""
        engine = self.engine
        if engine.observers or engine.select_only or not all(map(self._fresh_prompt, seqs)):
            return False
        scheduled = {seq.seq_id for seq in seqs}
        return all(seq.seq_id in scheduled or (seq.share is not None and seq.share.waits(seq))
                   for seq in engine.scheduler.running)

    @staticmethod
    def _fresh_prompt(seq: Sequence) -> bool:
        span = seq.span
        # start 0 and emits: positions 0..P-1, the whole prompt; no output yet: every
        # position's exit round is R (Sequence.fixed_exit_rounds)
        return (span is not None and span.round == 0 and span.start == 0 and span.emits
                and span.exit_rounds is not None and seq.num_output_tokens == 0)

    def step(self, seqs: list[Sequence]) -> None:
        """R rounds of every row, then token 0 of each (and of the samples sharing a prompt,
        groups.py), as the last of R round steps would take it."""
        engine = self.engine
        engine._failed = {}
        last_hidden = engine.runner.run_prompts(seqs)
        emitting = []
        for seq, hidden in zip(seqs, last_hidden):
            seq.num_computed, seq.span = seq.span.length, None
            emitting.append((seq, hidden, engine.num_rounds))
        forked = fork_followers(engine.runner, seqs, emitting)
        engine._sample(emitting + forked, whole_prompts=True)
        engine._finish_failed(seqs + [seq for seq, _, _ in forked])
        self.steps += 1
