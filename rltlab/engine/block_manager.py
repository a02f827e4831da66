"""Paged KV blocks: a free list of block ids shared by every plane, reference-counted.

A block holds block_size consecutive positions of one sequence in every layer and every round
plane (kv_cache[layer, k/v, plane, block, offset]); slot = block * block_size + offset.
A sequence reserves at admission every block it can ever need (prompt + max_tokens - 1
positions: the last sampled token is never fed back), so a running sequence never waits for
memory and nothing is ever preempted.

The samples of one request admitted together (rltlab.engine.groups) share the blocks that hold
only prompt positions: several sequences then hold one block, and it returns to the pool when
the last of them lets go. Blocks return on finish and on abort, each exactly once.
"""
from __future__ import annotations

from collections import deque

import torch

from rltlab.engine.sequence import Sequence


RESERVED = -1   # the owner id of reserved blocks (sequence ids are >= 0)


class CapacityError(ValueError):
    """A request that can never fit the KV cache (raised at add_request)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        # block -> ids of the sequences holding it (several for a group's shared prompt
        # blocks); a block is in here exactly while it is out of the free list
        self.owner: dict[int, set[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def group_blocks_needed(self, num_positions: int, num_seqs: int, num_shared: int) -> int:
        """Blocks for num_seqs sequences of num_positions each that share their first
        num_shared blocks."""
        needed = self.blocks_needed(num_positions)
        return needed + (num_seqs - 1) * (needed - num_shared)

    def check_fits(self, num_positions: int, what: str) -> None:
        needed = self.blocks_needed(num_positions)
        if needed > self.num_blocks:
            raise CapacityError(
                f"{what} needs {num_positions} KV positions = {needed} blocks of "
                f"{self.block_size}, but the cache holds only {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_size} positions); shorten the prompt, lower "
                "max_tokens, or build the engine with more num_blocks / kv_cache_memory_gib")

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_needed(num_positions) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_positions: int) -> None:
        self.allocate_shared(seq, None, num_positions, 0)

    def allocate_shared(self, seq: Sequence, source: Sequence | None, num_positions: int,
                        num_shared: int) -> None:
        """Give seq the blocks for num_positions: the first num_shared are source's (held by
        both from now on), the rest come from the free list."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        needed = self.blocks_needed(num_positions)
        assert 0 <= num_shared <= needed and (source is not None or num_shared == 0)
        shared = source.block_table[:num_shared] if num_shared else []
        assert len(shared) == num_shared, "the source does not hold the blocks to share"
        if needed - num_shared > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {needed - num_shared}, "
                               f"{len(self.free_blocks)} free")
        fresh = [self.free_blocks.popleft() for _ in range(needed - num_shared)]
        for block in shared:
            self.owner[block].add(seq.seq_id)
        for block in fresh:
            self.owner[block] = {seq.seq_id}
        seq.block_table = shared + fresh
        seq.block_table_t = torch.tensor(seq.block_table, dtype=torch.long)

    def reserve(self, count: int) -> list[int]:
        """Take `count` blocks out of the pool for good (scratch space of the engine's own, e.g.
        rltlab.engine.spec.tree_graph's private blocks); they never return, and requests are
        checked against the blocks left."""
        if not 0 < count <= len(self.free_blocks):
            raise RuntimeError(f"cannot reserve {count} KV blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(count)]
        self.num_blocks -= count
        for block in blocks:
            self.owner[block] = {RESERVED}
        return blocks

    def free(self, seq: Sequence) -> None:
        """Let go of seq's blocks; a block returns to the pool when its last holder lets go."""
        for block in seq.block_table:   # check everything before changing anything
            if seq.seq_id not in self.owner.get(block, ()):
                raise RuntimeError(f"block {block} freed by sequence {seq.seq_id} "
                                   "that does not hold it")
        for block in seq.block_table:
            holders = self.owner[block]
            holders.remove(seq.seq_id)
            if not holders:
                del self.owner[block]
                self.free_blocks.append(block)
        seq.block_table, seq.block_table_t = [], None
