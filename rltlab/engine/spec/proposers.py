"""The built-in proposers for `LLMEngine.set_proposer`: a DraftProposer drafts with the model's
own first rounds (rltlab.engine.spec.draft_program), a TreeProposer with lookahead heads on the
last round (rltlab.engine.spec.tree_graph). Both are settings the engine's device programs
consume."""
from __future__ import annotations

import torch

from rltlab.model.tree_spec import validate_tree


class DraftProposer:
    """Loop-aware speculative drafting for `LLMEngine.set_proposer` (rltlab.engine.spec.decoder).

    Each speculative step drafts up to `num_draft_tokens` (K) tokens per decoding sequence with
    the first `draft_rounds` (d) rounds of the shared layers, reading each draft token from
    `draft_logits(h_d)`: `head(h_d)` if a head is given (a reuse-exact trained component of
    rltlab.draft_heads, e.g. loaded with engine_patches.loop_draft), else the model's own
    lm_head (the shallow drafter: the token "exits at d" for drafting). Rounds d+1..R then
    verify the K+1 positions in one batched causal pass that reuses the draft's rounds 1..d and
    their K/V planes. A head must read only h_d (draft-only LoRAs on the shared layers break
    reuse and are refused).

    adaptive=True makes K each sequence's own, between 1 and num_draft_tokens: it starts at
    num_draft_tokens, grows by 2 after a step that accepted every draft and shrinks by 1 after
    one that did not (the "heuristic" schedule of Hugging Face's assisted generation). Long
    runs the drafter gets right then draft further, and text it misreads drafts less. K depends
    only on earlier steps' outcomes, so outputs stay lossless.
    """

    def __init__(self, num_draft_tokens: int = 4, draft_rounds: int = 1, head=None,
                 adaptive: bool = False):
        for name, value in (("num_draft_tokens", num_draft_tokens), ("draft_rounds", draft_rounds)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DraftProposer.{name} must be an int >= 1, got {value!r}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"DraftProposer.adaptive must be a bool, got {adaptive!r}")
        if head is not None and not getattr(head, "reuse_exact", True):
            raise ValueError("DraftProposer: this head changes the draft's shared layers "
                             "(not reuse-exact); the engine path supports heads on h_d only")
        self.num_draft_tokens, self.draft_rounds, self.head = num_draft_tokens, draft_rounds, head
        self.adaptive = adaptive

    def next_draft_length(self, drafted: int, accepted: int) -> int:
        """A sequence's K for its next step, after a step that drafted `drafted` tokens and
        accepted `accepted` of them (fixed K: always num_draft_tokens)."""
        if not self.adaptive:
            return self.num_draft_tokens
        grown = drafted + 2 if accepted == drafted else drafted - 1
        return max(1, min(self.num_draft_tokens, grown))

    def draft_logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """h_d [N, H] -> draft logits [N, V] (fp32)."""
        return (self.head if self.head is not None else lm_head)(hidden).float()


LOOKUP_RULES = ("hits", "agree")   # TreeProposer(adaptive_lookup=...): see its docstring


class TreeProposer:
    """Tree speculative decoding for `LLMEngine.set_proposer` (rltlab.engine.spec.tree_graph).

    `heads(h_R [N, H], next_token [N]) -> logits [N, depth, V]` (lookahead heads, e.g.
    rltlab.draft_heads.lookahead.load_proposer) draft, from the final round's state of the
    last verified token, candidates for the `depth` positions after the next one; `tree` is a
    prefix-closed set of rank paths (validate_tree) picking which of them one full-depth pass
    verifies. Exact for greedy requests (T = 0, no top-k / top-p, no log-probs) with a
    full-depth policy; the engine speculates this way while exactly one such sequence runs,
    and steps normally otherwise.

    lookup = L > 0 adds a prompt-lookup chain of L nodes beside the tree (n-gram drafting, as
    vLLM's "ngram" speculator): the continuation, in the sequence's own tokens, of the latest
    earlier occurrence of its last `ngram` tokens (fewer where that finds none), read
    periodically past the present. It costs no model, and a looping continuation is accepted
    far deeper than the heads reach; the tree is then max(depth, L) deep.

    adaptive_lookup: an iteration other than a request's first verifies the lookup chain's
    drafts (its rows in the rounds) only where a rule says so; otherwise the heads' tree alone,
    on fewer rows. Where lookup rarely hits (arithmetic on the embedded model) the rounds skip
    rows that would accept nothing. The rules (each decided on the device by the iteration
    before, from what it emitted):
      - True or "hits": where the last iteration's lookup drafts began the tokens it emitted,
        whether they were verified or not;
      - "agree": where this iteration's first lookup draft is the heads' first candidate for
        the same position, or where the last one's drafts began its tokens and this one's
        come from a match of 2 tokens or more. Chosen on TRAINING-split rollouts with
        rltlab.bench.tree_sim (docs/experiments/loop_speculation.md).

    first_drafts=True: a request's first iteration verifies the heads' tree too, drafted inside
    its program from the state that sampled token 0 (Sequence.emit_hidden), where that state
    is at hand; otherwise (and by default) it verifies no heads' node.
    """

    adaptive = False   # the tree's shape is fixed (SpecDecoder's emit path reads this)

    def __init__(self, heads, tree, lookup: int = 0, ngram: int = 3,
                 adaptive_lookup: bool = False, first_drafts: bool = False):
        depth = getattr(heads, "depth", None)
        if not callable(heads) or not isinstance(depth, int) or depth < 1:
            raise TypeError("TreeProposer needs lookahead heads: a callable with an int "
                            f"`depth` >= 1, got {type(heads).__name__}")
        self.heads, self.depth = heads, depth
        self.tree = validate_tree(tree, depth)
        if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 0:
            raise ValueError(f"lookup is a chain length >= 0, got {lookup!r}")
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1:
            raise ValueError(f"ngram must be an int >= 1, got {ngram!r}")
        self.lookup, self.ngram = lookup, ngram
        if isinstance(adaptive_lookup, bool):
            rule = "hits" if adaptive_lookup else None
        elif adaptive_lookup in LOOKUP_RULES:
            rule = adaptive_lookup
        else:
            raise ValueError(f"adaptive_lookup must be a bool or one of {LOOKUP_RULES}, got "
                             f"{adaptive_lookup!r}")
        if rule and not (lookup and self.tree):
            raise ValueError("adaptive_lookup needs a lookup chain (lookup > 0) and a tree of "
                             "the heads' to verify without it")
        self.adaptive_lookup = rule is not None
        self.lookup_rule = rule   # None: the lookup chain in every iteration
        if not isinstance(first_drafts, bool):
            raise ValueError(f"first_drafts must be a bool, got {first_drafts!r}")
        if first_drafts and not self.tree:
            raise ValueError("first_drafts needs a tree of the heads' to draft (the tree is "
                             "empty)")
        self.first_drafts = first_drafts
        # the heads' batched drafting where they have one (LookaheadHeads.drafter: their
        # weights as they are now, so a proposer built after more training sees the new ones),
        # same logits
        drafter = getattr(heads, "drafter", None)
        self.draft = drafter() if drafter is not None else getattr(heads, "draft", heads)
        # head candidates per position (top-`ranks`); the lookup chain's nodes take rank
        # `ranks`, one column past them, so one rank path names every node
        self.ranks = max((p[-1] for p in self.tree), default=0) + 1
        self.paths = self.tree + [(self.ranks,) * j for j in range(1, lookup + 1)]
        self.span = max(depth, lookup)   # the deepest node: positions P + 1..P + span
