"""A TreeProposer's drafts as a Proposer (rltlab.engine.spec.protocol), for the generic tree
verifier (rltlab.engine.spec.tree_verify): what serves a TreeProposer's requests that its
device program does not (T > 0, top-k / top-p, log-probs, c >= 2).

Per sequence: where the state that sampled its pending token is at hand (DraftState.hidden: a
verification step's own, or the sampler's), the lookahead heads read it with the pending token
and their top candidates fill the proposer's tree of rank paths (node (r1..rj) = head j's
r_j-th candidate); beside it, with TreeProposer(lookup=L), a chain of L prompt-lookup drafts
(rltlab.engine.spec.prompt_lookup's rule) hangs off the root. Every node is a deterministic
guess (a point mass for sampled verification). The lookup chain is verified in every step
(the adaptive rules belong to the device program).
"""
from __future__ import annotations

import torch

from rltlab.engine.spec.prompt_lookup import prompt_lookup_ref
from rltlab.engine.spec.protocol import DraftState, DraftTree, Verdict


class TreeDrafts:
    def __init__(self, proposer):
        self.proposer = proposer
        paths = proposer.tree
        self._index = {p: i for i, p in enumerate(paths)}
        self._parents = [self._index[p[:-1]] if len(p) > 1 else -1 for p in paths]

    @torch.no_grad()
    def propose(self, states: list[DraftState]) -> list[DraftTree | None]:
        prop = self.proposer
        with_state = [i for i, s in enumerate(states) if s.hidden is not None and prop.tree]
        cands = {}
        if with_state:
            h = torch.stack([states[i].hidden for i in with_state])
            pending = torch.tensor([states[i].token_ids[-1] for i in with_state],
                                   device=h.device)
            ranks = prop.draft(h, pending).topk(prop.ranks, dim=-1).indices.tolist()
            cands = dict(zip(with_state, ranks))          # [depth][rank] token ids
        trees = []
        for i, state in enumerate(states):
            tokens, parents = [], []
            if i in cands:
                tokens = [cands[i][len(p) - 1][p[-1]] for p in prop.tree]
                parents = list(self._parents)
            if prop.lookup:
                drafts = prompt_lookup_ref(state.token_ids, min(prop.lookup, state.max_depth),
                                           prop.ngram)
                for j, token in enumerate(drafts):
                    parents.append(-1 if j == 0 else len(tokens) - 1)
                    tokens.append(token)
            trees.append(DraftTree(tokens, parents) if tokens else None)
        return trees

    def observe(self, state: DraftState, verdict: Verdict) -> None:
        pass
