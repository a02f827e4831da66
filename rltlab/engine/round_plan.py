"""Planning a round window on the host (rltlab.engine.round_window): which row runs which
round at which position, plane and K/V slot in each of the window's round steps, which rows
start a token (their embedding is the input), which exit and sample, and which LAST_EXITED
copies follow, all known ahead under host-fixed depths."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rltlab.engine.sequence import Sequence
from rltlab.engine.window_io import padded_index


@dataclass
class WindowPlan:
    """Host-side schedule of one window over rows (sequences in running order)."""
    seqs: list[Sequence]
    index: np.ndarray              # int32 [steps, static index size]: StaticDecoder.index per step
    starts: list[list[int]]        # per step: rows whose round 1 starts (embedding input)
    exits: list[list[int]]         # per step: rows that leave and sample
    copies: list[list[tuple[int, int]]]   # per step: (slot, exit round) of LAST_EXITED copies
    emitted: list[list[int]]       # per row: exit rounds of the tokens it samples, in order
    rounds_done: list[int]         # per row: rounds of its current token done at the end
    depth: list[int]               # per row: depth of its current token at the end
    uploaded: tuple | None = None  # its _to_device() tensors when uploaded ahead (_prepare_next)

    @property
    def num_steps(self) -> int:
        return len(self.exits)


def schedule(eng, seqs: list[Sequence], state, steps: int, grown: list[int] | None = None
             ) -> WindowPlan:
    """The plan of up to `steps` round steps for `seqs` at `state` (per row: rounds of its
    pending token done, its depth). grown: tokens each row will have gained by the time the
    plan runs (RoundWindow._prepare_next; default none)."""
    runner = eng.runner
    R, bs = eng.num_rounds, runner.block_size
    static = runner.static_rows(len(seqs))
    n, b = len(seqs), static.max_batch
    done = [k for k, _ in state]
    depth = [d for _, d in state]
    grown = grown or [0] * n
    pos = [seq.num_tokens - 1 + k for seq, k in zip(seqs, grown)]
    count = [seq.num_output_tokens + k for seq, k in zip(seqs, grown)]
    tables = [seq.block_table for seq in seqs]
    base = padded_index(static, seqs)   # rows at their length limit stay padding rows
    live = [count[i] < seq.max_output_tokens for i, seq in enumerate(seqs)]
    rows, starts, exits, copies = [], [], [], []
    emitted: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        going = [i for i in range(n) if live[i]]
        if not going:
            break
        slots = {i: tables[i][pos[i] // bs] * bs + pos[i] % bs for i in going}
        rows.append([(i, pos[i], done[i], slots[i]) for i in going])   # plane = rounds done
        starts.append([i for i in going if done[i] == 0])
        step_exits, step_copies = [], []
        for i in going:
            done[i] += 1
            if done[i] < depth[i]:
                continue
            step_exits.append(i)
            emitted[i].append(depth[i])
            if depth[i] < R:
                step_copies.append((slots[i], depth[i]))
            count[i] += 1
            # at its length limit: a padding row from now on (never past its reservation)
            live[i] = count[i] < seqs[i].max_output_tokens
            pos[i] += 1
            done[i] = 0
            depth[i] = eng._whole_tokens.depth(seqs[i], count[i])
        exits.append(step_exits)
        copies.append(step_copies)
    index = np.tile(base, (len(rows), 1))
    for s, step_rows in enumerate(rows):
        for i, position, plane, slot in step_rows:
            index[s, i], index[s, b + i], index[s, 2 * b + i] = position, plane, slot
            index[s, 3 * b + i] = position + 1
    return WindowPlan(seqs, index, starts, exits, copies, emitted, done, depth)
