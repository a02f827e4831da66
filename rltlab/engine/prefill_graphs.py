"""Small whole-prompt prefill steps replayed as CUDA graphs, padded to bucketed shapes.

A fused prefill step (fused_prefill.py) launches about 10 kernels per layer from the host.
Below ~1K tokens its GPU work is shorter than those launches, so the step is host-bound: at the
Ouro-1.4B shape a step of one to eight 128-token prompts took 9-11 ms eagerly whatever its
size. Closed loops whose rows finish spread
out (exit-policy depths, EOS-terminated lengths) admit the next prompts a few at a time, and
pay that in every round of every admission.

A graph needs a fixed shape, and exact shapes (the prompts' lengths, in order) hardly ever recur
on real prompts. So a step of whole prompts (every chunk from position 0, back to back) is padded
to a bucket:
- each prompt, at its end, to L tokens: the step's longest, rounded up to a power of two (16 at
  least) up to 128, to a multiple of 128 beyond;
- the prompts, to B: a power of two up to 8, a multiple of 8 beyond (as the decode graphs'
  batch buckets);
- B x L tokens at most `max_tokens`, else the step runs eagerly.

Padding changes nothing for the real tokens:
- attention is causal from each prompt's start, so a real token never sees the padding after
  it;
- padding tokens get slot -1, and the K/V write skips them (kernels.rope_write_kv);
- GEMMs and norms are per token.

Per bucket there are static buffers: round inputs, positions (0..L-1 per prompt), planes and
slots. A step scatters its tokens into them, with slot -1 elsewhere, replays the bucket's graph
and gathers its tokens' outputs (a copy, so the next replay cannot overwrite what the engine
keeps).

Fresh whole prompts that run all their rounds in one engine step (prompt_step.py) replay
rounds 1..R as one graph: their bucket's key also holds the number of rounds. From such a
bucket's third step on (it is captured), run_from_ids builds the step from the prompts' token
ids instead: one pinned copy of the padded ids, slots and last rows, the embeddings gathered
straight into the bucket's input rows, and only the prompts' last rows read out.

A bucket's first step runs eagerly, and its second captures the graph (two warm-up runs, then
the replay). Inside graphs, attention takes FlashAttention-2 (SDPA_BACKENDS): cuDNN's per-shape
plans are not captured.

Off CUDA (the tests), the "graph" re-runs the same function on the same buffers, so everything
but the capture itself is what the CPU tests compare against the plain fused prefill.
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab.common.device import tensor_to_device
from rltlab.engine.fused_prefill import (SDPA_BACKENDS, FusedPrefill, bucket, length_bucket,
                                         prompt_slots)
from rltlab.engine.static_decode import capture_graph


# The padded tokens of the largest step that replays, where the engine picks
# (ExecutionConfig.prefill_graph_tokens None): larger steps are not host-bound. The gain on W7:
# docs/results.md E8.
DEFAULT_MAX_TOKENS = 4096


def resolve_max_tokens(max_tokens: int | None, device: torch.device, cuda_graphs: bool) -> int:
    """ExecutionConfig.prefill_graph_tokens -> the PrefillGraphs bound, 0 = off. None: on where CUDA
    graphs run (a CUDA device with cuda_graphs), off elsewhere (off CUDA there is no capture to
    save host time, only padding to pay for)."""
    if max_tokens is not None:
        return max_tokens
    return DEFAULT_MAX_TOKENS if cuda_graphs and device.type == "cuda" else 0


class _Bucket:
    """One (prompts, length, rounds) bucket: static buffers, the replay, its outputs. rounds
    > 1: rounds 1..rounds of fresh whole prompts in one replay (FusedPrefill.run_rounds)."""

    def __init__(self, prefill: FusedPrefill, prompts: int, length: int, rounds: int,
                 hidden: torch.Tensor, pool):
        dev, tokens = hidden.device, prompts * length
        self.hidden = hidden.new_zeros(tokens, hidden.shape[1])
        self.positions = torch.arange(length, device=dev).repeat(prompts)
        self.planes = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
        chunks = [(b * length, length, 0, 0) for b in range(prompts)]
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

        def run():
            if rounds == 1:
                self.outputs = prefill.run(self.hidden, self.positions, self.planes,
                                           self.slots, chunks, None, backends=SDPA_BACKENDS)
            else:
                self.outputs = prefill.run_rounds(self.hidden, self.positions, self.slots,
                                                  chunks, None, rounds, backends=SDPA_BACKENDS)
        self.run = run
        self.replay = None
        self.pool = pool

    def __call__(self, rows: torch.Tensor, hidden, planes, slots):
        """rows: the padded row of each real token; planes: theirs (None for several rounds,
        which start at plane 0); -> the real tokens' (h, gate logits)."""
        self.slots.fill_(-1)
        self.hidden.index_copy_(0, rows, hidden)
        if planes is not None:
            self.planes.index_copy_(0, rows, planes.to(torch.int64))
        self.slots.index_copy_(0, rows, slots.to(torch.int64))
        if self.replay is None:   # the bucket's first replayed step: capture (CUDA) or run
            # the warm-up runs and the capture write the same K/V to the same slots as the
            # replay does
            self.replay = (capture_graph(self.run, self.pool).replay if self.hidden.is_cuda
                           else self.run)
        self.replay()
        return self.outputs[0].index_select(0, rows), self.outputs[1].index_select(0, rows)


