"""Token windows: whole tokens at one host-fixed depth, several per host round trip.

A whole-token step (token_step.py) runs every round of every row's pending token in one launch,
then reads the sampled tokens back: one host round trip per token. While the host reads back,
accepts the tokens and stages the next token's indices, the device idles (at the Ouro-1.4B
shape ~18% of a fixed-depth-4 step at c = 128, ~11% of a token at c = 1).

When every row decodes at the same host-fixed depth, nothing the host learns from a token changes
the next one's schedule: the position, slot and depth of each row's next `token_window` tokens
are known ahead. So `TokenWindow.step()` uploads their indices at once and runs the tokens back
to back: the same captured whole-token graph as the one-token step, then on the device the
LAST_EXITED copies, the LM head, the engine's sampler (`sampling.sample_on_device`: each row's
own generator, one draw per token) and the next token's embedding; the tokens are read back
once. The result is the one-token step's (the same rounds, copies and draws in the same order);
tests compare them token for token.

A row that reaches its length limit sits out the window's remaining tokens as a padding row
(slot -1: no K/V write, nothing sampled); a row that stops at EOS or a stop token computes on to
the window's end and its later tokens are dropped, so a freed slot is refilled when the window
ends. Rows asking for top log-probs (logprobs > 0) take one-token steps. With the decode
capture set (hooks.py) each token's launch also captures its rounds, handed over per token.

Planned ahead: while the device runs window k, before reading it back, the host plans and
uploads window k + 1 for the rows that will still run, at the positions window k leaves them
(as round windows do): planning and the pinned upload were host work between a window's
read-back and the next launch (cProfile, profiler overhead included: ~12 ms of _plan and
pin_memory per W3 window). step() uses the plan only if the rows turn out exactly those, at
those positions (_key), else it plans afresh.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from rltlab.common.device import to_device
from rltlab.engine.sequence import Sequence
from rltlab.engine.window_io import (ReadBack, accept, may_chain, padded_index,
                                     queue_read_back, read_back, sample_rows, stopped,
                                     upload_index)


@dataclass
class WindowPlan:
    """One window's schedule, on the device."""
    key: list[tuple[int, int]]   # _key() of the rows it was made for
    depth: int
    static: object               # the StaticDecoder its index layout fits
    live: list[list[int]]        # per token: the rows that compute and sample in it
    uploaded: tuple              # _upload(): (index [tokens, ...], rows per token) on the device
    ahead: bool                  # planned while the previous window ran
    groups: object = None        # _groups(): the rows' shared-prefix plan, or None


