"""The Proposer protocol: a drafter of any kind behind one interface (vLLM v1 style).

A proposer guesses the tokens that follow each running request; the engine verifies every guess
with the target itself, so what a proposer returns changes the speed, never the output. Plug one
in with `LLMEngine.set_proposer(proposer)` (or `LLM.set_proposer`):

    class RepeatLast:                       # "the text repeats its last k tokens"
        def __init__(self, k=4):
            self.k = k
        def propose(self, states):
            return [DraftTree.chain(s.token_ids[-self.k:]) for s in states]
        def observe(self, state, verdict):
            pass

Each engine step that speculates calls `propose` ONCE with the state of every running
sequence (batch your drafter's work across them), verifies all the trees in one batched pass of
the target, then calls `observe` once per sequence with what was accepted.

A draft tree holds node tokens and parent indices: node i is a guess for the token after its
parent (parent -1: after the pending token, `state.token_ids[-1]`, the sampled token that is
not yet in the KV cache). A chain is the simple case (parents -1, 0, 1, ...). Siblings are
alternatives for the same position, tried in index order. Nodes deeper than `state.max_depth`
(the tokens the request may still emit, less one) are dropped before verification; so may be
a tree's later branches when the engine is short of KV blocks for them (whole leaves, last
first in depth-first order).

Verification (rltlab.engine.spec.tree_verify) is exact for ANY tree:
  * T = 0: the longest path whose every node is the target's argmax after its parent, then the
    target's argmax there (the sampler's greedy token, top-k / top-p applied);
  * T > 0: multi-draft speculative sampling over the tree (recursive rejection sampling, as in
    SpecInfer / Sequoia): at a node, its children are tried in order against the residual r
    (at first the target's processed distribution p there); child x drawn from q is accepted
    with probability min(1, r(x) / q(x)), else r <- normalize(max(0, r - q)); a child without
    q is a point mass (accepted with probability r(x), else r(x) <- 0 and r renormalized); an
    accepted child becomes the node, and where every child is rejected (or there is none) the
    next token is drawn from r. The emitted tokens are distributed exactly as target-only
    sampling's.

`DraftTree.q` is optional: leave it None and every node is treated as a fixed guess, which is
exact whatever your drafter did. Give q[i] only as the distribution node i's token was really
drawn from, given its parent's path and its earlier siblings (the same q for siblings drawn
i.i.d., q with the earlier draws removed and renormalised for draws without replacement);
a wrong q makes sampling inexact. A node whose q gives its own token probability 0 is treated
as a point mass.

Scope: speculation verifies at full depth R, so only requests whose exit policy always runs R
rounds speculate (docs/engine.md section 7); any temperature, top-k / top-p, log-probs
(the target's, under the verified round, in either logprobs_mode) and any number of requests
(up to ExecutionConfig.spec_max_concurrency) are served.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from rltlab.engine.sampling import SamplingParams


@dataclass(frozen=True)
class DraftState:
    """What a proposer sees of one running sequence (sample `index` of request `request_id`)."""
    request_id: str
    index: int
    token_ids: list[int]          # prompt + outputs; token_ids[-1] is the pending token
    num_prompt_tokens: int
    params: SamplingParams        # the request's (temperature, top-k / top-p, seed, ...)
    max_depth: int                # deepest node verified: the tokens it may still emit - 1
    hidden: torch.Tensor | None   # [H] the target's final-round state the pending token was
    #                               sampled from (its lm_head row), where the engine has it
    generator: torch.Generator    # the sequence's own: draw sampled drafts with it (seeded
    #                               requests stay reproducible)

    @property
    def key(self) -> tuple[str, int]:
        """(request_id, index): stable for the sequence's life; keep per-sequence state by it."""
        return self.request_id, self.index


@dataclass
class DraftTree:
    """Draft tokens as a tree (module docstring). tokens[i] guesses the token after node
    parents[i] (-1: after the pending token); every parent comes before its children.
    q: None, or [len(tokens), V] (any device and float dtype): row i the distribution tokens[i]
    was drawn from. replay_accept: BENCH ONLY (rltlab.bench.spec_replay): accept exactly these
    nodes (a root path, parent first) whatever the target says, so that recorded acceptance
    lengths can be forced through the real kernels; the output is then not the target's."""
    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    replay_accept: list[int] | None = field(default=None, repr=False)

    @staticmethod
    def chain(tokens, q: torch.Tensor | None = None) -> "DraftTree":
        """A chain: tokens[0] after the pending token, tokens[i] after tokens[i - 1]."""
        tokens = [int(t) for t in tokens]
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)), q)


@dataclass(frozen=True)
class Verdict:
    """What verification made of one sequence's tree (observe's argument). accepted: the
    accepted nodes, parent first (indices into the tree as proposed); tokens: what the step
    appended to the sequence (the accepted drafts, then the target's own next token; cut where
    a stop ended the sequence); verified: the nodes that were verified (after the depth cap and
    any pruning); finished: the sequence ended in this step (drop its state)."""
    accepted: list[int]
    tokens: list[int]
    verified: int
    finished: bool


@runtime_checkable
class Proposer(Protocol):
    """A drafter for LLMEngine.set_proposer (module docstring)."""

    def propose(self, states: list[DraftState]) -> list[DraftTree | None]:
        """One tree (or None: no drafts this step) per state, in order."""
        ...

    def observe(self, state: DraftState, verdict: Verdict) -> None:
        """Called after each verification of `state`'s tree."""
        ...


def is_proposer(obj) -> bool:
    """Whether obj has callable propose and observe (the Proposer protocol)."""
    return callable(getattr(obj, "propose", None)) and callable(getattr(obj, "observe", None))
