"""Multi-draft speculative sampling over a tree (rltlab.engine.spec.tree_sampling) is exact:
the two tokens one verification step emits (with the next step's plain draw where it stopped
at the root) follow the target's joint p0(t1) p1(t2 | t1), for i.i.d. drafts with their q, for
drafts without replacement with their conditional q, for point masses (duplicates included)
and for a mix, at T = 1 with every row sampled and with greedy rows beside them. The same test
rejects a residual that is not renormalised and a residual that is not updated after a
rejection (planted bugs), so it has power.

Then the engine (rltlab.engine.spec.tree_verify) end to end on a 5-token model whose joint is
enumerated: T = 0.5 and 1.0, with top-k, top-p and both, for a TreeProposer's candidates (heads'
tree + lookup chain, point masses) and for a drafter that samples its tree and gives q."""
import pytest
import torch

import rltlab.engine.spec.tree_sampling as ts
from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.spec.protocol import DraftTree
from test_sampling_temperatures import PROMPT, VOCAB, _model, exact_joint, goodness_of_fit

torch.set_num_threads(1)
V, N = 6, 20000


def _target(seed):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    p1 = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, -1)
    return p0, p1


def _draw(probs, g, n=None):
    return torch.multinomial(probs, 1 if n is None else n, replacement=True,
                             generator=g).squeeze(-1)


def _without_replacement_q(q, taken):
    """q with the tokens `taken` [N, j] removed, renormalised: [N, V]."""
    out = q.clone()
    out.scatter_(1, taken, 0.0)
    return out / out.sum(-1, keepdim=True)


def _simulate(mode, seed=0, greedy_share=0.0):
    """N independent steps of one tree each: the root (after the prompt) with 3 children, each
    child with 2. mode: "iid" (children and grandchildren i.i.d. from q, q given),
    "without_replacement" (children without replacement, each with its conditional q),
    "point" (fixed children with a duplicate, sampled grandchildren given as point masses),
    "mixed" (sampled children given as point masses, grandchildren with q). The first
    greedy_share of the trials decode greedily. -> (t1, t2) of the sampled trials, the exact
    joint [V, V], (t1 of the greedy trials, the root's argmax)."""
    g = torch.Generator().manual_seed(seed)
    p0, p1 = _target(seed)
    q0 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    q1 = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 2, -1)
    kid_q = None
    if mode == "without_replacement":
        kids = torch.multinomial(q0.expand(N, V), 3, replacement=False, generator=g)
        kid_q = torch.stack([_without_replacement_q(q0.expand(N, V), kids[:, :j])
                             for j in range(3)], 1)
    elif mode == "point":
        top = p0.argsort(descending=True).tolist()   # the likeliest twice, then the next
        kids = torch.tensor([top[0], top[0], top[1]]).expand(N, 3)
    else:
        kids = _draw(q0.expand(N, V), g, 3)
        kid_q = q0.expand(N, 3, V) if mode == "iid" else None
    grand = _draw(q1[kids.reshape(-1)], g, 2).view(N, 3, 2)             # i.i.d. from q1[kid]
    grand_q = None if mode == "point" else q1[kids][:, :, None].expand(N, 3, 2, V)
    # global nodes per trial: 0 root, 1..3 children, 4..9 grandchildren (2 per child)
    per = 10
    base = torch.arange(N)[:, None] * per
    parent = torch.cat([base.expand(N, 3), (base + 1 + torch.arange(3).repeat_interleave(2))],
                       1).reshape(-1)
    token = torch.cat([kids, grand.view(N, 6)], 1).reshape(-1)
    rank = torch.tensor([0, 1, 2, 0, 1, 0, 1, 0, 1]).repeat(N)
    ranks = [torch.nonzero(rank == s)[:, 0] for s in range(3)]
    node_probs = torch.cat([p0.expand(N, 1, V), p1[kids], p1[grand.view(N, 6)]], 1)
    processed = node_probs.reshape(-1, V).log().float()
    rows = [kid_q.reshape(N, 3, V) if kid_q is not None else torch.zeros(N, 3, V),
            grand_q.reshape(N, 6, V) if grand_q is not None else torch.zeros(N, 6, V)]
    q_rows = torch.cat(rows, 1).reshape(-1, V).float()
    q_index = torch.arange(N * 9).view(N, 9)
    if kid_q is None:
        q_index[:, :3] = -1
    if grand_q is None:
        q_index[:, 3:] = -1
    greedy = torch.zeros(N * per, dtype=torch.bool)
    n_greedy = int(N * greedy_share)
    greedy[: n_greedy * per] = True
    accept, final = ts.tree_decisions(processed, greedy, parent, token, ranks, q_rows,
                                      q_index.reshape(-1), torch.rand(N * 9, generator=g),
                                      torch.rand(N * per, generator=g))
    accept, final = accept.view(N, 9), final.view(N, per)
    # the walk: the first accepted child (3: none), then its first accepted child (2: none)
    after_root = _draw(p1[final[:, 0]], g)                  # the next (plain) step's token
    c = torch.where(accept[:, :3].any(1), accept[:, :3].int().argmax(1), 3)
    at = torch.arange(N)
    cc = c.clamp(max=2)
    below = accept[:, 3:].view(N, 3, 2)[at, cc]
    gc = torch.where(below.any(1), below.int().argmax(1), 2)
    t1 = torch.where(c < 3, kids[at, cc], final[:, 0])
    t2 = torch.where(c == 3, after_root,
                     torch.where(gc < 2, grand[at, cc, gc.clamp(max=1)], final[at, 1 + cc]))
    return (t1[n_greedy:], t2[n_greedy:], p0[:, None] * p1,
            (t1[:n_greedy], int(p0.argmax())))


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "point", "mixed"])
def test_tree_sampling_matches_the_target_joint(mode):
    t1, t2, joint, _ = _simulate(mode, seed=1)
    pvalue, tv = goodness_of_fit(t1 * V + t2, joint.reshape(-1))
    assert pvalue > 1e-3 and tv < 0.03, (pvalue, tv)


