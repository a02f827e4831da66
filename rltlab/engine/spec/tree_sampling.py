"""Acceptance over draft trees, for a whole batch of trees at once, on the device.

Nodes of every tree of a step are numbered globally (each tree's root, its pending token,
first); a child is a node with a parent. For each node the target's processed logits
(temperature, top-k, top-p: rltlab.engine.sampling.process_logits) give the distribution of the
token after it, p. `tree_decisions` returns, for every child, whether it would be accepted
were the walk to reach its parent with its earlier siblings rejected, and for every node the
token to emit were the walk to stop there. The host then walks each tree from its root into
the first accepted child until none is (rltlab.engine.spec.tree_verify), so one read-back
serves the whole step.

Greedy rows (T = 0): a child is accepted iff its token is the argmax of p at its parent, and
the token at a stop is the argmax there (the sampler's greedy token).

Sampled rows (T > 0), multi-draft speculative sampling (recursive rejection sampling,
SpecInfer / Sequoia): at a node, the residual r starts as p; children are tried in sibling
order; child x with a draft distribution q is accepted with probability min(1, r(x) / q(x)),
else r <- normalize(max(0, r - q)); a child without q (or whose q gives x no mass) is a point
mass: accepted with probability r(x), else r(x) <- 0 and r renormalized. The token at a stop
is drawn from r after every child was rejected (p itself at a leaf), by inverse CDF at one
uniform. Each step is exact for any draft: whatever x is, "accept x with probability
min(1, r(x)/q(x)), else draw from the normalized remainder" outputs r when x ~ q, and a point
mass needs no assumption at all; by induction over the siblings and down the accepted path,
the emitted tokens are distributed as target-only sampling's.
"""
from __future__ import annotations

import torch


def residual_after(r: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None,
                   use_q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows r [n, V] (distributions), drafts x [n], their draft distributions q [n, V] where
    use_q [n] (else point masses) -> (acceptance probabilities [n], the residuals [n, V] after
    a rejection, normalized)."""
    rx = r.gather(1, x[:, None])[:, 0]
    accept = rx
    rest = r.scatter(1, x[:, None], 0.0)               # a point mass: r with x taken out
    if q is not None:
        qx = q.gather(1, x[:, None])[:, 0]
        accept = torch.where(use_q, (rx / qx.clamp(min=1e-30)).clamp(max=1.0), rx)
        rest = torch.where(use_q[:, None], (r - q).clamp(min=0.0), rest)
    return accept, _renormalize(rest, r)


def _renormalize(rest: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """rest / its mass; where no mass is left (a rejection of probability 0), r itself."""
    mass = rest.sum(-1, keepdim=True)
    return torch.where(mass > 0, rest / mass.clamp(min=1e-30), r)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [n, V] (non-negative, any positive mass) at uniforms u [n],
    as rltlab.engine.sampling.sample_on_device draws: never a token of probability 0."""
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    idx = idx.clamp(max=vocab - 1)
    off = probs.gather(1, idx[:, None]).squeeze(1) <= 0
    last = vocab - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.where(off, last, idx)


def tree_decisions(processed: torch.Tensor, greedy: torch.Tensor, parent: torch.Tensor,
                   token: torch.Tensor, ranks: list[torch.Tensor], q: torch.Tensor | None = None,
                   q_index: torch.Tensor | None = None, u_accept: torch.Tensor | None = None,
                   u_final: torch.Tensor | None = None, sampled: bool | None = None,
                   active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance decisions of a batch of trees (module docstring).

    processed [G, V] fp32: each node's processed target logits (finite rows); greedy [G] bool:
    the node's request decodes greedily; parent / token [C] int64: each child's parent node and
    draft token; ranks: per sibling rank s, the children (indices into C) that are their
    parent's s-th child; q [Q, V] and q_index [C] (row of q, -1: a point mass): the draft
    distributions; u_accept [C], u_final [G]: uniforms in [0, 1) (only sampled rows read them);
    sampled: whether any row samples (None: read from greedy, a device sync); active [C] bool
    (None: all): the children a walk may try; an inactive one is never accepted and, not being
    tried, leaves its parent's residual as it is.
    -> (accept [C] bool, final token [G] int64)."""
    best = processed.argmax(-1)
    accept = token == best[parent]
    if sampled is None:
        sampled = not bool(greedy.all())
    if not sampled:
        return accept, best
    residual = torch.softmax(processed, -1)
    chance = torch.zeros(token.shape, dtype=residual.dtype, device=residual.device)
    for idx in ranks:                         # the siblings' order: rank 0 first
        par, x = parent[idx], token[idx]
        qi = None if q is None else q_index[idx]
        rows = None if q is None else q[qi.clamp(min=0)]
        use = None
        if q is not None:
            use = (qi >= 0) & (rows.gather(1, x[:, None])[:, 0] > 0)
        p_accept, rest = residual_after(residual[par], x, rows, use)
        if active is not None:
            tried = active[idx]
            rest = torch.where(tried[:, None], rest, residual[par])
            p_accept = torch.where(tried, p_accept, 0.0)
        residual = residual.index_copy(0, par, rest)
        chance = chance.index_copy(0, idx, p_accept)
    accept = torch.where(greedy[parent], accept, u_accept < chance)
    if active is not None:
        accept = accept & active
    final = torch.where(greedy, best, inverse_cdf(residual, u_final))
    return accept, final


# splitmix64's constants as signed int64 (torch's int64 arithmetic wraps modulo 2^64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of int64 whose output bits each depend on all input
    bits."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def stream_offsets(n: int, device) -> torch.Tensor:
    """The counters of n uniforms (counter_uniforms' `offsets`), made once outside any
    compiled code: under torch.compile an arange times a 64-bit constant becomes an index
    expression, which Triton evaluates in int32 and refuses."""
    return torch.arange(1, n + 1, dtype=torch.long, device=device) * _GOLDEN


def counter_uniforms(seed: torch.Tensor, position: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) (fp32, 24 random bits) per offset (stream_offsets(n)), drawn as a
    pure function of (seed, position, offset), seed and position int64 [1] on the device: a
    counter-based generator, so that a device program captured once (a CUDA graph) draws
    fresh, reproducible uniforms at every position without a generator's state on the host."""
    key = _mix64(_mix64(seed ^ _mix64(position * _GOLDEN)) + offsets)
    return _shift_right(key, 40).float() * (1.0 / (1 << 24))
