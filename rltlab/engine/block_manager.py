"""Paged KV blocks: a free list of block ids shared by every plane.

A block holds block_size consecutive positions of one sequence in every layer and every round
plane (kv_cache[layer, k/v, plane, block, offset]); slot = block * block_size + offset.
A sequence reserves at admission every block it can ever need (prompt + max_tokens - 1
positions: the last sampled token is never fed back), so a running sequence never waits for
memory and nothing is ever preempted. Blocks return to the pool on finish and on abort.
"""
from __future__ import annotations

from collections import deque

import torch

from rltlab.engine.sequence import Sequence


class CapacityError(ValueError):
    """A request that can never fit the KV cache (raised at add_request)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, int] = {}   # block -> seq_id, to catch double frees

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

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
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        needed = self.blocks_needed(num_positions)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self.free_blocks)} free")
        seq.block_table = [self.free_blocks.popleft() for _ in range(needed)]
        seq.block_table_t = torch.tensor(seq.block_table, dtype=torch.long)
        for block in seq.block_table:
            self.owner[block] = seq.seq_id

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            if self.owner.pop(block, None) != seq.seq_id:
                raise RuntimeError(f"block {block} freed by sequence {seq.seq_id} "
                                   "that does not own it")
            self.free_blocks.append(block)
        seq.block_table, seq.block_table_t = [], None
