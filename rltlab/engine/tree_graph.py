"""Tree speculative iterations inside the paged engine, as one device program (issue 16).

`LLMEngine.set_proposer(TreeProposer(heads, tree))` runs, for a single greedy sequence, the
iteration of rltlab.engine.tree_spec on the engine's own static decoder (its fused kernels and
paged KV cache) instead of the model's reference modules:

  tree:    node 0 is the pending token x_P; node (r1..rj) is head j's r_j-th candidate at
           position P + j (rltlab.draft_heads.lookahead);
  rows:    every root-to-leaf path is laid out as an ordinary causal run of token rows at
           positions P..P + depth. Leaf l owns two private KV blocks (reserved from the block
           manager for the engine's life) that stand in for the blocks holding positions P and
           P + block_size in its rows' block tables; the block of P is copied into the first
           of them first, so a row sees the shared prefix, then its own ancestors and nothing
           else: the tree mask, with the engine's paged attention unchanged. Ancestors shared
           by several leaves are recomputed once per leaf (37 rows for the shipped B = 16 tree
           of 11 leaves): at c = 1 a row costs little, a launch a lot;
  verify:  rounds 1..R over all rows (StaticDecoder._round with explicit rows);
  accept:  from the root, follow the child whose token is the target's argmax at its parent,
           at most `cap` deep (the tokens the request may still emit); the argmax at the last
           accepted node is the bonus token, the next pending token;
  commit:  the accepted nodes' K/V (every layer and plane) is copied from one leaf's private
           slots to the sequence's own slots P..P + n; rejected branches leave no trace;
  draft:   the heads read h_R of the last accepted node and the bonus -> the next candidates.

Up to EngineConfig.spec_chain iterations run back to back in one program (each starting from
the last one's bonus at the position after its path) and are read back once. The candidates
live on the device between programs; they stay valid while the sequence's pending token is
the one they were drafted for, and otherwise the first iteration verifies the root alone.
Writes to the sequence's own slots never pass position P + cap <= its last reserved one.
"""
from __future__ import annotations

import torch

from rltlab.engine.spec_graph import GraphProgram


class TreeShape:
    """Index tensors of a tree: nodes (root first, parents before children) and the expanded
    rows (each leaf's path from the root)."""

    def __init__(self, paths: list[tuple[int, ...]], device):
        index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
        nodes = [()] + list(paths)
        parent = [0] + [index[p[:-1]] for p in paths]
        leaves = [i for i, p in enumerate(nodes)
                  if not any(len(q) == len(p) + 1 and q[:-1] == p for q in paths)]
        rows = [(index[nodes[leaf][:j]], li, j) for li, leaf in enumerate(leaves)
                for j in range(len(nodes[leaf]) + 1)]
        first_row = {}
        for r, (node, _, _) in enumerate(rows):
            first_row.setdefault(node, r)
        ancestors = torch.eye(len(nodes), dtype=torch.bool)
        for i in range(1, len(nodes)):
            ancestors[i] |= ancestors[parent[i]]

        def t(values):
            return torch.tensor(values, dtype=torch.long, device=device)
        self.num_leaves, self.num_rows = len(leaves), len(rows)
        self.max_rank = max((p[-1] for p in paths), default=0) + 1
        self.node_depth, self.node_parent = t(list(map(len, nodes))), t(parent)
        self.node_rank = t([p[-1] if p else 0 for p in nodes])
        self.ancestors = ancestors.to(device)            # [N, N]: j is i or an ancestor of i
        self.row_node, self.row_leaf, self.row_depth = (t(list(col)) for col in zip(*rows))
        self.node_row = t([first_row[i] for i in range(len(nodes))])
        self.node_leaf = self.row_leaf[self.node_row]    # a leaf whose path holds the node


def private_blocks(tree) -> int:
    """KV blocks a TreeProposer with this tree takes out of the engine's pool (two per leaf)."""
    return 2 * TreeShape(list(tree), "cpu").num_leaves


