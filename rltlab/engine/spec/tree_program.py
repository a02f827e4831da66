"""The device program of a TreeGraph (rltlab.engine.spec.tree_graph): one tree iteration on the
engine's static decoder, staged from the host or following the last program on the device
(ExecutionConfig.spec_pipeline), over all of the tree's rows or the heads' alone
(TreeProposer(adaptive_lookup=True)), its first candidates read from the last program or
drafted from the state that sampled the pending token (TreeProposer(first_drafts=True)); one
CUDA graph each on a GPU. With ExecutionConfig.compile the glue around the rounds (_prepare,
_conclude, _advance, _draft) is torch.compile'd.

A program accepts greedily (a node is accepted where its token is the target's argmax at its
parent) or, for a request that samples (T > 0, with top-k / top-p where `filtering`), by
multi-draft speculative sampling over the tree (rltlab.engine.spec.tree_sampling: each node's
processed target distribution, the heads' and the lookup chain's candidates as point masses,
the walk into the first accepted child, the bonus drawn from the residual where it stops). Its
uniforms are a function of the request's seed and the pending token's position
(counter_uniforms): fresh at every iteration, also in programs that follow on the device, and
reproducible for a seeded request.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rltlab.engine.sampling import process_logits
from rltlab.engine.spec.prompt_lookup import prompt_lookup
from rltlab.engine.spec.draft_program import GraphProgram
from rltlab.engine.spec.tree_sampling import counter_uniforms, stream_offsets, tree_decisions

# index: [pending token, P, tokens left to emit, first cap, candidates valid, top-k, seed |
# block table | lookup history]; the program that follows rewrites the first STATE of them
STATE, HEAD = 5, 7


class TreeProgram(GraphProgram):
    """Buffers and (on CUDA) the captured graph of one iteration."""

    def __init__(self, tree, static, follow: bool = False,
                 lookup_rows: bool = True, lead: TreeProgram | None = None,
                 first: bool = False, sampling: str | None = None):
        """tree: the TreeGraph it runs for (its shape, proposer, private blocks, candidates).
        The program ends by writing its next candidates into tree.cand_in. follow: it also
        writes the other inputs of the program that follows it (the pending token, P, tokens
        left, cap, candidates valid; the lookup history), so that one can be launched without
        staging.
        lookup_rows=False: the rounds skip the lookup chain's rows (its leaf's, which come
        last) and its nodes accept nothing; `lead`, the program with them, lends its buffers.
        first: its candidates are drafted from tree.first_hidden (the state that sampled
        the pending token), not read from cand_in. sampling: None (greedy), "sample" (T > 0)
        or "filter" (T > 0 with top-k / top-p), the request's staged by stage()."""
        if sampling not in (None, "sample", "filter"):
            raise ValueError(f"sampling must be None, 'sample' or 'filter', got {sampling!r}")
        self.tree, self.static, self.follow = tree, static, follow
        self.first_drafts, self.sampling = first, sampling
        shape = tree.shape
        self.lookup_rows, self.rows = lookup_rows, shape.num_rows if lookup_rows else \
            shape.heads_rows
        self._computed = torch.arange(shape.num_rows, device=static.device) < self.rows
        # a sampling program's uniforms: an acceptance per child, a final draw per node
        self._offsets = stream_offsets(2 * shape.node_depth.numel(), static.device)
        # every row it computes is the first leaf's, which writes in place: no private blocks
        self.in_place = self.rows <= shape.first_leaf_rows
        dev, nb = static.device, static.max_blocks
        pin = dev.type == "cuda"
        # int64: [pending token, P, tokens left to emit, first cap, candidates valid, top-k,
        # seed | block table | with a lookup chain, the sequence's tokens by position (nb *
        # block_size) and a slot that takes the writes no position needs]
        self._history_at = HEAD + nb
        self._copied = torch.cuda.Event() if pin else None
        if lead is not None:   # its inputs and outputs are the lead's (which stages them)
            self.index, self._staging, self.out, self._out_host = (
                lead.index, lead._staging, lead.out, lead._out_host)
            self.floats, self._floats_staging = lead.floats, lead._floats_staging
        else:
            size = HEAD + nb + (nb * tree.block_size + 1 if tree.proposer.lookup else 0)
            self.index = torch.zeros(size, dtype=torch.long, device=dev)
            self._staging = torch.zeros(size, dtype=torch.long, pin_memory=pin)
            # fp32: [temperature, top-p] of a sampling request
            self.floats = torch.ones(2, dtype=torch.float32, device=dev)
            self._floats_staging = torch.ones(2, dtype=torch.float32, pin_memory=pin)
            self._staged: tuple[int | None, int] = (None, 0)   # (seq_id, its tokens staged)
            # out: [n | path tokens (span) | bonus | finite | lookup next: whether the next
            # iteration verifies the lookup chain (adaptive_lookup only; "hits": how many of
            # the chain's drafts begin the emitted tokens)]
            self.out = torch.zeros(tree.proposer.span + 4, dtype=torch.long, device=dev)
            # the output's copy on the host, queued right behind the program (pinned on CUDA)
            self._out_host = torch.zeros(self.out.shape, dtype=torch.long, pin_memory=pin)
        # With ExecutionConfig.compile, torch.compile fuses the ~70 small ops around the rounds
        # (indices, block copies, the walk, the commit, the heads, the next program's inputs)
        # as it fuses the rounds' own.
        glue = ("_prepare", "_conclude", "_advance", "_draft")
        for name in glue:
            setattr(self, name, getattr(self, name + "_eager"))
        if static.compiled:
            _allow_recompiles(len(glue))
            for name in glue:
                setattr(self, name, torch.compile(getattr(self, name + "_eager"), dynamic=False))

    def launch(self) -> None:
        super().launch()
        if self._copied is not None:   # the read-back waits for this copy, not for a new one
            self._out_host.copy_(self.out, non_blocking=True)
            self._copied.record()

    def read(self) -> list[int]:
        if self._copied is None:
            return self.out.tolist()
        self._copied.synchronize()
        return self._out_host.tolist()

    def stage(self, token: int, start: int, left: int, cap: int, valid: bool,
              table: list[int], seq=None, params=None) -> None:
        """seq: with a lookup chain, the sequence whose tokens the history holds; a sequence's
        tokens never change, so only those past the ones staged for it last time are written.
        params: (temperature, top-k, top-p, seed) of a sampling request."""
        buf = self._staging.numpy()
        buf[:STATE] = token, start, left, cap, valid
        if params is not None:
            temperature, top_k, top_p, seed = params
            buf[STATE:HEAD] = top_k, seed
            floats = self._floats_staging.numpy()
            floats[:] = temperature, top_p
            self.floats.copy_(self._floats_staging, non_blocking=True)
        buf[HEAD: HEAD + len(table)] = table
        buf[HEAD + len(table): self._history_at] = table[-1]   # never read: positions stay
        if seq is not None:                                 # inside the reservation
            done = self._staged[1] if self._staged[0] == seq.seq_id else 0
            at = self._history_at + done
            buf[at: at + seq.num_tokens - done] = seq.token_ids(done, seq.num_tokens)
            self._staged = (seq.seq_id, seq.num_tokens)
        self.index.copy_(self._staging, non_blocking=True)

    def stage_token(self, token: torch.Tensor, position: int) -> None:
        """The pending token where stage() was given none: `token` [1] on the device, written
        behind stage()'s copy, and into the lookup history at its position."""
        self.index[:1].copy_(token)
        if self.tree.proposer.lookup:
            at = self._history_at + position
            self.index[at: at + 1].copy_(token)

    @torch.no_grad()
    def _program(self) -> None:
        """One iteration (tree_graph's module docstring) -> out. Reads only the staged inputs
        and cand_in (or first_hidden) and rewrites cand_in (a following program its other
        inputs too), so a warm-up run that restores them (_warmup) rewrites the same K/V and
        candidates."""
        token, base, left, cap, valid = (self.index[i: i + 1] for i in range(STATE))
        table = self.index[HEAD: self._history_at]
        history = self.index[self._history_at:] if self.tree.proposer.lookup else None
        cand = self.tree.cand_in
        if self.first_drafts:
            cand = self._draft(self.tree.first_hidden, token)
        st, rows = self.static, self.rows
        x, tokens, first, index, rope = self._prepare(token, base, cap, table, cand, history)
        x = x[:rows]
        for r in range(st.config.num_rounds):
            st._round(rows, plane=r, rows=index, x=x, rope=rope)
            x = st.hidden_out[:rows]
        x = st.hidden_out[:self.tree.shape.num_rows]   # rows past self.rows: not read
        n, bonus, cand, out = self._conclude(x, tokens, base, first, cap, valid, table, history)
        self.out.copy_(out)
        if self.follow:                                    # the next program's inputs
            self.index[:STATE].copy_(self._advance(n, bonus, base, left, valid))
        self.tree.cand_in.copy_(cand)

    def _advance_eager(self, n, bonus, base, left, valid) -> torch.Tensor:
        """The next program's [pending token, P, tokens left, cap, candidates valid] after
        this one accepted n (_conclude has put its tokens into the lookup history)."""
        span = self.tree.proposer.span
        base, left = base + n + 1, left - n - 1
        return torch.cat([bonus, base, left, (left - 1).clamp(0, span), torch.ones_like(valid)])

    def _warmup(self) -> None:
        """The program rewrites its candidates (a following one its other inputs too): undo
        that after each warm-up run."""
        inputs, cand = self.index[:STATE].clone(), self.tree.cand_in.clone()
        self._program()
        self.index[:STATE].copy_(inputs)
        self.tree.cand_in.copy_(cand)

    def _prepare_eager(self, token, pos_p, cap, table, cand, history):
        """The rows' inputs and indices, and the block holding P copied into every leaf's
        first private block -> (embeddings, node tokens, P's table column, the rows'
        (positions, slots, context lengths, block tables), their RoPE (cos, sin): every round
        sits at the same positions)."""
        st, sh, bs = self.static, self.tree.shape, self.tree.block_size
        proposer = self.tree.proposer
        private = self.tree.private
        depths = torch.minimum(sh.row_depth, cap)            # rows past the cap: no write
        positions = pos_p + depths                                            # [rows]
        first = pos_p // bs                                  # the table column of P's block
        if self.in_place:
            tables = table[None].expand(sh.num_rows, -1)
        else:   # leaf l > 0: its private blocks l - 1 in the columns of P and P + bs
            columns = torch.arange(table.numel(), device=table.device)[None]
            own = private[(sh.row_leaf - 1).clamp(min=0)]                    # [rows, 2]
            tables = torch.where(columns == first, own[:, :1],
                                 torch.where(columns == first + 1, own[:, 1:], table[None]))
            tables = torch.where(sh.row_leaf[:, None] == 0, table[None], tables)   # [rows, nb]
            by_block = st.kv_cache.flatten(4)         # [layers, 2, planes, blocks, bs*Hkv*D]
            leaves = private[:, 0]
            sources = table.index_select(0, first.expand(leaves.numel()))
            by_block.index_copy_(3, leaves, by_block.index_select(3, sources))
        blocks = tables.gather(1, (positions // bs)[:, None])[:, 0]
        slots = torch.where(sh.row_depth <= cap, blocks * bs + positions % bs, -1)
        if proposer.lookup:   # the lookup chain's column, rank `ranks`
            drafts = prompt_lookup(history, pos_p, proposer.span, proposer.ngram)
            cand = torch.cat([cand, drafts[:, None]], 1)
        tokens = torch.cat([token, cand[sh.node_depth[1:] - 1, sh.node_rank[1:]]])   # [nodes]
        index = (positions.int(), slots.int(), positions.int() + 1, tables.int())
        return (st.model.model.embed_tokens(tokens[sh.row_node]), tokens, first, index,
                st.rope(positions))

    def _conclude_eager(self, x, tokens, pos_p, first, cap, valid, table, history):
        """h_R of the rows -> the acceptance walk, the commit, the next candidates and, with a
        lookup chain, the emitted tokens in the history: (accepted count [1], bonus [1], next
        candidates, output row)."""
        sh, proposer = self.tree.shape, self.tree.proposer
        logits = self.static.model.lm_head(x).float()
        # the nodes this iteration may accept: within the cap, the heads' only with valid
        # candidates, the lookup chain's only where its rows ran (closed under ancestors)
        active = (sh.node_depth <= cap) & ~(sh.needs_heads & (valid == 0))
        if not self.lookup_rows:
            active = active & ~sh.lookup_node
        if self.sampling is None:
            best = logits.argmax(-1)[sh.node_row]                             # [nodes]
            matched = (tokens == best[sh.node_parent]) | (sh.node_depth == 0)
        else:
            matched, best = self._sampled_walk(logits, tokens, active, pos_p)
        on_path = ~(sh.ancestors & ~matched[None]).any(-1)
        accepted = on_path & active
        n = (sh.node_depth * accepted).max().view(1)
        levels = torch.arange(proposer.span + 1, device=n.device)
        path = (accepted[None] & (sh.node_depth[None] == levels[:, None])).float().argmax(-1)
        last = path.index_select(0, n)                         # the deepest accepted node
        path = torch.where(levels <= n, path, last)
        if not self.in_place:   # the first leaf's accepted K/V is in place already
            self._commit(pos_p, first, table, sh.node_leaf.index_select(0, last), levels,
                         levels <= n)
        bonus = best.index_select(0, last)
        h_last = x.index_select(0, sh.node_row.index_select(0, last))
        if proposer.tree:
            cand = self._draft_eager(h_last, bonus)
        else:                 # a lookup chain alone: nothing for the heads to draft
            cand = self.tree.cand_in
        finite = torch.isfinite(logits).all(-1) | (sh.row_depth > cap) | ~self._computed
        emitted = tokens[path[1:]]
        if history is not None:   # the next lookup reads positions up to its P (a re-run,
            # the capture's warm-up, writes them again, identically)
            _extend(history, pos_p, n, emitted, bonus)
        if proposer.adaptive_lookup:
            lookup_levels = levels[1: 1 + proposer.lookup]
            level_token = torch.where(lookup_levels <= n, emitted[:proposer.lookup], bonus)
            same = (tokens[sh.lookup_nodes] == level_token) & (lookup_levels <= n + 1)
            hits = same.long().cumprod(0).sum().view(1)
            if proposer.lookup_rule == "agree":   # TreeProposer's rule: the next iteration's
                # first draft is the heads' first candidate there, or a hit and a 2+ match
                drafts, matched = prompt_lookup(history, pos_p + n + 1, 1, proposer.ngram, True)
                hits = ((drafts == cand[0, :1]) | (hits > 0) & (matched >= 2)).long()
        else:
            hits = torch.zeros_like(n)
        out = torch.cat([n, emitted, bonus, finite.all().view(1), hits])
        return n, bonus, cand, out

    def _sampled_walk(self, logits, tokens, active, pos_p):
        """Speculative sampling over the tree (module docstring) -> (matched [nodes]: the root
        and each parent's first accepted child, at most one per parent, so that the accepted
        nodes form one path; the token to emit where the walk stops, by node [nodes])."""
        sh = self.tree.shape
        nodes = sh.node_depth.numel()
        top_k = self.index[STATE: STATE + 1].expand(nodes)
        temperature, top_p = (self.floats[i: i + 1].expand(nodes) for i in range(2))
        processed = process_logits(logits[sh.node_row], temperature, top_k, top_p,
                                   filtering=self.sampling == "filter")
        u = counter_uniforms(self.index[STATE + 1: STATE + 2], pos_p, self._offsets)
        parent = sh.node_parent[1:]
        accept, final = tree_decisions(
            processed, torch.zeros(nodes, dtype=torch.bool, device=logits.device), parent,
            tokens[1:], sh.sibling_ranks, u_accept=u[1:nodes], u_final=u[nodes:],
            sampled=True, active=active[1:])
        taken = torch.zeros(nodes, dtype=torch.bool, device=logits.device)
        first = torch.zeros_like(accept)
        for idx in sh.sibling_ranks:   # in sibling order: the walk's first accepted child
            par = parent[idx]
            chosen = accept[idx] & ~taken[par]
            first = first.index_copy(0, idx, chosen)
            taken = taken.index_copy(0, par, taken[par] | chosen)
        return torch.cat([torch.ones_like(first[:1]), first]), final

    def _draft_eager(self, h_last, token) -> torch.Tensor:
        """The heads' candidates [span, ranks] from h_R [1, H] of the row that produced
        `token` [1]."""
        proposer = self.tree.proposer
        drafted = proposer.draft(h_last, token)[0]
        # a chain's one rank: argmax, one reduction where topk sorts (the same token barring
        # exact ties, and any draft keeps decoding exact)
        cand = drafted.argmax(-1, keepdim=True) if proposer.ranks == 1 else \
            drafted.topk(proposer.ranks, -1).indices
        return F.pad(cand, (0, 0, 0, proposer.span - proposer.depth))   # [span, ranks]

    def _commit(self, pos_p, first, table, leaf, levels, keep) -> None:
        """Copy positions P + levels[keep] of `leaf`'s private slots to the sequence's own,
        every layer and plane (the other levels, and every level of leaf 0, which wrote in
        place, copy onto themselves)."""
        bs, st = self.tree.block_size, self.static
        private = self.tree.private.index_select(0, (leaf - 1).clamp(min=0))[0]   # [2]
        positions = pos_p + levels
        column = positions // bs
        source = torch.where(column == first, private[0], private[1]) * bs + positions % bs
        own = table.index_select(0, column.clamp(max=table.numel() - 1)) * bs + positions % bs
        source = torch.where(leaf == 0, own, source)
        target = torch.where(keep, own, source)
        by_slot = st.kv_cache.flatten(3, 4)                 # [layers, 2, planes, slots, Hkv, D]
        by_slot.index_copy_(3, target, by_slot.index_select(3, source))


_glue_programs = 0


def _allow_recompiles(functions: int) -> None:
    """Dynamo keeps one cache per code object, shared by every TreeProgram's glue, whose shapes
    differ by tree and decoder; past config.recompile_limit entries it runs the glue eagerly
    without a word (the 9th program of a bench on, docs/benchmarks/2026-12-04-s17-h200.md).
    So the limit grows with each compiled program (`functions` new cache entries)."""
    global _glue_programs
    _glue_programs += functions
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), _glue_programs))


def _extend(history, base, n, path, bonus) -> None:
    """Write an iteration's accepted tokens (path [span]: levels 1..span, valid to n) and its
    bonus at positions base + 1..base + n + 1 of history; the other levels go to its last slot,
    which no position reads."""
    span = path.numel()
    levels = torch.arange(1, span + 2, device=path.device)
    values = torch.where(levels == n + 1, bonus, torch.cat([path, bonus]))
    at = torch.where(levels <= n + 1, base + levels, history.numel() - 1)
    history.index_copy_(0, at, values)
