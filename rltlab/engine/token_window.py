"""Token windows: whole tokens at one host-fixed depth, several per host round trip.

A whole-token step (token_step.py) runs every round of every row's pending token in one launch,
then reads the sampled tokens back: one host round trip per token. While the host reads back,
accepts the tokens and stages the next token's indices, the device idles (at c = 128 on the
H200 a fixed-depth-4 step took 13.5 ms of wall time for 11.1 ms of GPU time; at c = 1 about
0.65 ms of each 5.96 ms token: docs/benchmarks/2026-11-30-engine-h200.md).

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
ends. Rows asking for top log-probs (logprobs > 0) take one-token steps.
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab.common.device import to_device
from rltlab.engine.sequence import Sequence
from rltlab.engine.window_io import accept, padded_index, read_back, sample_rows, upload_index


class TokenWindow:
    def __init__(self, engine, tokens: int):
        self.engine, self.tokens = engine, tokens

    def fits(self, seqs: list[Sequence]) -> bool:
        """Every row can take a window (none asks for top log-probs)."""
        return all(seq.params.logprobs in (None, 0) for seq in seqs)

    def _steps(self, seqs: list[Sequence], depth: int, left: list[int]) -> int:
        """Tokens in this window: at most `tokens`, and only while every row that still
        computes keeps `depth` (a replayed trace may change depth at any token)."""
        steps = min(self.tokens, max(left))
        depth_of = self.engine._whole_tokens.depth
        for s in range(1, steps):
            if any(s < left[i] and depth_of(seq, seq.num_output_tokens + s) != depth
                   for i, seq in enumerate(seqs)):
                return s
        return steps

    def _plan(self, seqs: list[Sequence], static, depth: int
              ) -> tuple[np.ndarray, list[list[int]]]:
        """Each token step's static index rows and the rows that compute and sample in it."""
        bs, b = self.engine.runner.block_size, static.max_batch
        base = padded_index(static, seqs)
        left = [seq.max_output_tokens - seq.num_output_tokens for seq in seqs]
        steps = self._steps(seqs, depth, left)
        index, live = np.tile(base, (steps, 1)), []
        for s in range(steps):
            going = [i for i in range(len(seqs)) if s < left[i]]
            for i in going:
                pos = seqs[i].num_tokens - 1 + s
                table = seqs[i].block_table
                index[s, i], index[s, 3 * b + i] = pos, pos + 1   # plane 0: _token sets planes
                index[s, 2 * b + i] = table[pos // bs] * bs + pos % bs
            live.append(going)
        return index, live

    @torch.no_grad()
    def step(self, depth: int):
        """Up to `tokens` whole tokens of depth `depth` for every running row, one read-back."""
        eng, runner = self.engine, self.engine.runner
        seqs = list(eng.scheduler.running)
        n, device, R = len(seqs), runner.device, eng.num_rounds
        static = runner.static_rows(n)
        eng._failed = {}
        index, live = self._plan(seqs, static, depth)
        index = upload_index(index, device)
        rows = to_device([i for going in live for i in going], torch.int64, device).split(
            [len(going) for going in live])
        slots = index[:, 2 * static.max_batch: 3 * static.max_batch].long()
        planes = torch.full((n,), depth - 1, dtype=torch.int32, device=device)
        pending = to_device([seq.output_token_ids[-1] for seq in seqs], torch.int64, device)
        embed = runner.model.model.embed_tokens
        outs = []   # per step: (tokens, finite, log-probs) of its live rows
        for s, going in enumerate(live):
            static.index.copy_(index[s])
            static.launch_token(n, depth, embed(pending))
            if depth < R:   # LAST_EXITED: planes depth..R-1 get round depth's K/V
                runner.copy_exited(slots[s].index_select(0, rows[s]), planes[: len(going)])
            outs.append(sample_rows(eng, static.hidden_out, pending, rows[s],
                                    [seqs[i] for i in going]))
        tokens, finite, logps = read_back(outs)
        for flat, i in enumerate(i for going in live for i in going):
            accept(eng, seqs[i], tokens[flat], finite[flat], logps[flat], depth)
        for seq in seqs:   # the last sampled token is pending: every earlier position is final
            seq.num_computed = seq.num_tokens - 1
        eng._finish_failed(seqs)
        return eng._drain_outputs()