def test_greedy_rows_beside_sampled_ones():
    """Greedy trials in the same batch emit the root's argmax (accepted or corrected), and
    the sampled ones stay exact."""
    t1, t2, joint, (g1, best) = _simulate("iid", seed=2, greedy_share=0.25)
    pvalue, _ = goodness_of_fit(t1 * V + t2, joint.reshape(-1))
    assert pvalue > 1e-3
    assert (g1 == best).all()


def _unnormalised(rest, r):
    return torch.where(rest.sum(-1, keepdim=True) > 0, rest, r)


def _not_updated(r, x, q, use_q):
    accept, _ = _REAL(r, x, q, use_q)
    return accept, r


_REAL = ts.residual_after


@pytest.mark.parametrize("bug, mode", [("unnormalised", "iid"), ("unnormalised", "point"),
                                       ("not_updated", "iid"), ("not_updated", "point")])
def test_planted_bugs_are_rejected(monkeypatch, bug, mode):
    if bug == "unnormalised":
        monkeypatch.setattr(ts, "_renormalize", _unnormalised)
    else:
        monkeypatch.setattr(ts, "residual_after", _not_updated)
    t1, t2, joint, _ = _simulate(mode, seed=1)
    pvalue, _ = goodness_of_fit(t1 * V + t2, joint.reshape(-1))
    assert pvalue < 1e-6, pvalue


# ------------------------------------------------------------------------ the engine path
GROUPS = [(1.0, -1, 1.0), (0.5, 3, 1.0), (1.0, -1, 0.8), (0.5, 3, 0.8)]


