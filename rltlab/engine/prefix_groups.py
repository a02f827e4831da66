"""The static decode path's shared-prefix plan (kernels/shared_prefix.py): which decode rows
read a shared prompt's K/V once per group, in fixed device buffers that CUDA graphs read.

A decode step (StaticDecoder.stage) or a token window (token_window.py, while it plans the
window's index, often ahead of it) plans its rows' groups on the host from their planes,
context lengths and block tables: a few numpy comparisons per group, and one small copy only
while some rows are grouped. The plan holds for a whole token window: its rows' tables only
grow and their prompts' blocks stay where they are. Round windows (mixed planes per step) use
none.
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
        self.shared = SharedPrefix(*self._views(self._buffer))   # what the kernels read
        pin = device.type == "cuda"
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._events: list = [None, None]
        self._turn = 0
        self.active = False   # whether the device buffers hold groups the next launches use

    def _views(self, flat):
        b = self.max_batch
        return flat[:b], flat[b: 2 * b], flat[2 * b:].reshape(b, MAX_MEMBERS)

    def plan(self, planes, context_lens, tables: np.ndarray) -> np.ndarray | None:
        """The groups of the rows given (planes / context lengths [n], tables [n, blocks]: their
        first blocks at least as far as their contexts) as a host plan for use(), or None if
        no group forms."""
        host = np.empty(self._buffer.numel(), dtype=np.int32)
        groups = kernels.shared_prefix_plan(np.asarray(planes), np.asarray(context_lens), tables,
                                            self.block_size, *self._views(host))
        return host if groups else None

    def count(self, host: np.ndarray | None) -> int:
        """The groups in a plan from plan() (0 for None)."""
        return 0 if host is None else int((self._views(host)[1] > 0).sum())

    def use(self, host: np.ndarray | None) -> None:
        """The next launches use this plan (None: no groups); its copy to the device is queued
        behind the work already queued."""
        self.active = host is not None
        if not self.active:
            return
        turn, self._turn = self._turn, 1 - self._turn
        if self._events[turn] is not None:
            self._events[turn].synchronize()   # that buffer's last copy must be done
        self._staging[turn].numpy()[:] = host
        self._buffer.copy_(self._staging[turn], non_blocking=True)
        if self.device.type == "cuda":
            self._events[turn] = torch.cuda.Event()
            self._events[turn].record()
