"""Round windows: mixed host-fixed depths stepped one round at a time, the host once per window.

With rows at different depths (an exit replay, requests at different fixed depths) the cheapest
device schedule is round-level batching: every step runs ONE round for every row, each row at
its own round and plane, and a row that reaches its depth samples and starts its next token in
the following step. Every step reads the weights once and each row's own KV plane, so a token
costs its depth in rounds. (Whole tokens run deepest first instead read the weights R times per
token whenever any row needs round R: token_step.py.)

Stepped by the engine, such a batch pays the host's per-step work (exit decisions, span
bookkeeping, sampling read-back, scheduling) every round: at 128 rows that was ~5 ms against
a ~2.8 ms round at the Ouro-1.4B shape. But under host-fixed depths
(`fixed`, `trace`) nothing the host learns in a round changes the schedule: which row runs
which round at which position and plane, and which rows exit, are known ahead. So
`RoundWindow.step()` plans up to `ExecutionConfig.round_window` round steps on the host at once
(round_plan.schedule), ships their indices in three copies, runs them back to back (the same
captured round graph as the round-per-step engine; the exiting rows' LM head, sampling,
next-token embedding and LAST_EXITED copies stay on the device), and reads the sampled tokens
back once at the end.
Sampling is the engine's own (`sampling.sample_on_device`: greedy or drawn, top-k / top-p,
each row from its own generator, one draw per token), so the result is the round-per-step
engine's: the same rounds through the same decoder in the same order, the same draws; tests
compare them token for token. Rows asking for top log-probs (logprobs > 0) take no window.

Planned ahead: before reading window k back, while the device runs it, the host plans and
uploads window k + 1 for the rows window k will leave, at their end states; plan() runs it only
if the running rows and states turn out exactly those (_key), else it schedules afresh.

A row that reaches its length limit inside a window sits out the window's remaining steps as a
padding row (no K/V write, nothing sampled); the window ends early only when every row has.
A row that stops at EOS or a stop token inside a window keeps computing to the window's end;
its later tokens are dropped (at most `round_window` rounds).

Admission: with mixed depths, rows finish one by one. A window is never cut short for them, so
waiting requests are admitted at window boundaries: all that fit, together, as soon as a slot
is free, and their prefills share the next few round steps. Ending a window at every finish
instead (one-round windows, a prefill in nearly every step) lost ~1.2 s of a 19 s closed loop,
and waiting for a quarter of the slots left a long tail of part-empty steps (~4.6 s).

Prefill first (ExecutionConfig.prefill_first, the default): while any row prefills, or waiting
requests can be admitted, each step is a prefill step with every decode row held (Scheduler.
schedule's hold), so an admitted prompt runs all its rounds back to back and the windows between
run every decode row. Without it, the admitted requests' prefill steps are ordinary round steps
in which every decode row also runs one round, one host round trip per round: in a W4 closed
loop the rows of the first wave finish spread out, requests are admitted a few at a time, and
87 such mixed steps carried the prefills (prefill first's gain: docs/results.md E17). Steps
that alternated one window with one prefill round step lost to both on W4 (docs/results.md,
"Negative results").
Which rows compute what is unchanged either way; only when.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from rltlab.engine.exit_policies import FixedDepth
from rltlab.common.device import to_device
from rltlab.engine.round_plan import WindowPlan, schedule
from rltlab.engine.sequence import Sequence, Span
from rltlab.engine.window_io import (ReadBack, accept, may_chain, queue_read_back, read_back,
                                     sample_rows, stopped, upload_index)


@dataclass
class _Prepared:
    """A plan made while the previous window ran, for the rows and states it will most likely
    leave (every row not at its length limit, each at the window's end state)."""
    key: list[tuple[int, int, int, int, int]]   # _key() of the rows it was made for
    plan: WindowPlan
    static: object                               # the StaticDecoder its index layout fits


class RoundWindow:
    def __init__(self, engine, steps: int):
        self.engine, self.steps = engine, steps
        self._prepared: _Prepared | None = None
        self._held = frozenset()   # the decode rows a prefill step holds (prefill_first)
        # windows run, how many of them ran a plan prepared during the previous window, and
        # how many were launched before the previous one was read back (chained)
        self.stats = {"windows": 0, "prepared_used": 0, "chained": 0}

    # ------------------------------------------------------------------------- eligibility
    def plan(self) -> WindowPlan | None:
        """The next window's plan, or None when this step must not take one."""
        eng = self.engine
        prepared, self._prepared = self._prepared, None
        seqs = eng.scheduler.running
        if not eng._whole_tokens.host_may_plan() or not seqs or \
                len(seqs) > eng.config.max_num_batched_tokens:
            return None
        if eng.config.execution.prefill_first:
            decoding = [seq for seq in seqs if seq.output_token_ids]
            if len(decoding) < len(seqs) or self._admit_now():   # a prefill step
                self._held = frozenset(seq.seq_id for seq in decoding)
                return None
        elif self._admit_now():
            return None
        if eng.capture is not None:   # no round capture here: the decode capture takes round steps
            return None
        state = []
        for seq in seqs:   # runs every step the engine takes: stop at the first misfit
            row = self._row_state(seq)
            if row is None:
                return None
            state.append(row)
        # One fixed depth for all: whole tokens (one launch per token) beat round steps.
        if len({d for _, d in state}) == 1 and \
                all(isinstance(eng.policy(s.params.exit_policy), FixedDepth) for s in seqs):
            return None
        if prepared is not None and prepared.static is eng.runner.static and \
                prepared.key == self._key(seqs, state):
            return prepared.plan   # made from exactly these rows and states
        return schedule(eng, list(seqs), state, self.steps)   # a copy: finishing edits sch.running

    @staticmethod
    def _key(seqs, state, grown: list[int] | None = None) -> list[tuple[int, int, int, int, int]]:
        """Everything of the rows that schedule() reads and that changes between windows (their
        block tables, limits and params are fixed while they run); grown as in _schedule."""
        grown = grown or [0] * len(seqs)
        return [(seq.seq_id, done, depth, seq.num_tokens + k, seq.num_output_tokens + k)
                for seq, (done, depth), k in zip(seqs, state, grown)]

    def _prepare_next(self, plan: WindowPlan) -> None:
        """Plan (and upload) the window after `plan` while the device runs it: for the rows
        that do not reach their length limit in it, at its end state. A row that stops at EOS
        or a stop token, an admission or anything else that changes the rows makes plan() see
        another key and schedule afresh."""
        stay = [i for i, seq in enumerate(plan.seqs)
                if seq.num_output_tokens + len(plan.emitted[i]) < seq.max_output_tokens]
        if not stay:
            return
        seqs = [plan.seqs[i] for i in stay]
        state = [(plan.rounds_done[i], plan.depth[i]) for i in stay]
        grown = [len(plan.emitted[i]) for i in stay]
        nxt = schedule(self.engine, seqs, state, self.steps, grown)
        nxt.uploaded = self._to_device(nxt, self.engine.runner.device)
        self._prepared = _Prepared(self._key(seqs, state, grown), nxt, self.engine.runner.static)

    def held(self) -> frozenset[int]:
        """The decode rows a prefill step holds (once: the step takes them)."""
        held, self._held = self._held, frozenset()
        return held

    def _admit_now(self) -> bool:
        """Waiting requests are admitted (no window this step) once they fit: see the module
        docstring."""
        return self.engine.scheduler.can_admit()

    def _row_state(self, seq: Sequence) -> tuple[int, int] | None:
        """(rounds of the pending token done, its depth), or None if the row can't join."""
        p, eng = seq.params, self.engine
        if p.logprobs not in (None, 0):   # top log-probs: read back per token
            return None
        depth = eng._whole_tokens.depth(seq)
        if depth is None:
            return None
        if seq.at_token_boundary:
            return 0, depth
        span = seq.span
        if span is None or span.exit_rounds is not None or span.pending or \
                seq.num_computed != seq.num_tokens - 1 or not seq.output_token_ids:
            return None
        if span.round == 0:
            return 0, depth
        if span.planned_exit is None or span.planned_exit <= span.round:
            return None
        return span.round, span.planned_exit

    # -------------------------------------------------------------------------------- run
    @torch.no_grad()
    def step(self, plan: WindowPlan):
        """Run the plan's round steps back to back, then hand the sampled tokens over; up to
        window_chain windows chained (window_io.py)."""
        eng, runner = self.engine, self.engine.runner
        static, seqs = runner.static, plan.seqs
        eng._failed = {}
        # the rows' pending tokens; a chained window finds its rows' there, sampled on the device
        pending = to_device([seq.output_token_ids[-1] for seq in seqs], torch.int64,
                            runner.device)
        starting = set(plan.starts[0])
        going_on = [i for i in range(len(seqs)) if i not in starting]
        if going_on:   # rows inside a token go on from their last state: one gather, one copy
            static.hidden_in.index_copy_(0, to_device(going_on, torch.int64, runner.device),
                                         torch.cat([seqs[i].span.hidden for i in going_on]))
        sampled = self._launch(plan, pending)
        for chained in itertools.count():
            self._prepare_next(plan)   # host work while the device runs (before the read-back)
            nxt, nxt_sampled = self._prepared, None
            if nxt is not None and may_chain(eng, seqs, len(nxt.plan.seqs), chained):
                self._prepared, nxt = None, nxt.plan
                # the same rows in the same order: each goes on from this window's last round
                static.hidden_in[: len(seqs)].copy_(static.hidden_out[: len(seqs)])
                nxt_sampled = self._launch(nxt, pending)
                self.stats["chained"] += 1
            self._finish_window(plan, sampled, static, leave_states=nxt_sampled is None)
            if nxt_sampled is None:
                break
            plan, sampled = nxt, nxt_sampled
            if stopped(eng, seqs):   # learnt from the read-back: the launched window ends it
                self._finish_window(plan, sampled, static, leave_states=True)
                break
        eng._finish_failed(seqs)
        return eng._drain_outputs()

    def _launch(self, plan: WindowPlan, pending: torch.Tensor) -> ReadBack:
        """Queue the plan's round steps on the device (rows inside a token already in
        hidden_in), and behind them the copy of what they sample to the host."""
        eng, runner = self.engine, self.engine.runner
        static, n = runner.static, len(plan.seqs)
        index, rows, planes = plan.uploaded or self._to_device(plan, runner.device)
        self.stats["windows"] += 1
        self.stats["prepared_used"] += plan.uploaded is not None
        embed = runner.model.model.embed_tokens
        if static.groups is not None:   # rows change planes from step to step: not planned
            static.groups.use(None)
        outs = []
        for s in range(plan.num_steps):
            starts, exits, copy_slots = rows[s]
            static.index.copy_(index[s])
            if len(starts):   # round 1 of a token: its embedding
                static.hidden_in.index_copy_(0, starts, embed(pending.index_select(0, starts)))
            static.launch_round(n)
            if len(exits):
                outs.append(sample_rows(eng, static.hidden_out, pending, exits,
                                        [plan.seqs[i] for i in plan.exits[s]]))
            if len(copy_slots):
                runner.copy_exited(copy_slots, planes[s])
            if s + 1 < plan.num_steps:   # the next round's input: this round's output
                static.hidden_in[:n].copy_(static.hidden_out[:n])
        return queue_read_back(outs)

    @staticmethod
    def _to_device(plan: WindowPlan, device):
        """Every step's indices in three copies -> (static index [steps, ...] int32, per step
        (start rows, exit rows, LAST_EXITED slots) int64 views, per step exit planes int32)."""
        index = upload_index(plan.index, device)
        parts = [part for starts, exits, copies in zip(plan.starts, plan.exits, plan.copies)
                 for part in (starts, exits, [slot for slot, _ in copies])]
        planes = [[rnd - 1 for _, rnd in copies] for copies in plan.copies]
        flat = to_device([i for part in parts for i in part], torch.int64, device)
        views = flat.split([len(part) for part in parts])
        rows = [views[3 * s: 3 * s + 3] for s in range(plan.num_steps)]
        exit_planes = to_device([p for step in planes for p in step], torch.int32, device)
        return index, rows, exit_planes.split([len(step) for step in planes])

    # ------------------------------------------------------------------------ back on host
    def _finish_window(self, plan: WindowPlan, sampled: ReadBack, static,
                       leave_states: bool) -> None:
        """Wait for the window's read-back and hand its tokens over; leave_states: also set
        each row's state at the window's end (num_computed, span), unless a chained window
        already runs on from it (its own finish sets them)."""
        eng = self.engine
        seqs = plan.seqs
        tokens, finite, logps = read_back(sampled)
        # the exits in step order, row order within a step
        order = [i for step in plan.exits for i in step]
        per_row: list[list[int]] = [[] for _ in seqs]
        for flat, i in enumerate(order):
            per_row[i].append(flat)
        # one copy, rows keep views (queued after the window: nothing was queued behind it)
        final_hidden = static.hidden_out[: len(seqs)].clone() if leave_states else None
        for i, seq in enumerate(seqs):
            for j, flat in enumerate(per_row[i]):
                if not accept(eng, seq, tokens[flat], finite[flat], logps[flat],
                              plan.emitted[i][j]):
                    break
            if not leave_states or seq.is_finished or seq.seq_id in eng._failed:
                continue
            position = seq.num_tokens - 1
            seq.num_computed = position
            if plan.rounds_done[i] == 0:
                seq.span = None
            else:
                seq.span = Span(position, 1, None, emits=True, round=plan.rounds_done[i],
                                hidden=final_hidden[i: i + 1],
                                planned_exit=plan.depth[i])
