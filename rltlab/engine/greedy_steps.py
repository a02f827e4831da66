"""Greedy round windows: each round step with its exits in one captured graph.

A round window (round_window.py) runs its round steps back to back, and every step has work
around the captured round: its index copied in, the starting rows' embeddings gathered and
scattered, and the exiting rows' hidden states gathered, their LM head, their tokens and the
LAST_EXITED copies of their K/V. On the H200, W7's decode phase spent 149 ms of 5.95 s in that
work (half of it the LM head), W6's 48 ms of 8.17 s (one LM head per whole token): CUDA events
around every window and graph, docs/experiments/scripts/w7_gpu_time_h200.py.

When every row of a window is greedy, unfiltered and asks for no log-probs, its tokens are the
argmax of the LM head, the same for every row, so nothing needs a per-row sampler and the whole
step fits one graph of fixed shape per batch bucket: the rows' per-step data becomes masks
(starting rows, LAST_EXITED slots with -1 for none and their planes), uploaded once per window, and
a device-side step counter picks each step's row of it. One step is then one graph replay:
  1. the step's static index and masks, by the counter;
  2. starting rows' input: the embedding of their pending token (others go on from the round
     before);
  3. the round (StaticDecoder._round);
  4. the LM head and greedy_tokens for every row of the bucket (the LM head reads its weights
     once for any number of rows); every row's token becomes its pending token (a row reads
     it only in the step after it exits, to embed it: rows inside a token overwrite theirs
     before that), and every row's token (or -1 where its logits are not all finite) goes to
     the step's output row;
  5. the exiting rows' LAST_EXITED copies; the round's output becomes the next round's input.
The host reads the exiting rows' entries back once per window, as before.

Rows keep their own results: the round and the LM head are the same computations as the
per-step path, over all rows of the bucket instead of the gathered exiting ones (tests compare
the two windows and the round-per-step engine token for token).

Capturing a graph runs its function twice first (compilation, autotuning); a step is not
idempotent (it advances the counter, the pending tokens and the round's input), so the capture
restores those buffers after each warm-up run. The K/V it writes are the same values each time.
"""
from __future__ import annotations

import torch

from rltlab import kernels
from rltlab.engine.sampling import SAMPLING_EPS, needs_filtering
from rltlab.engine.sequence import Sequence


def all_greedy(engine, seqs: list[Sequence]) -> bool:
    """Whether every row is greedy, unfiltered (no top-k / top-p) and asks for no log-probs."""
    params = [seq.params for seq in seqs]
    return all(p.temperature < SAMPLING_EPS and p.logprobs is None for p in params) and \
        not needs_filtering(params, engine.model_config.vocab_size)


class GreedySteps:
    """The static buffers and per-bucket graphs of greedy round steps on one StaticDecoder."""

    STARTS, COPY_SLOTS, COPY_PLANES = range(3)

    def __init__(self, runner, static, max_steps: int):
        self.runner, self.static, self.max_steps = runner, static, max_steps
        b, device = static.max_batch, static.device
        self.index = torch.zeros((max_steps, static.index.numel()), dtype=torch.int32,
                                 device=device)
        self.masks = torch.zeros((max_steps, 3, b), dtype=torch.int32, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)   # the step counter
        self.pending = torch.zeros(b, dtype=torch.int64, device=device)
        self.out = torch.zeros((max_steps, b), dtype=torch.int64, device=device)
        self._greedy = kernels.greedy_tokens if runner._use_triton else \
            kernels.greedy_tokens_ref
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    # --------------------------------------------------------------------------------- host
    def masks_of(self, plan) -> torch.Tensor:
        """The plan's per-step masks, int32 [steps, 3, max_batch], on the host."""
        b = self.static.max_batch
        masks = torch.zeros((plan.num_steps, 3, b), dtype=torch.int32)
        masks[:, self.COPY_SLOTS] = -1
        for s in range(plan.num_steps):
            masks[s, self.STARTS, plan.starts[s]] = 1
            row_of = {int(plan.index[s, 2 * b + i]): i for i in plan.exits[s]}   # by K/V slot
            for slot, rnd in plan.copies[s]:
                masks[s, self.COPY_SLOTS, row_of[slot]] = slot
                masks[s, self.COPY_PLANES, row_of[slot]] = rnd - 1
        return masks

    # ------------------------------------------------------------------------------- device
    def launch(self, index: torch.Tensor, masks: torch.Tensor, pending: torch.Tensor,
               n: int, steps: int) -> None:
        """Queue `steps` greedy round steps of the first n rows: index [steps, index size] and
        masks [steps, 3, max_batch] on the device; pending [n] the rows' pending tokens (updated
        in place at the end)."""
        self.index[:steps].copy_(index)
        self.masks[:steps].copy_(masks)
        self.pending[:n].copy_(pending[:n])
        self.step.zero_()
        bucket = self.static._bucket(n)
        for _ in range(steps):
            self._replay(bucket)
        pending[:n].copy_(self.pending[:n])

    def tokens(self, flat: torch.Tensor):
        """(tokens, finite, NaN log-probs) at flat = step * max_batch + row, in that order."""
        picked = self.out.view(-1).index_select(0, flat)
        finite = picked >= 0
        return picked.clamp(min=0), finite, torch.full(picked.shape, float("nan"),
                                                      device=picked.device)

    def _replay(self, bucket: int) -> None:
        if not self.static.cuda_graphs:
            self._step(bucket)
            return
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        self._graphs[bucket].replay()

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        static = self.static
        state = (static.hidden_in, self.pending, self.step)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up: compile / autotune outside the capture
            for _ in range(2):
                self._step(bucket)
                for t, s in zip(state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=static._pool):
            self._step(bucket)
        return graph

    @torch.no_grad()
    def _step(self, b: int) -> None:
        static, runner = self.static, self.runner
        s = self.step
        static.index.copy_(self.index.index_select(0, s)[0])
        masks = self.masks.index_select(0, s)[0, :, :b]
        pending = self.pending[:b]
        embedded = runner.model.model.embed_tokens(pending)
        starts = masks[self.STARTS].bool()[:, None]
        static.hidden_in[:b].copy_(torch.where(starts, embedded, static.hidden_in[:b]))
        static._round(b)
        tokens, finite = self._greedy(runner.model.lm_head(static.hidden_out[:b]))
        pending.copy_(tokens)
        self.out[:, :b].index_copy_(0, s, torch.where(finite, tokens, -1)[None])
        runner.copy_exited(masks[self.COPY_SLOTS].long(), masks[self.COPY_PLANES])
        static.hidden_in[:b].copy_(static.hidden_out[:b])
        s.add_(1)
