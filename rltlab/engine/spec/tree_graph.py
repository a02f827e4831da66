"""Tree speculative iterations inside the paged engine, each one device program (issue 16).

`LLMEngine.set_proposer(TreeProposer(heads, tree))` runs, for a single sequence, the
iteration of rltlab.model.tree_spec on the engine's own static decoder (its fused kernels and
paged KV cache) instead of the model's reference modules:

  tree:    node 0 is the pending token x_P; node (r1..rj) is head j's r_j-th candidate at
           position P + j (rltlab.draft_heads.lookahead);
  rows:    every root-to-leaf path is laid out as an ordinary causal run of token rows at
           positions P..P + depth. The first leaf's rows write their K/V in place, into the
           sequence's own slots (what the sequence will keep if that path is accepted; rows
           past it are stale, never read, as in spec_decode's rollback). Every other leaf l
           owns two private KV blocks (reserved from the block manager for the engine's life)
           that stand in for the blocks holding positions P and P + block_size in its rows'
           block tables; the block of P is copied into the first of them first, so a row sees
           the shared prefix, then its own ancestors and nothing else: the tree mask, with the
           engine's paged attention unchanged. Ancestors shared by several leaves are
           recomputed once per leaf (37 rows for the shipped B = 16 tree of 11 leaves): at
           c = 1 a row costs little, a launch a lot;
  verify:  rounds 1..R over all rows (StaticDecoder._round with explicit rows);
  accept:  from the root, follow the child whose token is the target's argmax at its parent,
           at most `cap` deep (the tokens the request may still emit); the argmax at the last
           accepted node is the bonus token, the next pending token. A sampling request (T > 0,
           top-k / top-p) follows the first child that speculative sampling accepts and draws
           the bonus from the residual there (rltlab.engine.spec.tree_program);
  commit:  where the accepted path ends in another leaf than the first, its nodes' K/V (every
           layer and plane) is copied from that leaf's private slots to the sequence's own
           slots P..P + n; rejected branches leave no trace before P + n + 1. A program whose
           rows are all the first leaf's (a chain's heads without the lookup chain's rows)
           copies nothing: no prefix, no commit;
  draft:   the heads read h_R of the last accepted node and the bonus -> the next candidates;
  lookup:  with TreeProposer(lookup=L), a chain of L more nodes from the root carries
           prompt-lookup drafts (rltlab.engine.spec.prompt_lookup) of the sequence's own tokens,
           staged with the indices and extended on the device for the program that follows.
           The tree is then span = max(depth, L) deep. Sibling nodes may carry the same
           token: all of them match, and any accepted path names the same tokens.

Each program runs one iteration and is read back once; up to ExecutionConfig.spec_pipeline
programs run in one engine step, each launched from the last one's state on the device (its
bonus at the position after its path) as soon as the host has read that one back and seen the
sequence go on (rltlab.engine.spec.tree_program). The candidates live on the device between
programs; they stay valid while the sequence's pending token is the one they were drafted for.
Otherwise the first iteration accepts none of the heads' nodes: it verifies the root alone, or
the root and the lookup chain, which needs no earlier draft (with TreeProposer(first_drafts=True)
its program drafts them from the state that sampled the pending token). With
TreeProposer(adaptive_lookup=...) a program without the lookup chain's rows runs except in a
request's first iteration and where the proposer's rule calls for them. With
ExecutionConfig.launch_behind_prompt a request's first program is launched behind its prompt step,
from token 0 still on the device (launch_first), and run() takes it over.
Writes to the sequence's own slots never pass position P + cap <= its last reserved one.
"""
from __future__ import annotations

import torch

from rltlab.engine.sampling import needs_filtering
from rltlab.engine.spec.tree_program import TreeProgram
from rltlab.model.generate import SAMPLING_EPS


def sampling_of(params, vocab: int) -> str | None:
    """A request's acceptance in a tree program: None (greedy: T below SAMPLING_EPS, where
    top-k / top-p keep the argmax), "sample" (T > 0) or "filter" (T > 0 with top-k / top-p)."""
    if params.temperature < SAMPLING_EPS:
        return None
    return "filter" if needs_filtering([params], vocab) else "sample"


