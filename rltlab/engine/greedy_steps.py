"""Greedy round windows: each round step with its exits in one captured graph.

A round window (round_window.py) runs its round steps back to back, and every step has work
around the captured round: its index copied in, the starting rows' embeddings gathered and
scattered, and the exiting rows' hidden states gathered, their LM head, their tokens and the
LAST_EXITED copies of their K/V. On the H200, W7's decode phase spent 149 ms of 5.95 s in that
work (half of it the LM head), W6's 48 ms of 8.17 s (one LM head per whole token): CUDA events
around every window and graph, docs/experiments/scripts/w7_gpu_time_h200.py.

When every row of a window is greedy, unfiltered and asks for no log-probs, its tokens are the
argmax of the LM head, the same for every row, so nothing needs a per-row sampler and the whole
step fits one graph of fixed shape: the rows' per-step data becomes masks (starting rows,
LAST_EXITED slots with -1 for none and their planes) and a padded list of the exiting rows,
uploaded once per window, and a device-side step counter picks each step's row of them. One
step is then one graph replay:
  1. the step's static index, masks and exiting rows, by the counter;
  2. starting rows' input: the embedding of their pending token (others go on from the round
     before);
  3. the round (StaticDecoder._round);
  4. the LM head and greedy_tokens over the exiting rows, padded to an exit bucket (the
     padding entries point at a dummy pending slot); their tokens become their pending tokens
     and go, in exit order (-1 where the logits are not all finite), to the step's output row;
  5. the exiting rows' LAST_EXITED copies; the round's output becomes the next round's input.
The host reads the exiting rows' entries back once per window, as before.

A graph is captured per (batch bucket, exit bucket); the exit bucket is the window's largest
exit count, rounded up to StaticDecoder's buckets. A first version ran the LM head over every
row of the batch bucket (one graph per batch bucket): exact on the H200 but no faster, because
the LM head over 128 rows cost what the launches around the round had (~46 rows exit per step
in W7; docs/benchmarks/2026-12-02-s7-h200.md).

Rows keep their own results: the round, the LM head and the argmax are the per-step path's
computations (tests compare the two windows and the round-per-step engine token for token).

Capturing a graph runs its function twice first (compilation, autotuning); a step is not
idempotent (it advances the counter, the pending tokens and the round's input), so the capture
restores those buffers after each warm-up run. The K/V it writes are the same values each time.
"""
from __future__ import annotations

from collections import Counter

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
    """The static buffers and per-(batch, exit) bucket graphs of greedy round steps on one
    StaticDecoder."""

    STARTS, COPY_SLOTS, COPY_PLANES = range(3)

    def __init__(self, runner, static, max_steps: int):
        self.runner, self.static, self.max_steps = runner, static, max_steps
        b, device = static.max_batch, static.device
        self.index = torch.zeros((max_steps, static.index.numel()), dtype=torch.int32,
                                 device=device)
        self.masks = torch.zeros((max_steps, 3, b), dtype=torch.int32, device=device)
        # per step the exiting rows, then padding = b: the dummy slot of `pending`
        self.exits = torch.full((max_steps, b), b, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)   # the step counter
        self.pending = torch.zeros(b + 1, dtype=torch.int64, device=device)
        self.out = torch.zeros((max_steps, b), dtype=torch.int64, device=device)
        self._greedy = kernels.greedy_tokens if runner._use_triton else \
            kernels.greedy_tokens_ref
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.windows = Counter()   # windows launched per (batch bucket, exit bucket)

    # --------------------------------------------------------------------------------- host
    def inputs_of(self, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's per-step masks (int32 [steps, 3, max_batch]) and exiting rows (int64
        [steps, exit bucket], padded with max_batch), on the host."""
        b = self.static.max_batch
        steps = plan.num_steps
        masks = torch.zeros((steps, 3, b), dtype=torch.int32)
        masks[:, self.COPY_SLOTS] = -1
        exits = torch.full((steps, self.exit_bucket(plan)), b, dtype=torch.int64)
        for s in range(steps):
            masks[s, self.STARTS, plan.starts[s]] = 1
            exits[s, : len(plan.exits[s])] = torch.tensor(plan.exits[s], dtype=torch.int64)
            row_of = {int(plan.index[s, 2 * b + i]): i for i in plan.exits[s]}   # by K/V slot
            for slot, rnd in plan.copies[s]:
                masks[s, self.COPY_SLOTS, row_of[slot]] = slot
                masks[s, self.COPY_PLANES, row_of[slot]] = rnd - 1
        return masks, exits

    def exit_bucket(self, plan) -> int:
        return self.static._bucket(max(1, max(len(step) for step in plan.exits)))

    # ------------------------------------------------------------------------------- device
    def launch(self, index: torch.Tensor, masks: torch.Tensor, exits: torch.Tensor,
               pending: torch.Tensor, n: int, steps: int) -> None:
        """Queue `steps` greedy round steps of the first n rows: index [steps, index size],
        masks [steps, 3, max_batch] and exits [steps, exit bucket] on the device (inputs_of);
        pending [n] the rows' pending tokens (updated in place at the end)."""
        e = exits.shape[1]
        self.index[:steps].copy_(index)
        self.masks[:steps].copy_(masks)
        self.exits[:steps, :e].copy_(exits)
        self.pending[:n].copy_(pending[:n])
        self.step.zero_()
        bucket = self.static._bucket(n)
        self.windows[bucket, e] += 1
        for _ in range(steps):
            self._replay(bucket, e)
        pending[:n].copy_(self.pending[:n])

    def tokens(self, flat: torch.Tensor):
        """(tokens, finite, NaN log-probs) at flat = step * max_batch + exit, in that order."""
        picked = self.out.view(-1).index_select(0, flat)
        finite = picked >= 0
        return picked.clamp(min=0), finite, torch.full(picked.shape, float("nan"),
                                                      device=picked.device)

    def _replay(self, bucket: int, exit_bucket: int) -> None:
        if not self.static.cuda_graphs:
            self._step(bucket, exit_bucket)
            return
        key = (bucket, exit_bucket)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, exit_bucket)
        self._graphs[key].replay()

    def _capture(self, bucket: int, exit_bucket: int) -> torch.cuda.CUDAGraph:
        static = self.static
        state = (static.hidden_in, self.pending, self.step)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up: compile / autotune outside the capture
            for _ in range(2):
                self._step(bucket, exit_bucket)
                for t, s in zip(state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=static._pool):
            self._step(bucket, exit_bucket)
        return graph

    @torch.no_grad()
    def _step(self, b: int, e: int) -> None:
        static, runner = self.static, self.runner
        s = self.step
        static.index.copy_(self.index.index_select(0, s)[0])
        masks = self.masks.index_select(0, s)[0, :, :b]
        exits = self.exits.index_select(0, s)[0, :e]
        embedded = runner.model.model.embed_tokens(self.pending[:b])
        starts = masks[self.STARTS].bool()[:, None]
        static.hidden_in[:b].copy_(torch.where(starts, embedded, static.hidden_in[:b]))
        static._round(b)
        # padding entries read row max_batch - 1 and write the dummy pending slot
        hidden = static.hidden_out.index_select(0, exits.clamp(max=static.max_batch - 1))
        tokens, finite = self._greedy(runner.model.lm_head(hidden))
        self.pending.index_copy_(0, exits, tokens)
        self.out[:, :e].index_copy_(0, s, torch.where(finite, tokens, -1)[None])
        runner.copy_exited(masks[self.COPY_SLOTS].long(), masks[self.COPY_PLANES])
        static.hidden_in[:b].copy_(static.hidden_out[:b])
        s.add_(1)
