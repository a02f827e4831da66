"""Greedy speculative iterations as one device program (one CUDA graph replay on a GPU).

For a batch of greedy (T = 0) sequences on the static decode path, one `run()` does the whole
of rltlab.engine.spec_decode's iteration on the device:

  for i in 0..K:  token_i -> embed -> rounds 1..d (planes 0..d-1, position P + i) -> h_d[i];
                  if i < K: token_{i+1} = argmax draft_logits(h_d[i])
  verify:         the K + 1 positions of every sequence as causal token rows, rounds d+1..R
                  starting from h_d (planes d..R-1) -> argmax of lm_head(h_R), finite flags

and the host reads drafts, the target's argmax and the finite flags back in ONE copy. The
host-driven loop pays a launch and a read-back per draft pass (the draft's argmax picks the next
pass's input); here drafts chain through device tensors, so a whole iteration is one replay.

Rows: sequence j's pass i sits at position P_j + min(i, k_j) with its own cache slot for
i <= k_j and slot -1 beyond (no K/V write, output ignored): k_j <= K caps drafting by the
tokens the sequence may still emit, as in the host loop, so no write leaves the sequence's
admission reservation. Padding rows (bucket > batch) have k = 0 and slot -1 throughout. The
rounds, matmuls and argmaxes are the host loop's, so outputs are token-identical (tests).
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab.engine.hooks import DraftProposer
from rltlab.engine.static_decode import BUCKETS


class GreedySpecGraph:
    """Device programs for greedy speculative iterations, one per (bucket, K)."""

    def __init__(self, runner, proposer: DraftProposer):
        self.runner, self.proposer = runner, proposer
        self._static = None
        self._programs: dict = {}   # (bucket, K) -> _Program

    def run(self, seqs, starts: list[int], ks: list[int], k: int):
        """One iteration for `seqs` (pending token at position starts[j], k_j = ks[j] <= k
        drafts) -> (drafts [k_j] per sequence, target argmax [k_j + 1] per sequence, finite
        flag per sequence); target rows' h_R stay readable through verify_hidden()."""
        bucket = next((b for b in BUCKETS if b >= len(seqs)), len(seqs))
        static = self.runner.static_rows(bucket * (k + 1))
        if static is not self._static:            # a new (grown) decoder: new buffers, graphs
            self._static, self._programs = static, {}
        if (bucket, k) not in self._programs:
            self._programs[bucket, k] = _Program(static, self.proposer, bucket, k)
        self._last = program = self._programs[bucket, k]
        program.stage(seqs, starts, ks, self.runner.block_size)
        flat = program.replay()
        c, width = len(seqs), k + 1
        drafts = [[flat[i * bucket + j] for i in range(ks[j])] for j in range(c)]
        best = flat[k * bucket:]
        finite = best[bucket * width:]
        return (drafts, [best[j * width: j * width + ks[j] + 1] for j in range(c)],
                [bool(finite[j * width]) for j in range(c)])

    def verify_hidden(self, ks: list[int]) -> torch.Tensor:
        """h_R of the last run's target rows, sequence after sequence ([sum(k_j + 1), H])."""
        program, width = self._last, self._last.k + 1
        return torch.cat([program.verify_hidden[j * width: j * width + k + 1]
                          for j, k in enumerate(ks)])