class TreeShape:
    """Index tensors of a tree: nodes (root first, parents before children) and the expanded
    rows (each leaf's path from the root)."""

    def __init__(self, paths: list[tuple[int, ...]], device, heads=None):
        """heads: the paths whose candidates the heads draft (default: all of them)."""
        heads = set(paths if heads is None else heads)
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
        self.node_depth, self.node_parent = t(list(map(len, nodes))), t(parent)
        # nodes that only valid candidates may accept: the heads' (a lookup chain's need none)
        self.needs_heads = t([0] + [p in heads for p in paths]).bool()
        self.lookup_node = t([0] + [p not in heads for p in paths]).bool()
        self.lookup_nodes = t([i + 1 for i, p in enumerate(paths) if p not in heads])  # by depth
        # the rows of the heads' leaves, which come first: all that a program without the
        # lookup chain's rows computes (TreeProposer(adaptive_lookup=True))
        heads_leaf = [not (nodes[leaf] and nodes[leaf] not in heads) for leaf in leaves]
        self.heads_rows = sum(heads_leaf[li] for _, li, _ in rows)
        assert all(heads_leaf[li] for _, li, _ in rows[:self.heads_rows])
        self.node_rank = t([p[-1] if p else 0 for p in nodes])
        # the children (node - 1) by sibling rank, rank 0 first: the order in which sampled
        # verification tries a parent's children (tree_sampling.tree_decisions)
        ranks = [p[-1] for p in paths]
        self.sibling_ranks = [t([c for c, r in enumerate(ranks) if r == s])
                              for s in sorted(set(ranks))]
        self.ancestors = ancestors.to(device)            # [N, N]: j is i or an ancestor of i
        self.row_node, self.row_leaf, self.row_depth = (t(list(col)) for col in zip(*rows))
        self.node_row = t([first_row[i] for i in range(len(nodes))])
        self.node_leaf = self.row_leaf[self.node_row]    # a leaf whose path holds the node
        self.first_leaf_rows = sum(li == 0 for _, li, _ in rows)   # they come first


def private_blocks(tree) -> int:
    """KV blocks a TreeProposer, or a tree of rank paths alone, takes out of the engine's pool
    (two per leaf but the first, which writes in place)."""
    paths = tree.paths if hasattr(tree, "paths") else list(tree)
    return 2 * (TreeShape(paths, "cpu").num_leaves - 1)


