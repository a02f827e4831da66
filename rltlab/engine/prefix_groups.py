"""The static decode path's shared-prefix plan (kernels/shared_prefix.py): which decode rows
read a shared prompt's K/V once per group, in fixed device buffers that CUDA graphs read.

A decode step (StaticDecoder.stage) or a token window (token_window.py) plans its rows' groups on
the host from their planes, context lengths and block tables: a few numpy comparisons per
group, and one small copy only while some rows are grouped. The plan holds for a whole token
window: its rows' tables only grow and their prompts' blocks stay where they are. Round windows
(mixed planes per step) clear it.
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab import kernels
from rltlab.kernels import MAX_MEMBERS, SharedPrefix


class PrefixGroups:
    """Device buffers of a SharedPrefix plan for up to max_batch rows, and its staging."""

    def __init__(self, max_batch: int, block_size: int, device: torch.device):
        self.max_batch, self.block_size, self.device = max_batch, block_size, device
        size = max_batch * (2 + MAX_MEMBERS)
        self._buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.plan = SharedPrefix(*self._views(self._buffer))
        pin = device.type == "cuda"
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._events: list = [None, None]
        self._turn = 0
        self.active = False   # whether the device buffers hold groups the next launches use

    def _views(self, flat):
        b = self.max_batch
        return flat[:b], flat[b: 2 * b], flat[2 * b:].reshape(b, MAX_MEMBERS)

    def stage(self, planes, context_lens, tables: np.ndarray) -> int:
        """Plan the groups of the rows given (planes / context lengths [n], tables [n, blocks]:
        their first blocks at least as far as their contexts) and queue the plan's copy to the
        device behind the work already queued. -> the number of groups."""
        turn = self._turn
        if self._events[turn] is not None:
            self._events[turn].synchronize()   # that buffer's last copy must be done
        host = self._staging[turn].numpy()
        groups = kernels.shared_prefix_plan(np.asarray(planes), np.asarray(context_lens), tables,
                                            self.block_size, *self._views(host))
        self.active = groups > 0
        if self.active:
            self._turn = 1 - turn
            self._buffer.copy_(self._staging[turn], non_blocking=True)
            if self.device.type == "cuda":
                self._events[turn] = torch.cuda.Event()
                self._events[turn].record()
        return groups

    def stage_sequences(self, tables: list[list[int]], context_lens: list[int]) -> int:
        """stage() for whole tokens (every row at one plane): the rows' block tables and their
        context lengths at the first token."""
        widest = max(map(len, tables), default=0)
        padded = np.full((len(tables), widest), -1, dtype=np.int64)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        return self.stage(np.zeros(len(tables), dtype=np.int64), context_lens, padded)

    def clear(self) -> None:
        """The next launches use no groups (their rows' planes are not planned)."""
        self.active = False
