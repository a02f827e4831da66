"""Tree speculative decoding with lookahead heads at c = 1, greedy (issue 16).

One iteration, with the pending token x_P (sampled, not yet in the cache) at position P and
the candidates the heads drafted at the end of the previous iteration:

  tree:    row 0 is x_P; the tree's node (r1..rj) is head j's r_j-th candidate at position
           P + j (rltlab.draft_heads.lookahead). A row attends to the cached prefix (positions
           < P) and to its own ancestors, nothing else (the tree mask);
  verify:  ONE full-depth pass (rounds 1..R, fixed depth R: the target) over all rows;
  accept:  from the root, follow the child whose token is the target's argmax at its parent,
           at most `cap` deep (the tokens the request may still emit); the target's argmax at
           the last accepted row is the bonus token, the next pending token;
  commit:  the accepted rows' K/V of every round go to the cache at positions P..P+n (rows
           past n repeat the last one, into positions that are rewritten before anyone reads
           them); nothing else is written, so rejected branches leave no trace;
  draft:   the heads read h_R of the last accepted row and the bonus token -> the next
           iteration's candidates.

The iteration is one device program (a CUDA graph on a GPU) with one read-back: the accepted
count, the path's tokens and the bonus. The verification pass reuses the model's own modules
(OuroDecoderLayer) over a dense LoopedKVCache, so it is the reference math with a tree mask.

Scope: one request at a time, T = 0 (lossless = the target's own greedy tokens), fixed depth
R; a standalone reference generator beside the paged engine, whose own path is
rltlab.engine.spec.tree_graph.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rltlab.model.architecture import LoopedKVCache, OuroForCausalLM, rope_cos_sin


@dataclass
class TreeStats:
    steps: int = 0        # verification passes (iterations)
    accepted: int = 0     # draft tokens accepted
    emitted: int = 0      # tokens from iterations (accepted + bonus)

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class TreeGeneration:
    token_ids: list[int]
    stats: TreeStats
    seconds: float = 0.0


class _TreeContext:
    """effective_kv for the tree pass: keeps each (round, layer)'s fresh row K/V and returns
    the cached prefix (all columns; the mask hides those >= P) followed by the rows."""

    def __init__(self, cache_k: torch.Tensor, cache_v: torch.Tensor):
        self.cache_k, self.cache_v, self.plane, self.rows = cache_k, cache_v, 0, {}

    def effective_kv(self, layer_idx, k, v):
        self.rows[self.plane, layer_idx] = (k, v)
        return (torch.cat([self.cache_k[self.plane, layer_idx], k], dim=2),
                torch.cat([self.cache_v[self.plane, layer_idx], v], dim=2))


class TreeSpecGenerator:
    def __init__(self, model: OuroForCausalLM, heads, tree, max_len: int,
                 cuda_graph: bool = True, compile: bool = False):
        cfg, param = model.config, next(model.parameters())
        self.model, self.heads, self.max_len = model, heads, max_len
        self.depth = heads.depth
        self.paths = validate_tree(tree, self.depth)
        self.max_rank = max(max(p) for p in self.paths) + 1 if self.paths else 1
        dev = self.device = param.device
        index = {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}
        self.node_depth = torch.tensor([0] + [len(p) for p in self.paths], device=dev)
        self.node_rank = torch.tensor([0] + [p[-1] for p in self.paths], device=dev)
        parent = [0] + [index[p[:-1]] for p in self.paths]
        self.node_parent = torch.tensor(parent, device=dev)
        rows = len(parent)
        anc = torch.eye(rows, dtype=torch.bool)
        for i in range(1, rows):               # paths are sorted by depth: parents come first
            anc[i] |= anc[parent[i]]
        self.ancestors = anc.to(dev)           # [rows, rows]: j is i or one of its ancestors
        self.cache = LoopedKVCache(cfg, 1, max_len, param.dtype, dev)
        # the program's inputs and outputs (fixed buffers: a CUDA graph replays them)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)      # P
        self.root = torch.zeros(1, dtype=torch.long, device=dev)      # x_P
        self.cap = torch.zeros((), dtype=torch.long, device=dev)
        self.cand = torch.zeros(self.depth, self.max_rank, dtype=torch.long, device=dev)
        self.out = torch.zeros(self.depth + 2, dtype=torch.long, device=dev)
        self._graph = None
        self._use_graph = cuda_graph and dev.type == "cuda"
        # torch.compile fuses the reference modules' elementwise work (norms, RoPE, residuals)
        # into a few kernels: at c = 1 the pass is launch-bound, so kernel count is its cost
        self._step = torch.compile(self._iteration, dynamic=False) if compile else self._iteration

    # ------------------------------------------------------------------ the device program
    def _draft(self, h_last: torch.Tensor, bonus: torch.Tensor, bonus_pos: torch.Tensor
               ) -> torch.Tensor:
        """Next candidates [depth, max_rank] from h_R of the row that produced `bonus`."""
        del bonus_pos   # the heads need no position (tests override this with an oracle)
        return self.heads(h_last[None], bonus.view(1))[0].topk(self.max_rank, -1).indices

    def _program(self) -> None:
        self._step(self.pos, self.root, self.cap, self.cand, self.out, self.cache.k,
                   self.cache.v)

    def _iteration(self, pos, root, cap, cand, out, cache_k, cache_v) -> None:
        """One iteration; its inputs and outputs are arguments, so that torch.compile sees
        the in-place writes (cache_k / cache_v, cand, out)."""
        model, cfg, depth = self.model, self.model.config, self.node_depth
        tokens = torch.cat([root, cand[depth[1:] - 1, self.node_rank[1:]]])
        positions = pos + depth
        h = model.model.embed_tokens(tokens)[None]
        cos, sin = rope_cos_sin(positions[None], cfg.head_dim, cfg.rope_theta, h.dtype)
        cos, sin = cos[:, None], sin[:, None]
        prefix = torch.arange(self.max_len, device=self.device) < pos
        mask = torch.cat([prefix.expand(len(tokens), -1), self.ancestors], dim=1)[None, None]
        ctx = _TreeContext(cache_k, cache_v)
        for r in range(cfg.num_rounds):
            ctx.plane, x = r, h
            for idx, layer in enumerate(model.model.layers):
                x = layer(x, cos, sin, mask, ctx, idx)
            h = model.model.norm(x)
        best = model.lm_head(h[0]).argmax(-1)
        matched = (tokens == best[self.node_parent]) | (depth == 0)   # the root is given
        on_path = ~(self.ancestors & ~matched[None]).any(-1)
        accepted = on_path & (depth <= cap)
        n = (depth * accepted).max()
        levels = torch.arange(self.depth + 1, device=self.device)
        at_level = accepted[None] & (depth[None] == levels[:, None])
        rows = at_level.float().argmax(-1)                      # the path's row at each depth
        # index with 1-element tensors, never a 0-d one: that would read n back to the host
        last = rows.index_select(0, n.view(1))
        rows = torch.where(levels <= n, rows, last)
        slots = pos + torch.minimum(levels, cap)
        for (plane, layer), (k, v) in ctx.rows.items():
            cache_k[plane, layer, 0].index_copy_(1, slots, k[0][:, rows])
            cache_v[plane, layer, 0].index_copy_(1, slots, v[0][:, rows])
        bonus = best.index_select(0, last)
        cand.copy_(self._draft(h[0].index_select(0, last)[0], bonus[0], pos + n + 1))
        out.copy_(torch.cat([n.view(1), tokens[rows[1:]], bonus]))

    def _replay(self) -> list[int]:
        if self._use_graph and self._graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            saved = (self.cache.k.clone(), self.cache.v.clone(), self.cand.clone())
            with torch.cuda.stream(stream):
                for _ in range(2):               # warm-up (and compile) outside the capture
                    self._program()
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._program()
            self.cache.k.copy_(saved[0])          # undo the warm-up's writes
            self.cache.v.copy_(saved[1])
            self.cand.copy_(saved[2])
        if self._graph is not None:
            self._graph.replay()
        else:
            self._program()
        return self.out.tolist()

    # ------------------------------------------------------------------ the host loop
    def _check_request(self, prompt, max_tokens, eos_token_id) -> None:
        """One ValueError line naming the argument, before anything runs: a float max_tokens
        would be compared, never reached exactly, and an id past the vocabulary would index
        the embedding out of range."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not prompt:
            raise ValueError("generate needs a non-empty prompt")
        vocab = self.model.config.vocab_size
        bad = next((i for i, t in enumerate(prompt) if not is_int(t) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt[{bad}] = {prompt[bad]!r} is not a token id in "
                             f"[0, vocab_size={vocab})")
        if eos_token_id is not None and (not is_int(eos_token_id)
                                         or not 0 <= eos_token_id < vocab):
            raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab}), "
                             f"got {eos_token_id!r}")

    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, eos_token_id: int | None = None
                 ) -> TreeGeneration:
        self._check_request(prompt, max_tokens, eos_token_id)
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds "
                             f"max_len {self.max_len}")
        started = time.perf_counter()
        cache = self.cache
        cache.length = 0
        cache.key_mask.zero_()
        ids = torch.tensor([prompt], device=self.device)
        out = self.model(ids, cache=cache)
        first = out.final_logits[0, -1].argmax(-1)
        self.cand.copy_(self._draft(out.final_hidden[0, -1], first,
                                    torch.tensor(len(prompt), device=self.device)))
        tokens, stats = [int(first)], TreeStats()
        position = len(prompt)
        while tokens[-1] != eos_token_id and len(tokens) < max_tokens:
            self.pos.fill_(position)
            self.root.fill_(tokens[-1])
            self.cap.fill_(min(self.depth, max_tokens - len(tokens) - 1))
            result = self._replay()
            n = result[0]
            stats.steps, stats.accepted, stats.emitted = (stats.steps + 1, stats.accepted + n,
                                                          stats.emitted + n + 1)
            for token in result[1:1 + n] + [result[-1]]:
                tokens.append(token)
                if token == eos_token_id or len(tokens) == max_tokens:
                    break
            position += n + 1
        return TreeGeneration(tokens, stats, time.perf_counter() - started)


def validate_tree(tree, depth: int) -> list[tuple[int, ...]]:
    """Sorted (by depth, then ranks) list of rank paths; raises on a tree that is not
    prefix-closed, deeper than the heads or with negative ranks."""
    paths = sorted({tuple(int(r) for r in p) for p in tree}, key=lambda p: (len(p), p))
    present = set(paths)
    for p in paths:
        if not 1 <= len(p) <= depth:
            raise ValueError(f"tree path {p}: length must lie in 1..{depth}")
        if min(p) < 0:
            raise ValueError(f"tree path {p}: ranks must be >= 0")
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree path {p}: its prefix {p[:-1]} is missing")
    return paths
