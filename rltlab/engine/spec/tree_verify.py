"""Verification of draft trees from any proposer (rltlab.engine.spec.protocol): the engine's
host-loop speculative path for every request, any temperature, log-probs and c >= 1.

One step, for every running sequence j (pending token x_P at position P, sampled, not yet in
the cache):

  propose:  proposer.propose(states) -> a draft tree per sequence; nodes deeper than the
            tokens it may still emit (less one) are dropped;
  rows:     every root-to-leaf path (leaves in depth-first order, children in index order) is an
            ordinary multi-token span at positions P..P + depth through all R rounds, exactly
            as a prompt chunk is (every position runs full depth). The first leaf's rows write
            into the sequence's own slots; every other leaf runs on a temporary fork: a block
            table that shares the sequence's blocks before the one holding P and continues in
            blocks borrowed for the step (the block holding P copied in first), so a row sees
            the prefix, its own ancestors and nothing else. Shared ancestors are recomputed
            once per leaf. Where too few blocks are free, the last leaves are dropped (the
            tree verified is smaller; still exact);
  verify:   all sequences' rows in one batch: on the static decode path one launch of R rounds
            (StaticDecoder.run_token over explicit rows: one CUDA graph replay per row bucket),
            else R gather-path rounds; then the LM head on each node's row;
  accept:   rltlab.engine.spec.tree_sampling.tree_decisions on the device for every node of
            every tree, one read-back; the host walks each tree from its root into the first
            accepted child (greedy: the target's argmax; sampled: recursive rejection sampling)
            and emits the accepted drafts and the token drawn at the stop;
  commit:   where the accepted path ends in a fork's leaf, its K/V (every layer and plane) is
            copied into the sequence's own slots P + 1..P + n; the forks' blocks go back;
  emit:     tokens with their log-probs (the target's processed or raw distribution at their
            row, as the sampler reports them; one more read-back where asked), stop checks,
            spec_stats; proposer.observe(state, verdict).

Rows past the accepted path in the sequence's own slots hold stale K/V that nothing reads (a
query attends to positions <= its own, and the next token overwrites its slot before it
attends), as in the sequential path's rollback. Writes never pass P + cap, inside the
sequence's admission reservation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rltlab.common.device import to_device
from rltlab.engine.groups import copy_blocks
from rltlab.engine.sampling import needs_filtering, process_logits
from rltlab.engine.sequence import Sequence, Span
from rltlab.engine.spec.protocol import DraftState, DraftTree, Verdict
from rltlab.engine.spec.tree_sampling import tree_decisions

FORK = -2   # the owner id of blocks borrowed for a step's forks (-1: block_manager.RESERVED)


class _LeafView:
    """A sequence as runner.prepare / runner._stage see it for one leaf's rows: a span over
    the leaf's path (positions P..P + depth, each exiting at R), its tokens, a block table."""

    def __init__(self, seq: Sequence, span: Span, tokens: list[int], table: list[int],
                 table_t: torch.Tensor | None = None):
        self._seq, self.span, self._tokens = seq, span, tokens
        self.block_table = table
        self.block_table_t = table_t if table_t is not None else torch.tensor(table,
                                                                              dtype=torch.long)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self._tokens[start - self.span.start: end - self.span.start]

    def __getattr__(self, name):
        return getattr(self._seq, name)


class _Loan:
    """KV blocks borrowed for one step: first from `spare` (blocks reserved for the proposer,
    idle outside its own programs), then from the block manager's free pool; all back at
    give_back()."""

    def __init__(self, manager, spare: list[int]):
        self.manager, self.spare, self.taken, self.pooled = manager, list(spare), [], []

    def take(self, count: int) -> list[int] | None:
        from_spare = min(count, len(self.spare))
        if count - from_spare > self.manager.num_free_blocks:
            return None
        blocks = [self.spare.pop() for _ in range(from_spare)]
        for _ in range(count - from_spare):
            block = self.manager.free_blocks.popleft()
            self.manager.owner[block] = {FORK}
            self.pooled.append(block)
            blocks.append(block)
        self.taken += blocks
        return blocks

    def give_back(self) -> None:
        pooled = set(self.pooled)
        for block in self.pooled:
            del self.manager.owner[block]
            self.manager.free_blocks.append(block)
        self.spare += [b for b in self.taken if b not in pooled]
        self.taken, self.pooled = [], []


