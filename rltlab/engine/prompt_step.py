"""Whole-prompt steps: a step whose rows are all fresh prompts runs their R rounds at once.

Every prompt position runs all R rounds and exits at R (docs/ouro.md, KV semantics: full-depth
prefill), so nothing between a prompt's rounds needs the host: no exit to decide, no
LAST_EXITED copy, no token to sample before round R. Round steps still spend one engine step
per round on it, each with its own scheduling, input building and read-back: at c = 1 the
embedded model's 32 held-out prompts took a fifth as long in such steps as all their decoded
tokens (the gain of whole-prompt steps: docs/results.md E9).

Here one runner call (ModelRunner.run_prompts) runs rounds 1..R of every row, as one CUDA graph
per padded bucket where prefill graphs run (prefill_graphs.py), and token 0 is sampled from h_R
as the R-th round step samples it. The rounds' arithmetic is the round steps' own, so tokens,
log-probs and the K/V of every plane are the same.

Only where the step holds every running sequence: at c = 1, and when a batch starts. In a
closed loop whose prompts are admitted while other rows decode (held meanwhile, prefill_first),
W7 at the Ouro-1.4B shape ran slower paired with whole-prompt steps there than with round
steps (docs/results.md, "Negative results"; cause not found), so such admissions keep round
steps.

Not taken either (round steps run, as before): a prompt split into chunks (prefill_chunk), spans
recomputed after a weight update, round observers (they see every round), select_only
semantics, and ExecutionConfig.whole_prompt_steps = False.

Launched behind it (ExecutionConfig.launch_behind_prompt): where the step's one row is a request
that the next step will decode with a tree program (TreeGraph.launch_first: greedy or sampled,
whose draws are a function of the request's seed and position, so a dropped program has drawn
nothing) or a plain greedy one that it will decode with a token window
(TokenWindow.launch_first: a dropped window must not have drawn from a generator), that launch
is queued as soon as token 0's copy to
the host is, from the token still on the device; the next step takes it over, and where token
0 ends the request it is dropped unread. The device then runs the two back to back instead of
idling through the host's turn between them (the read-back, token 0's bookkeeping, the next
step's scheduling and staging).
"""
from __future__ import annotations

from rltlab.engine.groups import fork_followers
from rltlab.engine.sampling import plain_greedy
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
        engine._sample(emitting + forked, before_read=self._launcher(emitting + forked))
        engine._finish_failed(seqs + [seq for seq, _, _ in forked])
        self.steps += 1

    def _launcher(self, emitting):
        """With ExecutionConfig.launch_behind_prompt, for a lone row that the next step decodes
        with a tree program, or a plain-greedy one that it decodes with a token window:
        sample_finite's before_read that launches it (module docstring); else None."""
        engine = self.engine
        if not engine.config.execution.launch_behind_prompt or len(emitting) != 1:
            return None
        seq, hidden, _ = emitting[0]
        sch = engine.scheduler
        if engine.paused or sch.running != [seq] or seq.num_output_tokens or \
                seq.max_output_tokens < 2 or sch.can_admit():
            return None
        if engine.proposer is not None:   # the tree program's own conditions
            return engine._spec.first_launcher(seq, hidden)
        if not plain_greedy([seq.params], engine.model_config.vocab_size):
            return None
        window, whole = engine._token_window, engine._whole_tokens
        if window is None or whole is None or not whole.host_may_plan() or \
                not window.fits([seq]):
            return None
        depth = whole.depth(seq, 1)
        if depth is None:
            return None
        return lambda tokens, finite: window.launch_first(seq, tokens, depth)
