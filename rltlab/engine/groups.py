"""Shared-prompt groups: the n samples of a request prefill their prompt once (the GRPO shape).

The samples of one request that the scheduler admits together form a `ShareGroup`. Its leader
(the first member still running) prefills the prompt, all R planes, into its own block table;
the others wait. Their block tables start with the leader's blocks that hold only prompt
positions (reference-counted, read-only: nothing writes a prompt position again), followed by
blocks of their own. The block that holds the last prompt positions and the first generated
ones (P % block_size != 0) is the first one the samples would write differently, so each sample
has its own copy of it (copy-on-write at the first divergent block).

When the leader's prompt is final (its num_computed reaches P), in the same step
`fork_followers` copies that partially filled block into every waiting member's own one, marks
their prompt computed, and hands back a row for each that samples its token 0 from the
leader's h_R at position P - 1, with its own generator. From then on every sample is an
ordinary sequence: its own spans, exit decisions, log-probs, stop checks and finish.

Seeds: sample j uses SamplingParams.sample_seed(j) (the request's seed for j = 0), so sample j
of a group equals an n = 1 request with seed = sample_seed(j) (tests/test_engine_groups.py).

Lifecycle: if the leader leaves before its prompt is final (an error, an abort of that one
sample), the next member still running becomes the leader and prefills into its own table
(whose shared blocks nobody has read yet). After a weight update every member forgets its K/V
(`Sequence.reset_computation`); the leader recomputes the prompt into the shared blocks alone
and the others wait for it and copy the partial block again, exactly as at the start.
"""
from __future__ import annotations

import torch

from rltlab.common.device import to_device
from rltlab.engine.sequence import Sequence


class ShareGroup:
    def __init__(self, members: list[Sequence], block_size: int):
        self.members = members
        self.prompt_len = members[0].num_prompt_tokens
        # blocks holding only prompt positions: shared by every member
        self.num_shared_blocks = self.prompt_len // block_size
        # the block of the last prompt positions and the first outputs: each member's own
        self.partial_block = self.num_shared_blocks if self.prompt_len % block_size else None
        for seq in members:
            seq.share = self

    @property
    def leader(self) -> Sequence | None:
        """The member that computes the shared prompt: the first one still running."""
        return next((seq for seq in self.members if not seq.is_finished), None)

    def waits(self, seq: Sequence) -> bool:
        """seq waits for the leader's prompt (it is not scheduled meanwhile)."""
        return seq.num_computed < self.prompt_len and seq is not self.leader


def fork_followers(runner, seqs: list[Sequence], emitting: list) -> list:
    """After a step advanced its spans: the waiting members of every group whose leader ran in
    this step and now has its whole prompt take it over (the copy of the partial block, prompt
    computed). Returns the (sequence, h, exit round) rows of the members that sample their
    first token now, from their leader's emitting row of this step."""
    emitted = {seq.seq_id: (h, depth) for seq, h, depth in emitting}
    src, dst, rows = [], [], []
    for leader in seqs:
        group = leader.share
        if group is None or leader.num_computed < group.prompt_len or group.leader is not leader:
            continue
        for seq in group.members:
            if seq is leader or seq.is_finished or seq.num_computed >= group.prompt_len:
                continue
            if group.partial_block is not None:
                src.append(leader.block_table[group.partial_block])
                dst.append(seq.block_table[group.partial_block])
            seq.num_computed = group.prompt_len
            if not seq.output_token_ids:
                # the leader's prompt became final in this step, so it sampled its token 0 here
                assert leader.seq_id in emitted, "a group leader finished its prompt silently"
                rows.append((seq, *emitted[leader.seq_id]))
    if src:
        copy_blocks(runner.kv_cache, src, dst)
    return rows


def admissible(waiting, running: list[Sequence], max_num_seqs: int, block_manager
               ) -> list[Sequence]:
    """The sequences to admit next (FCFS): the head of `waiting` with the samples of its
    request queued right behind it, all of them (up to max_num_seqs) so that they share one
    prefill, or [] if they do not fit now. With nothing running, as many as fit (the head
    always does: add_request checked it), so a group larger than the engine still runs."""
    if not waiting:
        return []
    head = waiting[0]
    family = []
    for seq in waiting:
        if seq.request is not head.request or len(family) == max_num_seqs:
            break
        family.append(seq)
    shared = head.num_prompt_tokens // block_manager.block_size
    fits = 0
    while fits < min(len(family), max_num_seqs - len(running)) and \
            block_manager.group_blocks_needed(head.reserved_positions, fits + 1, shared) \
            <= block_manager.num_free_blocks:
        fits += 1
    if fits == len(family) or (fits and not running):
        return family[:fits]
    return []


def allocate(family: list[Sequence], block_manager) -> None:
    """Blocks for admitted sequences; two or more samples of one request become a ShareGroup
    (the leader's prompt-only blocks shared, the rest their own)."""
    leader = family[0]
    block_manager.allocate(leader, leader.reserved_positions)
    if len(family) == 1:
        return
    group = ShareGroup(family, block_manager.block_size)
    for seq in family[1:]:
        block_manager.allocate_shared(seq, leader, seq.reserved_positions,
                                      group.num_shared_blocks)


def copy_blocks(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """kv_cache [layers, 2, R, blocks, ...]: block src[i] -> dst[i] in every layer and plane."""
    src_t, dst_t = (to_device(ids, torch.int64, kv_cache.device) for ids in (src, dst))
    kv_cache.index_copy_(3, dst_t, kv_cache.index_select(3, src_t))