@dataclass
class _Plan:
    """One sequence's tree as verified: local node 0 is the root (the pending token), node
    k + 1 the proposed node kept[k]."""
    seq: Sequence
    state: DraftState
    tree: DraftTree | None
    start: int                                           # P
    kept: list[int] = field(default_factory=list)        # proposed node ids, parents first
    parent: list[int] = field(default_factory=list)      # local parent of local node k + 1
    tokens: list[int] = field(default_factory=list)      # local node -> token
    children: list[list[int]] = field(default_factory=list)
    leaves: list[list[int]] = field(default_factory=list)   # local paths from the root
    tables: list[list[int] | None] = field(default_factory=list)  # per leaf (None: own)
    node_row: list[int] = field(default_factory=list)    # local node -> row of the batch
    node_leaf: list[int] = field(default_factory=list)   # local node -> leaf computing it
    base: int = 0                                        # global id of the root
    child_base: int = 0                                  # global child id of node 1


class TreeVerifier:
    """The generic speculative step for one proposer on one engine (module docstring).
    decoder: the engine's SpecDecoder (its _append emits, its _warn warns once per engine);
    spare: KV blocks reserved for the proposer that forks may borrow first."""

    def __init__(self, engine, proposer, decoder, spare: list[int] | None = None):
        self.engine, self.proposer, self.decoder = engine, proposer, decoder
        self.runner = engine.runner
        self.spare = list(spare or [])

    # --------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, seqs: list[Sequence]):
        eng = self.engine
        # rows a sequence may verify: its share of the step's token budget (as a DraftProposer's
        # K is capped), the first leaf whole up to that depth, further leaves while they fit
        self._rows = max(1, eng.config.max_num_batched_tokens // len(seqs))
        states = [self._state(seq) for seq in seqs]
        trees = self.proposer.propose(states)
        if not isinstance(trees, (list, tuple)) or len(trees) != len(states):
            raise ValueError(f"{type(self.proposer).__name__}.propose must return one DraftTree "
                             f"(or None) per state: {len(states)} states, got "
                             f"{type(trees).__name__} of {len(trees) if hasattr(trees, '__len__') else '?'}")
        loan = _Loan(eng.block_manager, self.spare)
        plans = [self._plan(seq, state, tree, loan)
                 for seq, state, tree in zip(seqs, states, trees)]
        try:
            hidden = self._verify(plans)
            results = self._decide(plans, hidden)
            self._commit(plans, results)
        finally:
            loan.give_back()
        self._emit(plans, results, hidden)
        self._logits = self._processed = None   # [nodes, V]: not kept between steps
        return eng._drain_outputs()

    def _state(self, seq: Sequence) -> DraftState:
        emitted = seq.emit_hidden
        hidden = emitted[1] if emitted is not None and \
            emitted[0] == seq.num_output_tokens - 1 else None
        return DraftState(seq.request_id, seq.index, seq.prompt_token_ids + seq.output_token_ids,
                          seq.num_prompt_tokens, seq.params,
                          max(0, min(seq.max_output_tokens - seq.num_output_tokens,
                                     self._rows) - 1), hidden, seq.generator)

    # --------------------------------------------------------------------------- the trees
    def _plan(self, seq: Sequence, state: DraftState, tree: DraftTree | None, loan: _Loan
              ) -> _Plan:
        start = seq.num_tokens - 1
        plan = _Plan(seq, state, tree, start)
        depth = self._check(tree, state) if tree is not None else []
        cap = state.max_depth
        candidates = [i for i, d in enumerate(depth) if d <= cap]
        children: dict[int, list[int]] = {-1: []}
        for i in candidates:
            children.setdefault(tree.parents[i], []).append(i)
            children[i] = []
        paths, stack = [], [(-1, [])]
        while stack:                                  # depth first, children in index order
            node, path = stack.pop()
            kids = children[node]
            if not kids:
                paths.append(path)
            stack += [(kid, path + [kid]) for kid in reversed(kids)]
        bs = self.runner.block_size
        first_block = start // bs
        leaves, tables, copies = [paths[0]], [None], []
        rows = len(paths[0]) + 1
        for path in paths[1:]:                         # forks: blocks borrowed for the step
            rows += len(path) + 1
            if rows > self._rows:
                break
            fresh = (start + len(path)) // bs - first_block + 1
            blocks = loan.take(fresh)
            if blocks is None:
                self.decoder._warn("blocks", "speculation verifies smaller trees: too few free "
                                   "KV blocks for the forks of a draft tree's other branches "
                                   "(build the engine with more num_blocks / "
                                   "kv_cache_memory_gib)")
                break
            leaves.append(path)
            tables.append(seq.block_table[:first_block] + blocks)
            if start % bs:
                copies.append((seq.block_table[first_block], blocks[0]))
        if copies:
            copy_blocks(self.runner.kv_cache, [s for s, _ in copies], [d for _, d in copies])
        plan.kept = sorted({i for path in leaves for i in path})
        local = {-1: 0, **{i: k + 1 for k, i in enumerate(plan.kept)}}
        plan.parent = [local[tree.parents[i]] for i in plan.kept]
        plan.tokens = [seq.output_token_ids[-1]] + [tree.tokens[i] for i in plan.kept]
        plan.children = [[] for _ in plan.tokens]
        for k, par in enumerate(plan.parent):
            plan.children[par].append(k + 1)
        plan.leaves = [[0] + [local[i] for i in path] for path in leaves]
        plan.tables = tables
        return plan

    def _check(self, tree: DraftTree, state: DraftState) -> list[int]:
        """A proposed tree's node depths (1 = after the pending token); a malformed tree is a
        ValueError naming the proposer."""
        name = type(self.proposer).__name__
        if not isinstance(tree, DraftTree):
            raise ValueError(f"{name}.propose returned {type(tree).__name__} for request "
                             f"{state.request_id!r}; expected a DraftTree or None")
        tokens, parents, vocab = tree.tokens, tree.parents, self.engine.model_config.vocab_size
        if len(tokens) != len(parents):
            raise ValueError(f"{name}: a DraftTree with {len(tokens)} tokens and "
                             f"{len(parents)} parents")
        depth = []
        for i, (tok, par) in enumerate(zip(tokens, parents)):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(f"{name}: DraftTree token {i} = {tok!r} is not an int id in "
                                 f"[0, {vocab})")
            if isinstance(par, bool) or not isinstance(par, int) or not -1 <= par < i:
                raise ValueError(f"{name}: DraftTree parent {i} = {par!r}; a parent is -1 (the "
                                 "pending token) or an earlier node's index")
            depth.append(1 if par < 0 else depth[par] + 1)
        if tree.q is not None and (not isinstance(tree.q, torch.Tensor)
                                   or tuple(tree.q.shape) != (len(tokens), vocab)):
            raise ValueError(f"{name}: DraftTree.q must be a [{len(tokens)}, {vocab}] tensor "
                             f"(one draft distribution per node), got "
                             f"{getattr(tree.q, 'shape', type(tree.q).__name__)}")
        return depth

    # ------------------------------------------------------------------------- verification
    def _verify(self, plans: list[_Plan]) -> torch.Tensor:
        """Every leaf's rows through rounds 1..R -> h_R [rows, H] (rows: leaves in order)."""
        views, row = [], 0
        for plan in plans:
            seq = plan.seq
            plan.node_row = [-1] * len(plan.tokens)
            plan.node_leaf = [-1] * len(plan.tokens)
            for li, (path, table) in enumerate(zip(plan.leaves, plan.tables)):
                span = Span(plan.start, len(path), torch.full((len(path),), self.engine.num_rounds),
                            True)
                tokens = [plan.tokens[k] for k in path]
                views.append(_LeafView(seq, span, tokens, seq.block_table, seq.block_table_t)
                             if table is None else _LeafView(seq, span, tokens, table))
                for j, k in enumerate(path):
                    if plan.node_row[k] < 0:
                        plan.node_row[k], plan.node_leaf[k] = row + j, li
                row += len(path)
        runner, rounds = self.runner, self.engine.num_rounds
        if runner.static is not None:
            rows = [(v, v.span.start + i, 0) for v in views for i in range(v.span.length)]
            runner._stage(rows)   # grows the static decoder where the rows need it
            ids = to_device([t for v in views for t in v._tokens], torch.int64, runner.device)
            return runner.static.run_token(runner.model.model.embed_tokens(ids), rounds)
        batch = runner.prepare(views)
        for _ in range(rounds):
            hidden, _ = runner.run_round(batch)
            batch = replace(batch, hidden=hidden, rounds=batch.rounds + 1,
                            row_planes=batch.row_planes + 1)
        return hidden

    def _decide(self, plans: list[_Plan], hidden: torch.Tensor) -> list[tuple]:
        """Device decisions for every node, one read-back, the host walks -> per plan
        (accepted local nodes, next token, finite)."""
        dev, vocab = self.runner.device, self.engine.model_config.vocab_size
        node_rows, params_of, greedy = [], [], []
        parent, token, rank, q_index, q_rows = [], [], [], [], []
        u_parts, sampled_any, q_count = [], False, 0
        for plan in plans:
            plan.base, plan.child_base = len(node_rows), len(parent)
            p = plan.seq.params
            node_rows += plan.node_row
            params_of += [p] * len(plan.tokens)
            is_greedy = p.temperature == 0
            greedy += [is_greedy] * len(plan.tokens)
            q = plan.tree.q if plan.tree is not None and not is_greedy else None
            if q is not None and plan.kept:
                q_base, q_count = q_count, q_count + len(plan.kept)
                q_rows.append(q.index_select(0, to_device(plan.kept, torch.int64, q.device))
                              .to(dev, torch.float32))
            for k, par in enumerate(plan.parent):
                parent.append(plan.base + par)
                token.append(plan.tokens[k + 1])
                rank.append(plan.children[par].index(k + 1))
                q_index.append(q_base + k if q is not None else -1)
            if not is_greedy:
                sampled_any = True
                gen = plan.seq.generator
                u = torch.rand(len(plan.parent) + len(plan.tokens), generator=gen,
                               device=gen.device).to(dev)
            else:
                u = torch.zeros(len(plan.parent) + len(plan.tokens), device=dev)
            u_parts.append(u)
        logits = self.runner.logits(hidden.index_select(0, to_device(node_rows, torch.int64, dev)))
        finite = torch.isfinite(logits).all(-1)
        logits = torch.where(finite[:, None], logits, torch.zeros((), device=dev))
        filtering = needs_filtering(params_of, vocab)
        if filtering or sampled_any:
            processed = process_logits(
                logits, to_device([p.temperature for p in params_of], torch.float32, dev),
                to_device([p.top_k for p in params_of], torch.int64, dev),
                to_device([p.top_p for p in params_of], torch.float32, dev), filtering)
        else:
            processed = logits
        self._logits, self._processed = logits, processed
        parent_t = to_device(parent, torch.int64, dev)
        token_t = to_device(token, torch.int64, dev)
        ranks = [to_device([c for c, r in enumerate(rank) if r == s], torch.int64, dev)
                 for s in range(max(rank, default=-1) + 1)]
        q_t = torch.cat(q_rows) if q_rows else None
        u_accept = u_final = None
        if sampled_any:   # per plan: its children's uniforms, then its nodes'
            u_accept = torch.cat([u[:len(plan.parent)] for u, plan in zip(u_parts, plans)])
            u_final = torch.cat([u[len(plan.parent):] for u, plan in zip(u_parts, plans)])
        accept, final = tree_decisions(
            processed, to_device(greedy, torch.bool, dev), parent_t, token_t, ranks, q_t,
            to_device(q_index, torch.int64, dev) if q_t is not None else None, u_accept, u_final,
            sampled=sampled_any)
        flat = torch.cat([accept.long(), final, finite.long()]).tolist()
        n_child, n_node = len(parent), len(node_rows)
        accepted, finals, finites = flat[:n_child], flat[n_child: n_child + n_node], \
            flat[n_child + n_node:]
        results = []
        for plan in plans:
            ok = lambda k: bool(finites[plan.base + k])   # noqa: E731
            forced = plan.tree.replay_accept if plan.tree is not None else None
            path, node = [], 0
            if forced is not None:
                local = {i: k + 1 for k, i in enumerate(plan.kept)}
                for i in forced:
                    k = local.get(i)
                    if k is None or plan.parent[k - 1] != node:
                        break
                    path.append(k)
                    node = k
            else:
                while ok(node):
                    nxt = next((c for c in plan.children[node]
                                if accepted[plan.child_base + c - 1]), None)
                    if nxt is None:
                        break
                    path.append(nxt)
                    node = nxt
            finite_path = ok(0) and all(map(ok, path))
            results.append((path, finals[plan.base + node], finite_path))
        return results

    def _commit(self, plans: list[_Plan], results: list[tuple]) -> None:
        """Accepted paths computed in a fork: their K/V into the sequence's own slots."""
        bs, src, dst = self.runner.block_size, [], []
        for plan, (path, _, finite) in zip(plans, results):
            if not path or not finite:
                continue
            table = plan.tables[plan.node_leaf[path[-1]]]
            if table is None:
                continue
            own = plan.seq.block_table
            for pos in range(plan.start + 1, plan.start + len(path) + 1):
                src.append(table[pos // bs] * bs + pos % bs)
                dst.append(own[pos // bs] * bs + pos % bs)
        if src:
            kv = self.runner.kv_cache
            flat = kv.view(*kv.shape[:3], kv.shape[3] * kv.shape[4], *kv.shape[5:])
            src_t, dst_t = (to_device(s, torch.int64, kv.device) for s in (src, dst))
            flat.index_copy_(3, dst_t, flat.index_select(3, src_t))

    # --------------------------------------------------------------------------- emission
    def _emit(self, plans: list[_Plan], results: list[tuple], hidden: torch.Tensor) -> None:
        eng = self.engine
        logps = self._logprobs(plans, results)
        stops = to_device([plan.node_row[path[-1] if path else 0]
                           for plan, (path, _, _) in zip(plans, results)], torch.int64,
                          hidden.device)
        stop_hidden = hidden.index_select(0, stops)
        for j, (plan, (path, nxt, finite)) in enumerate(zip(plans, results)):
            seq = plan.seq
            if seq.is_finished:
                continue
            if not finite:
                eng._finish(seq, "error", "non-finite logits")
                self.proposer.observe(plan.state, Verdict([], [], len(plan.kept), True))
            else:
                drafts = [plan.tokens[k] for k in path]
                lp, tops = logps[j] if logps[j] is not None else ([None] * (len(path) + 1),) * 2
                appended = self.decoder._append(seq, plan.start, drafts + [nxt], lp, tops,
                                                len(plan.kept), len(path))
                if not seq.is_finished:
                    seq.emit_hidden = (seq.num_output_tokens - 1, stop_hidden[j])
                verdict = Verdict([plan.kept[k - 1] for k in path],
                                  (drafts + [nxt])[:appended], len(plan.kept), seq.is_finished)
                self.proposer.observe(plan.state, verdict)

    def _logprobs(self, plans: list[_Plan], results: list[tuple]) -> list:
        """Per plan ([log-prob per emitted token], [top dict or None]) where its request asks
        for log-probs (else None): the target's distribution at each emitted token's row, raw
        or processed as EngineConfig.logprobs_mode says, one batched read-back."""
        wants = [j for j, plan in enumerate(plans) if plan.seq.params.logprobs is not None
                 and results[j][2]]
        out = [None] * len(plans)
        if not wants:
            return out
        rows, tokens, sizes = [], [], []
        for j in wants:
            plan, (path, nxt, _) = plans[j], results[j]
            nodes = [0] + path
            rows += [plan.base + k for k in nodes]
            tokens += [plan.tokens[k] for k in path] + [nxt]
            sizes.append(len(nodes))
        dev = self._logits.device
        source = self._logits if self.engine.config.logprobs_mode == "raw_logprobs" \
            else self._processed
        logp = torch.log_softmax(source.index_select(0, to_device(rows, torch.int64, dev)), -1)
        chosen = logp.gather(-1, to_device(tokens, torch.int64, dev)[:, None])[:, 0]
        top_k = max(plans[j].seq.params.logprobs for j in wants)
        parts = [chosen.double()]
        if top_k:
            vals, ids = logp.topk(top_k, dim=-1)
            parts += [vals.flatten().double(), ids.flatten().double()]
        flat = torch.cat(parts).tolist()
        n = len(rows)
        vals = flat[n: n + n * top_k]
        ids = flat[n + n * top_k:]
        lo = 0
        for j, size in zip(wants, sizes):
            k = plans[j].seq.params.logprobs
            lp = flat[lo: lo + size]
            tops = [None] * size
            if k:
                tops = [dict(zip(map(int, ids[(lo + i) * top_k: (lo + i) * top_k + k]),
                                 vals[(lo + i) * top_k: (lo + i) * top_k + k]))
                        for i in range(size)]
            out[j] = (lp, tops)
            lo += size
        return out