class TokenWindow:
    def __init__(self, engine, tokens: int):
        self.engine, self.tokens = engine, tokens
        self._prepared: WindowPlan | None = None
        self._early = None   # launch_first's (plan, pending tokens, read-back, version)
        # windows run, how many of them ran a plan prepared during the previous window, and
        # how many were launched before the previous one was read back (chained)
        self.stats = {"windows": 0, "prepared_used": 0, "chained": 0}

    def fits(self, seqs: list[Sequence]) -> bool:
        """Every row can take a window (none asks for top log-probs)."""
        return all(seq.params.logprobs in (None, 0) for seq in seqs)

    @staticmethod
    def _key(seqs: list[Sequence], grown: list[int] | None = None) -> list[tuple[int, int]]:
        """What of the rows a plan depends on and changes between windows (their block tables,
        limits and params are fixed while they run); grown: tokens each will have gained."""
        grown = grown or [0] * len(seqs)
        return [(seq.seq_id, seq.num_tokens + k) for seq, k in zip(seqs, grown)]

    def _steps(self, seqs: list[Sequence], depth: int, left: list[int], made: list[int]) -> int:
        """Tokens in this window: at most `tokens`, and only while every row that still
        computes keeps `depth` (a replayed trace may change depth at any token); made: each
        row's output tokens when the window starts."""
        steps = min(self.tokens, max(left))
        depth_of = self.engine._whole_tokens.depth
        for s in range(1, steps):
            if any(s < left[i] and depth_of(seq, made[i] + s) != depth
                   for i, seq in enumerate(seqs)):
                return s
        return steps

    def _plan(self, seqs: list[Sequence], static, depth: int, grown: list[int] | None = None
              ) -> tuple[np.ndarray, list[list[int]]]:
        """Each token step's static index rows and the rows that compute and sample in it;
        grown: tokens each row will have gained by the time the plan runs (default none)."""
        bs, b = self.engine.runner.block_size, static.max_batch
        grown = grown or [0] * len(seqs)
        base = padded_index(static, seqs)
        made = [seq.num_output_tokens + k for seq, k in zip(seqs, grown)]
        left = [seq.max_output_tokens - m for seq, m in zip(seqs, made)]
        steps = self._steps(seqs, depth, left, made)
        index, live = np.tile(base, (steps, 1)), []
        for s in range(steps):
            going = [i for i in range(len(seqs)) if s < left[i]]
            for i in going:
                pos = seqs[i].num_tokens - 1 + grown[i] + s
                table = seqs[i].block_table
                index[s, i], index[s, 3 * b + i] = pos, pos + 1   # plane 0: _token sets planes
                index[s, 2 * b + i] = table[pos // bs] * bs + pos % bs
            live.append(going)
        return index, live

    @staticmethod
    def _groups(static, index: np.ndarray, rows: int):
        """The window's shared-prefix plan (prefix_groups.py; None: no groups) from its first
        token's index: every row at one plane, with its context length and block table."""
        if static.groups is None:
            return None
        b = static.max_batch
        tables = index[0, 4 * b:].reshape(b, -1)[:rows]
        return static.groups.plan(np.zeros(rows, dtype=np.int32),
                                  index[0, 3 * b: 3 * b + rows], tables)

    @staticmethod
    def _upload(index: np.ndarray, live: list[list[int]], device) -> tuple:
        """-> (index [tokens, ...] int32, per token the rows that sample, int64) on the device."""
        rows = to_device([i for going in live for i in going], torch.int64, device).split(
            [len(going) for going in live])
        return upload_index(index, device), rows

    def _prepare_next(self, seqs: list[Sequence], live: list[list[int]], static) -> None:
        """Plan and upload the window after this one while the device runs it: for the rows
        that stay below their length limit, at the positions this window leaves them, at
        their next token's depth. A row that stops at EOS or a stop token, an admission or
        anything else that changes the rows makes step() see another key and plan afresh."""
        made = [0] * len(seqs)   # tokens each row samples in this window
        for going in live:
            for i in going:
                made[i] += 1
        stay = [i for i, seq in enumerate(seqs)
                if seq.num_output_tokens + made[i] < seq.max_output_tokens]
        if not stay:
            return
        seqs, grown = [seqs[i] for i in stay], [made[i] for i in stay]
        # the next window's depth: its first token's, the same for every row (a replayed
        # trace may change it at any token), else no token window comes next
        depths = {self.engine._whole_tokens.depth(seq, seq.num_output_tokens + k)
                  for seq, k in zip(seqs, grown)}
        if len(depths) != 1 or None in depths:
            return
        depth = depths.pop()
        index, nxt_live = self._plan(seqs, static, depth, grown)
        self._prepared = WindowPlan(self._key(seqs, grown), depth, static, nxt_live,
                                    self._upload(index, nxt_live, self.engine.runner.device),
                                    ahead=True, groups=self._groups(static, index, len(seqs)))

    def _take_plan(self, seqs: list[Sequence], static, depth: int) -> WindowPlan:
        """The plan made ahead if it was made for exactly these rows, else a fresh one."""
        prepared, self._prepared = self._prepared, None
        key = self._key(seqs)
        if prepared is not None and prepared.static is static and prepared.depth == depth \
                and prepared.key == key:
            return prepared
        index, live = self._plan(seqs, static, depth)
        return WindowPlan(key, depth, static, live,
                          self._upload(index, live, self.engine.runner.device), ahead=False,
                          groups=self._groups(static, index, len(seqs)))

    @torch.no_grad()
    def step(self, depth: int):
        """Windows of up to `tokens` whole tokens of depth `depth` for every running row, one
        read-back each, up to window_chain of them chained (window_io.py)."""
        eng = self.engine
        seqs = list(eng.scheduler.running)
        eng._failed = {}
        static = eng.runner.static_rows(len(seqs))
        early, self._early = self._early, None
        if early is not None and (early[0].key, early[0].depth, early[0].static, early[3]) == \
                (self._key(seqs), depth, static, eng.weights.version):   # these rows' own
            plan, pending, sampled, _ = early
        else:
            plan = self._take_plan(seqs, static, depth)
            # the rows' pending tokens; a chained window finds its rows' there, sampled on
            # the device
            pending = to_device([seq.output_token_ids[-1] for seq in seqs], torch.int64,
                                eng.runner.device)
            sampled = self._launch(seqs, plan, pending)
        for chained in itertools.count():
            self._prepare_next(seqs, plan.live, plan.static)   # while the device runs
            nxt, nxt_sampled = self._prepared, None
            if nxt is not None and may_chain(eng, seqs, len(nxt.key), chained):
                self._prepared, nxt_sampled = None, self._launch(seqs, nxt, pending)
                self.stats["chained"] += 1
            self._finish(seqs, plan, sampled)
            if nxt_sampled is None:
                break
            plan, sampled = nxt, nxt_sampled
            if stopped(eng, seqs):   # learnt from the read-back: the launched window ends it
                self._finish(seqs, plan, sampled)
                break
        eng._finish_failed(seqs)
        return eng._drain_outputs()

    def launch_first(self, seq: Sequence, token: torch.Tensor, depth: int) -> None:
        """Launch the window step(depth) starts with once the lone row `seq` has its token 0,
        from `token` [1] still on the device (ExecutionConfig.launch_behind_prompt, prompt_step.py;
        plain greedy rows only: a dropped window must not have drawn from a generator). step()
        takes it over where the row went on from that token under the same weights; otherwise
        it is dropped unread, having written K/V only into the row's own reserved slots."""
        static = self.engine.runner.static_rows(1)
        index, live = self._plan([seq], static, depth, grown=[1])
        plan = WindowPlan(self._key([seq], [1]), depth, static, live,
                          self._upload(index, live, self.engine.runner.device), ahead=False,
                          groups=self._groups(static, index, 1))
        pending = token.clone()   # the window's sampling rewrites it
        # beside the plan's key, the weights' version: an update recomputes the row at the
        # same position (its blocks stay its own: a lone sequence is never preempted)
        self._early = (plan, pending, self._launch([seq], plan, pending),
                       self.engine.weights.version)

    def _launch(self, seqs: list[Sequence], plan: WindowPlan, pending: torch.Tensor
                ) -> ReadBack:
        """Queue the plan's tokens on the device, and behind them the copy of what they sample
        to the host."""
        eng, runner = self.engine, self.engine.runner
        self.stats["windows"] += 1
        self.stats["prepared_used"] += plan.ahead
        n, depth, static = len(seqs), plan.depth, plan.static
        (index, rows), live = plan.uploaded, plan.live
        slots = index[:, 2 * static.max_batch: 3 * static.max_batch].long()
        planes = torch.full((n,), depth - 1, dtype=torch.int32, device=runner.device)
        embed = runner.model.model.embed_tokens
        if static.groups is not None:   # the window's rows sharing a prompt (prefix_groups.py)
            static.groups.use(plan.groups)
        capture = eng.capture is not None
        outs = []
        for s, going in enumerate(live):
            static.index.copy_(index[s])
            static.launch_token(n, depth, embed(pending), capture)
            if capture:   # plan.key[i][1]: row i's num_tokens at the window's start
                eng._capture_tokens([seqs[i] for i in going],
                                    [plan.key[i][1] - 1 + s for i in going], depth, rows[s])
            if depth < eng.num_rounds:   # LAST_EXITED: planes depth..R-1 get round depth's K/V
                runner.copy_exited(slots[s].index_select(0, rows[s]), planes[: len(going)])
            outs.append(sample_rows(eng, static.hidden_out, pending, rows[s],
                                    [seqs[i] for i in going]))
        return queue_read_back(outs)

    def _finish(self, seqs: list[Sequence], plan: WindowPlan, sampled: ReadBack) -> None:
        """Wait for the window's read-back and hand its tokens to the engine."""
        eng = self.engine
        tokens, finite, logps = read_back(sampled)
        for flat, i in enumerate(i for going in plan.live for i in going):
            accept(eng, seqs[i], tokens[flat], finite[flat], logps[flat], plan.depth)
        for seq in seqs:   # the last sampled token is pending: every earlier position is final
            seq.num_computed = seq.num_tokens - 1