class TreeGraph:
    """The device program of one TreeProposer on one engine (see the module docstring)."""

    def __init__(self, engine, proposer):
        runner, depth = engine.runner, proposer.depth
        self.runner, self.proposer, self.block_size = runner, proposer, runner.block_size
        if depth > self.block_size:
            raise ValueError(f"a tree {depth} deep needs block_size >= {depth}")
        self.shape = TreeShape(proposer.tree, runner.device)
        manager = engine.block_manager
        blocks = private_blocks(proposer.tree)
        one_sequence = manager.blocks_needed(engine.max_model_len)
        if manager.num_free_blocks < blocks + one_sequence:
            raise ValueError(
                f"a tree of {self.shape.num_leaves} leaves needs {blocks} private KV blocks "
                f"beside the {one_sequence} of a max_model_len sequence; "
                f"{manager.num_free_blocks} are free. Build the engine with num_blocks >= "
                f"{manager.num_blocks + blocks + one_sequence - manager.num_free_blocks}")
        self.private = torch.tensor(manager.reserve(blocks), dtype=torch.long,
                                    device=runner.device).view(-1, 2)     # [leaves, 2]
        dev, rank = runner.device, self.shape.max_rank
        # the candidates: [depth, max_rank] token ids, drafted for `drafted_for`
        self.cand_in = torch.zeros(depth, rank, dtype=torch.long, device=dev)
        self.cand_out = torch.zeros_like(self.cand_in)
        self.drafted_for: tuple[int, int] | None = None   # (seq_id, position of x_P)
        # nodes an iteration verifies, by its cap (spec_stats.drafted)
        self._nodes_within = [sum(len(p) <= cap for p in proposer.tree)
                              for cap in range(depth + 1)]
        self._static, self._programs = None, {}

    def run(self, seq, chain: int) -> list[tuple[list[int], int, bool, int] | None]:
        """`chain` iterations for `seq` (greedy, pending token at num_tokens - 1) -> per
        iteration (accepted path tokens, bonus token, finite flag, nodes verified: those
        within the cap), or None where the sequence had no token left to emit."""
        static = self.runner.static_rows(self.shape.num_rows)
        if static is not self._static:            # a new (grown) decoder: new buffers, graphs
            self._static, self._programs = static, {}
        if chain not in self._programs:
            self._programs[chain] = _Program(self, static, chain)
        program = self._programs[chain]
        start, left = seq.num_tokens - 1, seq.max_output_tokens - seq.num_output_tokens
        valid = self.drafted_for == (seq.seq_id, start)
        cap = min(self.proposer.depth, left - 1) if valid else 0
        program.stage(seq.output_token_ids[-1], start, left, cap, seq.block_table)
        flat = program.replay()
        self.cand_in.copy_(self.cand_out)
        depth, results, position = self.proposer.depth, [], start
        for m in range(chain):
            n, *path, bonus, finite, live = flat[m * (depth + 4): (m + 1) * (depth + 4)]
            if not live:
                results.append(None)
                continue
            results.append((path[:n], bonus, bool(finite), self._nodes_within[cap]))
            position, left = position + n + 1, left - n - 1
            cap = max(0, min(depth, left - 1))     # the program's cap for the next iteration
        self.drafted_for = (seq.seq_id, position)
        return results