class SampledTree:
    """Drafts two children of the root i.i.d. from a fixed q and one child under each from q
    too, with the request's generator, and says so (DraftTree.q)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(VOCAB, generator=g) * 2, -1)
        self.trees = 0

    def propose(self, states):
        out = []
        for s in states:
            x = torch.multinomial(self.q, 4, replacement=True, generator=s.generator).tolist()
            out.append(DraftTree(x, [-1, -1, 0, 1], self.q.expand(4, VOCAB)))
        self.trees += len(states)
        return out

    def observe(self, state, verdict):
        pass


def _engine_groups(model, proposer, n, path):
    llm = LLM(model, block_size=4, max_num_seqs=n * len(GROUPS), decode_path=path,
              max_num_batched_tokens=n * len(GROUPS) * len(PROMPT), num_blocks=n * 24)
    llm.set_proposer(proposer)
    params = [SamplingParams(n=n, temperature=t, top_k=k, top_p=p, seed=11 + i, max_tokens=3,
                             ignore_eos=True, exit_policy="fixed")
              for i, (t, k, p) in enumerate(GROUPS)]
    return [req.outputs for req in llm.generate([PROMPT] * len(GROUPS), params)]


def _assert_speculated_as_target(model, outs, temperature, top_k, top_p):
    """Some drafts accepted and some rejected, and the pair of tokens after token 0 follows the
    exact joint (chi-square p > 1e-3, total variation < 0.12)."""
    stats = [o.spec_stats for o in outs]
    assert 0 < sum(s["accepted"] for s in stats) < sum(s["drafted"] for s in stats)
    seqs = torch.tensor([o.token_ids[:3] for o in outs])
    joint = exact_joint(model, temperature, top_k, top_p)
    pvalue, tv = goodness_of_fit(seqs[:, 1] * VOCAB + seqs[:, 2], joint.sum(0).reshape(-1))
    assert pvalue > 1e-3 and tv < 0.12, (temperature, top_k, top_p, pvalue, tv)


def _program_llm(model):
    """One request at a time on the static path, with a TreeProposer whose first drafts make
    the heads' siblings active in a request's first iteration."""
    heads = LookaheadHeads(model, depth=2, inner=8)
    llm = LLM(model, block_size=4, max_num_seqs=1, decode_path="static", num_blocks=64)
    llm.set_proposer(TreeProposer(heads, [(0,), (1,), (0, 0), (1, 0)], lookup=2,
                                  first_drafts=True))
    return llm


@pytest.mark.parametrize("drafter", ["tree_proposer", "sampled_q"])
def test_engine_tree_verification_matches_target(drafter):
    model = _model()
    if drafter == "tree_proposer":   # heads' candidates + a lookup chain: point masses
        heads = LookaheadHeads(model, depth=2, inner=8)
        proposer, path = TreeProposer(heads, [(0,), (1,), (0, 0), (1, 0)], lookup=2), "static"
    else:
        proposer, path = SampledTree(), "gather"
    n = 500
    for (temperature, top_k, top_p), outs in zip(GROUPS, _engine_groups(model, proposer, n,
                                                                          path)):
        _assert_speculated_as_target(model, outs, temperature, top_k, top_p)


def test_tree_program_sampling_matches_target():
    """One request at a time: every verification step is the TreeProposer's device program
    (tree_program.py, its uniforms from counter_uniforms), never the generic verifier. First
    drafts make the heads' siblings active in the first iteration, and max_tokens=4 its cap
    2, so (t1, t2) come from walks through the whole tree (with the first iteration's cap 1
    or only the lookup chain, a walk that does not stop at a parent's first accepted child
    still passed; with them it fails at p ~ 1e-13 on 1,000 samples)."""
    model = _model()
    llm = _program_llm(model)
    spec = llm.llm_engine._spec

    def no_generic(seqs):
        raise AssertionError("the generic verifier ran")

    spec._generic.step = no_generic
    n = 600
    for i, (temperature, top_k, top_p) in enumerate(GROUPS):
        params = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=31 + i, max_tokens=4, ignore_eos=True, exit_policy="fixed")
        outs = llm.generate([PROMPT], params)[0].outputs
        _assert_speculated_as_target(model, outs, temperature, top_k, top_p)
    sampled = {key[3] for key in spec._tree._programs}
    assert {"sample", "filter"} <= sampled


def test_tree_program_sampling_is_reproducible_by_seed():
    llm = _program_llm(_model())

    def tokens(seed):
        params = SamplingParams(n=8, temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True,
                                exit_policy="fixed")
        return [o.token_ids for o in llm.generate([PROMPT], params)[0].outputs]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


def test_counter_uniforms_are_uniform_fresh_and_reproducible():
    """splitmix64 against a Python-integer reference; 200,000 draws at one position are
    uniform (mean, variance, a 20-bin chi-square); the next position's are uncorrelated with
    them; the same (seed, position) gives the same draws, another seed others."""
    mask = (1 << 64) - 1

    def mix(x):
        x &= mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    for value in (0, 1, 12345, -5, (1 << 63) - 1):
        assert ts._mix64(torch.tensor([value])).item() & mask == mix(value)
    offsets = ts.stream_offsets(200_000, "cpu")
    seed, pos = torch.tensor([7]), torch.tensor([100])
    u = ts.counter_uniforms(seed, pos, offsets)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.bincount((u * 20).long(), minlength=20).double()
    expected = len(u) / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 50   # chi-square, 19 dof
    nxt = ts.counter_uniforms(seed, pos + 1, offsets)
    assert abs(float(torch.corrcoef(torch.stack([u, nxt]))[0, 1])) < 0.01
    assert torch.equal(ts.counter_uniforms(seed, pos, offsets), u)
    assert not torch.equal(ts.counter_uniforms(seed + 1, pos, offsets), u)