class TreeGraph:
    """The device program of one TreeProposer on one engine (see the module docstring)."""

    def __init__(self, engine, proposer):
        runner, span = engine.runner, proposer.span
        self.runner, self.proposer, self.block_size = runner, proposer, runner.block_size
        self._weights = engine.weights   # their version: a launch_first program's validity
        if span > self.block_size:
            raise ValueError(f"a tree {span} deep needs block_size >= {span}")
        self.shape = TreeShape(proposer.paths, runner.device, proposer.tree)
        manager = engine.block_manager
        blocks = private_blocks(proposer)
        one_sequence = manager.blocks_needed(engine.max_model_len)
        if manager.num_free_blocks < blocks + one_sequence:
            raise ValueError(
                f"a tree of {self.shape.num_leaves} leaves needs {blocks} private KV blocks "
                f"beside the {one_sequence} of a max_model_len sequence; "
                f"{manager.num_free_blocks} are free. Build the engine with num_blocks >= "
                f"{manager.num_blocks + blocks + one_sequence - manager.num_free_blocks}")
        # [leaves - 1, 2]: the private blocks of leaves 1.. (leaf 0 writes in place)
        self.private = torch.tensor(manager.reserve(blocks) if blocks else [],
                                    dtype=torch.long, device=runner.device).view(-1, 2)
        # the heads' candidates: [span, ranks] token ids (rows past their depth unused),
        # drafted for `drafted_for`
        self.cand_in = torch.zeros(span, proposer.ranks, dtype=torch.long, device=runner.device)
        # with first_drafts: the state that sampled a request's token 0, copied for its program
        self.first_hidden = torch.zeros(1, runner.model.config.hidden_size,
                                        dtype=next(runner.model.parameters()).dtype,
                                        device=runner.device)
        self.drafted_for: tuple[int, int] | None = None   # (seq_id, position of x_P)
        # the heads' nodes an iteration verifies, by its cap (spec_stats.drafted, with the
        # lookup chain's min(lookup, cap) and without the heads' where no candidates are valid)
        self._heads_within = [sum(len(p) <= cap for p in proposer.tree)
                              for cap in range(span + 1)]
        self._static, self._programs = None, {}
        self.lookup_next = True   # with adaptive_lookup: the drafts' rows at drafted_for
        self._early = None        # launch_first's (_early_key, _start's result)

    def _program_of(self, static, follow: bool, lookup_rows: bool = True,
                    first: bool = False, sampling: str | None = None) -> TreeProgram:
        """The program of (follow, lookup_rows, first, sampling); the others share their
        inputs and outputs with (follow, True, False, None), which stages them all."""
        key = (follow, lookup_rows, first, sampling)
        if key not in self._programs:
            lead = None if lookup_rows and not first and sampling is None else \
                self._program_of(static, follow)
            program = TreeProgram(self, static, follow, lookup_rows, lead, first, sampling)
            self._programs[key] = program
        return self._programs[key]

    def run(self, seq, launches: int = 1, stops: frozenset = frozenset()):
        """Up to `launches` programs for `seq` (pending token at num_tokens - 1) ->
        yields per program (accepted path tokens, bonus token, finite flag, nodes verified:
        those within the cap). With launches > 1 each next program starts from the last one's
        bonus and position on the device, launched as soon as the host has read the last one
        back and seen that the sequence goes on (tokens left, no token in `stops`, finite
        logits); the caller handles the yielded results while it runs. The first program is
        the one launch_first launched, where it was launched for this sequence at this
        token."""
        follow = launches > 1
        start, left = seq.num_tokens - 1, seq.max_output_tokens - seq.num_output_tokens
        early, self._early = self._early, None
        if early is not None and early[0] == self._early_key(seq, start, follow):
            programs, program, cap, valid, lookup = early[1]
        else:
            fresh = self.drafted_for != (seq.seq_id, start)   # no candidates drafted for it
            emitted = seq.emit_hidden                           # (output index, state)
            first = fresh and self.proposer.first_drafts and emitted is not None and \
                emitted[0] == seq.num_output_tokens - 1
            programs, program, cap, valid, lookup = self._start(
                seq, follow, start, left, fresh, emitted[1] if first else None,
                seq.output_token_ids[-1])
        current = [program]

        def relaunch(rows: bool) -> None:          # its inputs are on the device already
            current[0] = programs[rows]
            current[0].launch()
        yield from self._results(seq, cap, valid, lookup, launches, stops,
                                 lambda _: current[0].read(), relaunch)

    def _results(self, seq, cap, valid, lookup, launches, stops, read, relaunch):
        """run()'s handling of the programs' outputs: read(i) -> program i's (waiting for
        it); relaunch(lookup rows) launches the next program."""
        depth, adaptive = self.proposer.span, self.proposer.adaptive_lookup
        position, left = seq.num_tokens - 1, seq.max_output_tokens - seq.num_output_tokens
        for launch in range(launches):
            n, *path, bonus, finite, hits = read(launch)
            verified = self._heads_within[cap] * valid + min(self.proposer.lookup, cap) * lookup
            position, left = position + n + 1, left - n - 1
            cap = max(0, min(depth, left - 1))     # the next program's cap
            valid = True                           # and its candidates, drafted by this one
            goes_on = launch + 1 < launches and bool(finite) and left > 0 and \
                stops.isdisjoint(path[:n] + [bonus])
            # adaptive: the next program verifies the lookup chain's drafts only where this one
            # found that the proposer's rule holds (TreeProposer.lookup_rule)
            self.drafted_for, self.lookup_next = (seq.seq_id, position), hits > 0
            if goes_on:
                lookup = not adaptive or self.lookup_next
                relaunch(lookup)
            yield path[:n], bonus, bool(finite), verified
            if not goes_on:
                return

    def launch_first(self, seq, token: torch.Tensor, hidden: torch.Tensor,
                     launches: int) -> None:
        """Launch the program run(seq, launches) starts with before the host has read back
        the request's token 0 (ExecutionConfig.launch_behind_prompt): `token` [1] is on the
        device, sampled from `hidden` (the state first drafts read); seq is as it was before
        the token, so its position is seq.num_tokens. run() takes the program over where the
        sequence went on from that token; otherwise it is dropped unread (its writes land in
        slots the sequence owned, or in the tree's private ones, before any later program's).
        Not after a weight update (its key, _early_key)."""
        start = seq.num_tokens
        first = hidden if self.proposer.first_drafts else None
        self._early = (self._early_key(seq, start, launches > 1), self._start(
            seq, launches > 1, start, seq.max_output_tokens - 1, True, first, token))

    def _early_key(self, seq, start: int, follow: bool) -> tuple:
        """What a launch_first program was made for: the sequence at a position, the program's
        shape and the weights' version (a weight update recomputes the sequence at the same
        position). Its blocks stay its own: a lone sequence is never preempted."""
        return seq.seq_id, start, follow, self._weights.version

    def _start(self, seq, follow: bool, start: int, left: int, fresh: bool, first_hidden,
               token) -> tuple:
        """Stage and launch a request's first program of a run at position `start` with
        `left` tokens to emit -> (programs by lookup rows, the program, cap, candidates
        valid, lookup rows). first_hidden: the state to draft first candidates from (None:
        none); token: the pending token, an int or [1] on the device (then written there,
        in the lookup history too, behind the staged inputs)."""
        static = self.runner.static_rows(self.shape.num_rows)
        if static is not self._static:            # a new (grown) decoder: new buffers, graphs
            self._static, self._programs = static, {}
        adaptive = self.proposer.adaptive_lookup
        sampling, params = sampling_of(seq.params, self.runner.model.config.vocab_size), None
        if sampling is not None:
            p = seq.params
            params = (p.temperature, p.top_k, p.top_p, p.sample_seed(seq.index))
        programs = {rows: self._program_of(static, follow, rows, sampling=sampling)
                    for rows in ((True, False) if adaptive else (True,))}
        first = first_hidden is not None
        if first:
            self.first_hidden.copy_(first_hidden.view(1, -1))
        valid = not fresh or first
        cap = min(self.proposer.span, left - 1) if valid or self.proposer.lookup else 0
        on_device = isinstance(token, torch.Tensor)
        lead = self._program_of(static, follow)   # it stages every program's inputs
        lead.stage(0 if on_device else token, start, left, cap, valid, seq.block_table,
                   seq if self.proposer.lookup else None, params)
        if on_device:
            lead.stage_token(token, start)
        lookup = not adaptive or fresh or self.lookup_next   # the lookup chain's rows
        program = self._program_of(static, follow, first=True, sampling=sampling) if first \
            else programs[lookup]
        program.launch()
        return programs, program, cap, valid, lookup