class _Program:
    """Buffers and (on CUDA) the captured graph of one (bucket, K)."""

    def __init__(self, static, proposer: DraftProposer, bucket: int, k: int):
        self.static, self.proposer, self.bucket, self.k = static, proposer, bucket, k
        b, nb, dev = bucket, static.max_blocks, static.device
        # int32 index: [tokens | base positions | caps | slots (K+1 passes x b) | tables b x nb]
        self._sizes = [b, b, b, (k + 1) * b, b * nb]
        size = sum(self._sizes)
        self.index = torch.zeros(size, dtype=torch.int32, device=dev)
        self._staging = torch.zeros(size, dtype=torch.int32, pin_memory=dev.type == "cuda")
        # int64 out: [drafts K x b | target argmax b(K+1) | finite b(K+1)]
        self.out = torch.zeros(k * b + 2 * b * (k + 1), dtype=torch.int64, device=dev)
        self.verify_hidden = torch.zeros(b * (k + 1), static.config.hidden_size,
                                         dtype=static.dtype, device=dev)
        self._views(self._staging.numpy())[3][:] = -1   # no slot before the first stage()
        self._graph = None   # captured at the first replay, after stage(): the capture's
        # warm-up runs write K/V at the staged slots, which must be the real ones

    def _views(self, buf):
        b, k = self.bucket, self.k
        ends = np.cumsum(self._sizes)
        tokens, base, caps, slots, tables = (buf[e - n: e] for e, n in zip(ends, self._sizes))
        return tokens, base, caps, slots.reshape(k + 1, b), tables.reshape(b, self.static.max_blocks)

    def stage(self, seqs, starts, ks, block_size: int) -> None:
        buf = self._staging.numpy()
        tokens, base, caps, slots, tables = self._views(buf)
        c = len(seqs)
        tokens[c:], base[c:], caps[c:], slots[:] = 0, 0, 0, -1
        for j, seq in enumerate(seqs):
            tokens[j], base[j], caps[j] = seq.output_token_ids[-1], starts[j], ks[j]
            table = seq.block_table
            tables[j, : len(table)] = table
            pos = np.arange(starts[j], starts[j] + ks[j] + 1)
            slots[: ks[j] + 1, j] = np.asarray(table)[pos // block_size] * block_size \
                + pos % block_size
        self.index.copy_(self._staging, non_blocking=True)

    def replay(self) -> list[int]:
        if not self.static.cuda_graphs:
            self._program()
        else:
            if self._graph is None:
                self._graph = self.static._capture(self._program)
            self._graph.replay()
        return self.out.tolist()

    @torch.no_grad()
    def _program(self) -> None:
        """Drafts chained on the device, then verification (see the module docstring). Reads
        only the staged index, so running it twice (the capture's warm-up) rewrites the same
        K/V with the same values."""
        st, b, k = self.static, self.bucket, self.k
        model, d, R = st.model, self.proposer.draft_rounds, st.config.num_rounds
        tokens, base, caps, slots, tables = self._views(self.index)
        steps = torch.arange(k + 1, dtype=torch.int32, device=st.device)[:, None]
        positions = base[None] + torch.minimum(steps, caps[None])           # [K+1, b]
        token, h_d, drafts = tokens.long(), [], []
        for i in range(k + 1):
            x = model.model.embed_tokens(token)
            rows = (positions[i], slots[i], positions[i] + 1, tables)
            for r in range(d):
                x = self._round(x, b, r, rows)
            h_d.append(x.clone())
            if i < k:
                token = self.proposer.draft_logits(x, model.lm_head).argmax(-1)
                drafts.append(token)
        n = b * (k + 1)    # verification rows, sequence j's positions at j(K+1)..j(K+1)+K
        pos_v = positions.t().reshape(n)
        rows = (pos_v, slots.t().reshape(n), pos_v + 1, tables.repeat_interleave(k + 1, 0))
        x = torch.stack(h_d, 1).reshape(n, -1)
        for r in range(d, R):
            x = self._round(x, n, r, rows)
        self.verify_hidden.copy_(x)
        logits = model.lm_head(x).float()
        parts = [torch.stack(drafts).flatten()] if drafts else []
        self.out.copy_(torch.cat(parts + [logits.argmax(-1),
                                          torch.isfinite(logits).all(-1).long()]))

    def _round(self, x, n: int, plane: int, rows) -> torch.Tensor:
        self.static.hidden_in[:n].copy_(x)
        self.static._round(n, plane=plane, rows=rows)
        return self.static.hidden_out[:n]