class _Program(GraphProgram):
    """Buffers and (on CUDA) the captured graph of `chain` iterations."""

    def __init__(self, tree: TreeGraph, static, chain: int):
        self.tree, self.static, self.chain = tree, static, chain
        dev, nb = static.device, static.max_blocks
        pin = dev.type == "cuda"
        # int64: [pending token, P, tokens left to emit, first cap | block table]
        self.index = torch.zeros(4 + nb, dtype=torch.long, device=dev)
        self._staging = torch.zeros(4 + nb, dtype=torch.long, pin_memory=pin)
        # per iteration: [n | path tokens (depth) | bonus | finite | live]
        self.out = torch.zeros(chain * (tree.proposer.depth + 4), dtype=torch.long, device=dev)
        # With EngineConfig.compile, torch.compile fuses the ~70 small ops around the rounds
        # (indices, block copies, the walk, the commit, the heads) as it fuses the rounds' own.
        self._prepare, self._conclude = self._prepare_eager, self._conclude_eager
        if static.compiled:
            self._prepare = torch.compile(self._prepare_eager, dynamic=False)
            self._conclude = torch.compile(self._conclude_eager, dynamic=False)

    def stage(self, token: int, start: int, left: int, cap: int, table: list[int]) -> None:
        buf = self._staging.numpy()
        buf[:4] = token, start, left, cap
        buf[4: 4 + len(table)] = table
        buf[4 + len(table):] = table[-1]   # never read: positions stay inside the reservation
        self.index.copy_(self._staging, non_blocking=True)

    @torch.no_grad()
    def _program(self) -> None:
        """Reads only the staged inputs and cand_in, so running it twice (the capture's
        warm-up) rewrites the same K/V and candidates."""
        token, base, left, cap = (self.index[i: i + 1] for i in range(4))
        table = self.index[4:]
        cand, width = self.tree.cand_in, self.tree.proposer.depth + 4
        for m in range(self.chain):
            n, bonus, cand, out = self._iteration(token, base, left, cap, table, cand)
            self.out[m * width: (m + 1) * width].copy_(out)
            emitted = torch.where(left > 0, n + 1, 0)
            token, base, left = bonus, base + emitted, left - emitted
            cap = torch.minimum(left - 1, torch.full_like(left, self.tree.proposer.depth))
            cap = cap.clamp(min=0)
        self.tree.cand_out.copy_(cand)

    def _iteration(self, token, base, left, cap, table, cand):
        """One iteration -> (accepted count [1], bonus [1], next candidates, output row)."""
        st, rows = self.static, self.tree.shape.num_rows
        x, tokens, pos_p, first, live, index = self._prepare(token, base, left, cap, table, cand)
        for r in range(st.config.num_rounds):
            st.hidden_in[:rows].copy_(x)
            st._round(rows, plane=r, rows=index)
            x = st.hidden_out[:rows]
        return self._conclude(x, tokens, pos_p, first, live, cap, table)

    def _prepare_eager(self, token, base, left, cap, table, cand):
        """The rows' inputs and indices, and the block holding P copied into every leaf's
        first private block -> (embeddings, node tokens, P, P's table column, live, the rows'
        (positions, slots, context lengths, block tables))."""
        st, sh, bs = self.static, self.tree.shape, self.tree.block_size
        private = self.tree.private
        live = left > 0
        pos_p = torch.where(live, base, 0)                                    # [1]
        depths = torch.minimum(sh.row_depth, cap)            # rows past the cap: no write
        positions = pos_p + depths                                            # [rows]
        first = pos_p // bs                                  # the table column of P's block
        columns = torch.arange(table.numel(), device=table.device)[None]
        tables = torch.where(columns == first, private[sh.row_leaf, :1],
                             torch.where(columns == first + 1, private[sh.row_leaf, 1:],
                                         table[None]))                        # [rows, nb]
        blocks = tables.gather(1, (positions // bs)[:, None])[:, 0]
        writes = live & (sh.row_depth <= cap)
        slots = torch.where(writes, blocks * bs + positions % bs, -1)
        by_block = st.kv_cache.flatten(4)             # [layers, 2, planes, blocks, bs*Hkv*D]
        leaves = private[:, 0]
        sources = table.index_select(0, first.expand(leaves.numel()))
        by_block.index_copy_(3, leaves, by_block.index_select(3, sources))
        tokens = torch.cat([token, cand[sh.node_depth[1:] - 1, sh.node_rank[1:]]])   # [nodes]
        index = (positions.int(), slots.int(), positions.int() + 1, tables.int())
        return (st.model.model.embed_tokens(tokens[sh.row_node]), tokens, pos_p, first, live,
                index)

    def _conclude_eager(self, x, tokens, pos_p, first, live, cap, table):
        """h_R of the rows -> the acceptance walk, the commit and the next candidates:
        (accepted count [1], bonus [1], next candidates, output row)."""
        sh = self.tree.shape
        logits = self.static.model.lm_head(x).float()
        best = logits.argmax(-1)[sh.node_row]                                 # [nodes]
        matched = (tokens == best[sh.node_parent]) | (sh.node_depth == 0)
        on_path = ~(sh.ancestors & ~matched[None]).any(-1)
        accepted = on_path & (sh.node_depth <= cap)
        n = (sh.node_depth * accepted).max().view(1)
        levels = torch.arange(self.tree.proposer.depth + 1, device=n.device)
        path = (accepted[None] & (sh.node_depth[None] == levels[:, None])).float().argmax(-1)
        last = path.index_select(0, n)                         # the deepest accepted node
        path = torch.where(levels <= n, path, last)
        self._commit(pos_p, first, table, sh.node_leaf.index_select(0, last), levels,
                     live & (levels <= n))
        bonus = best.index_select(0, last)
        h_last = x.index_select(0, sh.node_row.index_select(0, last))
        cand = self.tree.proposer.draft(h_last, bonus)[0].topk(sh.max_rank, -1).indices
        finite = torch.isfinite(logits).all(-1) | (sh.row_depth > cap)
        out = torch.cat([n, tokens[path[1:]], bonus, finite.all().view(1), live])
        return n, bonus, cand, out

    def _commit(self, pos_p, first, table, leaf, levels, keep) -> None:
        """Copy positions P + levels[keep] of `leaf`'s private slots to the sequence's own,
        every layer and plane (the other levels copy onto themselves)."""
        bs, private, st = self.tree.block_size, self.tree.private, self.static
        positions = pos_p + levels
        column = positions // bs
        source = torch.where(column == first, private[leaf, 0], private[leaf, 1])
        source = source * bs + positions % bs
        own = table.index_select(0, column.clamp(max=table.numel() - 1)) * bs + positions % bs
        target = torch.where(keep, own, source)
        by_slot = st.kv_cache.flatten(3, 4)                 # [layers, 2, planes, slots, Hkv, D]
        by_slot.index_copy_(3, target, by_slot.index_select(3, source))