class PrefillGraphs:
    """FusedPrefill.run with small whole-prompt steps padded into replayed buckets."""

    def __init__(self, prefill: FusedPrefill, max_tokens: int):
        self.prefill, self.max_tokens = prefill, max_tokens
        self.seen: set[tuple[int, int, int]] = set()   # buckets that ran a step (eagerly)
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}   # (prompts, length, rounds)
        self._pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        # "from ids": replays whose inputs run_from_ids wrote straight into the bucket
        self.stats = {"eager": 0, "replayed": 0, "from ids": 0}
        self._staging = None   # run_from_ids' [ids | slots | last rows], host (pinned) + device

    def run_from_ids(self, seqs, lengths: list[int], block_size: int, embedding: torch.Tensor,
                     rounds: int) -> torch.Tensor | None:
        """Fresh whole prompts' rounds 1..rounds (> 1) from their token ids, where their bucket
        has been captured -> h_R at each prompt's last position [B, H]; else None (the caller
        takes the general path: whole_prompt_inputs, then run_rounds).

        The host writes the bucket's padded token ids, slots (-1 on padding) and the prompts'
        last rows into one pinned buffer, copies it to the device once, gathers the embeddings
        straight into the bucket's input rows and replays it. That is what run_rounds computes
        (an embedding is a gather; padding rows write no K/V and no real row sees them), with
        one copy in place of whole_prompt_inputs' and the bucket's three copies and three
        scatters: at c = 1 the host spent ~400 us a request building a prompt step's inputs
        while the device waited."""
        shape = self._shape(len(seqs), max(lengths))
        # (one-round buckets are the round steps', whose planes vary)
        target = self.buckets.get((*shape, rounds)) if shape and rounds > 1 else None
        if target is None or target.replay is None:
            return None
        length = shape[1]
        tokens = shape[0] * length
        size = 2 * tokens + len(seqs)
        pinned, device, copied = self._staged(size, embedding.device)
        host = pinned.numpy()
        ids, slots, last = host[:tokens], host[tokens: 2 * tokens], host[2 * tokens: size]
        ids[:], slots[:] = 0, -1
        for b, (seq, n) in enumerate(zip(seqs, lengths)):
            lo = b * length
            ids[lo: lo + n] = seq.token_ids(0, n)
            slots[lo: lo + n] = prompt_slots(seq, n, block_size)
            last[b] = lo + n - 1
        staged = device[:size]
        staged.copy_(pinned[:size], non_blocking=True)
        if copied is not None:   # the host buffer is free again once this copy has run
            copied.record()
        torch.index_select(embedding, 0, staged[:tokens], out=target.hidden)
        target.slots.copy_(staged[tokens: 2 * tokens])
        target.replay()
        self.stats["replayed"] += 1
        self.stats["from ids"] += 1
        return target.outputs[0].index_select(0, staged[2 * tokens:])

    def _staged(self, size: int, device: torch.device) -> tuple:
        """run_from_ids' staging, grown to `size` int64 where smaller -> (the host buffer,
        pinned on CUDA, once its last copy has run; the device buffer; the event that copy
        records, None off CUDA)."""
        if self._staging is None or self._staging[1].numel() < size:
            cuda = device.type == "cuda"
            self._staging = (torch.empty(size, dtype=torch.int64, pin_memory=cuda),
                             torch.empty(size, dtype=torch.int64, device=device),
                             torch.cuda.Event() if cuda else None)
        if self._staging[2] is not None:
            self._staging[2].synchronize()   # long done: the last step read token 0 back
        return self._staging

    def bucket_of(self, chunks) -> tuple[int, int] | None:
        """(prompts, length) of the step's bucket, or None if it does not qualify: a chunk not
        from position 0, chunks not back to back, or more than max_tokens padded tokens."""
        end = 0
        for lo, n, _, start in chunks:
            if start or lo != end:
                return None
            end += n
        return self._shape(len(chunks), max(n for _, n, _, _ in chunks))

    def _shape(self, prompts: int, longest: int) -> tuple[int, int] | None:
        """(prompts, length) padded to their bucket, or None past max_tokens padded tokens."""
        key = (bucket(prompts, 1, 8), length_bucket(longest))
        return key if key[0] * key[1] <= self.max_tokens else None

    def run(self, hidden, positions, planes, slots, chunks, tables):
        """FusedPrefill.run's arguments and result."""
        return self._run(hidden, positions, planes, slots, chunks, tables, 1)

    def run_rounds(self, hidden, positions, slots, chunks, tables, rounds: int):
        """FusedPrefill.run_rounds' arguments and result: fresh whole prompts' rounds
        1..rounds, one replay per step from the bucket's second step on."""
        if rounds == 1:   # a one-round model: the round steps' bucket, at plane 0
            return self.run(hidden, positions, torch.zeros_like(positions), slots, chunks,
                            tables)
        return self._run(hidden, positions, None, slots, chunks, tables, rounds)

    def _run(self, hidden, positions, planes, slots, chunks, tables, rounds: int):
        shape = self.bucket_of(chunks) if chunks else None
        key = None if shape is None else (*shape, rounds)
        if key in self.seen:
            if key not in self.buckets:
                self.buckets[key] = _Bucket(self.prefill, *key, hidden, self._pool)
            length = key[1]
            rows = np.concatenate([b * length + np.arange(n)
                                   for b, (_, n, _, _) in enumerate(chunks)])
            rows = tensor_to_device(torch.from_numpy(rows), hidden.device)
            self.stats["replayed"] += 1
            return self.buckets[key](rows, hidden, planes, slots)
        if key is not None:
            self.seen.add(key)
        self.stats["eager"] += 1
        if planes is None:
            return self.prefill.run_rounds(hidden, positions, slots, chunks, tables, rounds)
        return self.prefill.run(hidden, positions, planes, slots, chunks, tables)
