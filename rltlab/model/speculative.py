"""Loop-aware speculative decoding (docs/ouro.md) over the reference model.

Target = fixed full-depth decoding (every position runs all R rounds). Per iteration, with the
pending token t at logical position P and cache column c (= cache.length):

  draft:  feed t, x1, ..., xK at columns c..c+K through rounds 1..d only (one pass each),
          drafting x_{i+1} from head(h_d) (head None: the model's lm_head, i.e. "exit at d");
  verify: ONE batched causal pass of rounds d+1..R over the K+1 columns, starting from the
          drafts' own h_d and reading/writing planes d+1..R. Exact reuse: the draft's rounds 1..d
          are the target's rounds 1..d on the same prefix (same weights, same planes);
  accept: greedy prefix match (T=0) or rejection sampling (T>0: accept x w.p. min(1, p/q), else
          resample from normalize(max(0, p - q))); then a correction or a bonus token.
          T below rltlab.model.generate.SAMPLING_EPS is greedy, as in the engine's sampler.

A draft model whose shared layers differ from the target's (a draft-only LoRA, `draft_model`)
breaks reuse: verification then recomputes rounds 1..R for the K+1 columns (and overwrites the
draft's K/V in planes 1..d with the target's).

KV rollback: columns advance by K+1 per iteration for every row of the batch; a row's rejected
columns are masked out of attention for good (cache.key_mask False) and their plane entries are
never read again, while RoPE positions count accepted tokens only (as left padding does in
rltlab.model.generate). So the cache holds up to K+1 columns per emitted token (see max_len below);
this keeps a batch of rows with different acceptance lengths in lock-step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rltlab.model.architecture import LoopedKVCache, OuroForCausalLM, _RoundContext, rope_cos_sin
from rltlab.model.generate import SAMPLING_EPS, left_pad

Head = Callable[[torch.Tensor], torch.Tensor]   # h_d [..., H] -> logits [..., V]


@dataclass
class SpecStats:
    """Per request: verification steps, drafted / accepted draft tokens, emitted tokens."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0          # tokens produced by verification steps (acceptance + 1 each)

    @property
    def tau(self) -> float:
        """Tokens per verification step (bonus/correction included; plain decoding = 1)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "tau": self.tau, "acceptance_rate": self.acceptance_rate}


@dataclass
class SpeculativeGeneration:
    token_ids: list[list[int]]
    stats: list[SpecStats]
    round_passes: int = 0          # sequential round launches (draft d per pass + verify)
    cache_columns: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def totals(self) -> SpecStats:
        out = SpecStats()
        for s in self.stats:
            out.steps, out.drafted = out.steps + s.steps, out.drafted + s.drafted
            out.accepted, out.emitted = out.accepted + s.accepted, out.emitted + s.emitted
        return out


def run_rounds(model: OuroForCausalLM, h: torch.Tensor, positions: torch.Tensor,
               cache: LoopedKVCache, start: int, rounds: range,
               layers_from: OuroForCausalLM | None = None) -> torch.Tensor:
    """Run `rounds` (1-based) of the shared layers on h [B, T, H] for cache columns
    start..start+T (all of them real keys), writing each round's K/V into its plane.
    -> h after the last round (model.norm applied). `layers_from` supplies the layers (a
    draft-only adapted copy); norms, RoPE and the cache are the target's."""
    cfg = model.config
    bsz, seq, _ = h.shape
    mask = model._attention_mask(torch.ones(bsz, seq, dtype=torch.bool, device=h.device),
                                 cache, start)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, h.dtype)
    cos, sin = cos[:, None], sin[:, None]
    layers = (layers_from or model).model.layers
    ctx = _RoundContext(cfg.num_hidden_layers, cache, start)
    for r in rounds:
        ctx.plane, x = r - 1, h
        for idx, layer in enumerate(layers):
            x = layer(x, cos, sin, mask, ctx, idx)
        h = model.model.norm(x)
    return h


def _accept(drafts, q, target, temperature, gen):
    """drafts [B, K], q [B, K, V] draft probs (None at T=0), target logits [B, K+1, V] fp32.
    -> (n accepted [B], next token [B])."""
    bsz, k = drafts.shape
    rows = torch.arange(bsz, device=drafts.device)
    if temperature < SAMPLING_EPS:
        best = target.argmax(-1)
        n = (drafts == best[:, :k]).long().cumprod(1).sum(1)
        return n, best[rows, n]
    p = torch.softmax(target / temperature, dim=-1)
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(bsz, k, generator=gen, device=drafts.device)
    n = (u * q_x < p_x).long().cumprod(1).sum(1)       # u < min(1, p/q), q_x > 0 (x ~ q)
    dist = p[rows, n]                                   # bonus: p at K (n == K)
    rejected = n < k
    if rejected.any():
        resid = (p[rows, n.clamp(max=k - 1)] - q[rows, n.clamp(max=k - 1)]).clamp(min=0)
        mass = resid.sum(-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p[rows, n.clamp(max=k - 1)])
        dist = torch.where(rejected[:, None], resid, dist)
    return n, torch.multinomial(dist, 1, generator=gen)[:, 0]


def _draw(logits: torch.Tensor, temperature: float, gen):
    """-> (token [B], draft probs [B, V] or None at T=0)."""
    if temperature < SAMPLING_EPS:
        return logits.argmax(-1), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(q, 1, generator=gen)[:, 0], q


@torch.no_grad()
def speculative_generate(model: OuroForCausalLM, prompt_ids, max_tokens: int, k: int = 4,
                         draft_rounds: int = 1, head: Head | None = None,
                         temperature: float = 0.0, seed: int = 0,
                         eos_token_id: int | None = None,
                         draft_model: OuroForCausalLM | None = None) -> SpeculativeGeneration:
    """Speculative decoding of a prompt (list[int]) or a batch of prompts (list[list[int]]).

    Lossless w.r.t. full-depth decoding (rltlab.model.generate.generate_plain(depth=R)): identical
    tokens at temperature 0, the same distribution at temperature > 0 (not the same RNG draws).
    `head(h_d) -> logits` is the drafter (default: model.lm_head). `draft_model`: a model whose
    layers are used for the draft rounds (draft-only adapters); verification then recomputes.
    """
    prompts = [list(prompt_ids)] if prompt_ids and isinstance(prompt_ids[0], int) else \
        [list(p) for p in prompt_ids]
    num_rounds, d = model.config.num_rounds, draft_rounds
    if not prompts or any(not p for p in prompts):
        raise ValueError("speculative_generate needs non-empty prompts")
    if not 1 <= d < num_rounds:
        raise ValueError(f"draft_rounds must lie in [1, {num_rounds - 1}], got {d}")
    if k < 1 or max_tokens < 1:
        raise ValueError(f"k and max_tokens must be >= 1, got {k}, {max_tokens}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0.0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite float >= 0, got {temperature!r}")
    head = head or model.lm_head
    started = time.perf_counter()
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    bsz, width = len(prompts), max(len(p) for p in prompts)
    ids, key_mask, positions = left_pad(prompts, next(iter(model.config.eos_token_ids), 0),
                                        device)
    # Worst case: every verification emits one token and leaves K rejected columns behind.
    cache = LoopedKVCache(model.config, bsz, width + (max_tokens + 1) * (k + 1), dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model(ids, positions=positions, key_mask=key_mask, cache=cache)   # full-depth prefill
    cur, _ = _draw(out.final_logits[:, -1].float(), temperature, gen)
    pos = positions[:, -1] + 1                     # logical position of the pending token
    tokens = [[t] for t in cur.tolist()]
    stats = [SpecStats() for _ in prompts]
    done = [len(t) >= max_tokens or t[-1] == eos_token_id for t in tokens]
    passes, embed = num_rounds, model.model.embed_tokens
    drafter = draft_model or model
    while not all(done):
        col = cache.length
        x, hs, drafts, qs = cur, [], [], []
        for i in range(k + 1):                     # K drafts + the last draft's rounds 1..d
            h = run_rounds(model, embed(x[:, None]), (pos + i)[:, None], cache, col + i,
                           range(1, d + 1), layers_from=drafter)
            cache.key_mask[:, col + i] = True
            cache.length = col + i + 1
            hs.append(h)
            passes += d
            if i < k:
                x, q = _draw(head(h[:, -1]).float(), temperature, gen)
                drafts.append(x)
                qs.append(q)
        drafts_t = torch.stack(drafts, 1)
        verify_pos = pos[:, None] + torch.arange(k + 1, device=device)
        if draft_model is None:                    # exact reuse of rounds 1..d
            h = run_rounds(model, torch.cat(hs, 1), verify_pos, cache, col,
                           range(d + 1, num_rounds + 1))
            passes += num_rounds - d
        else:                                      # the draft's rounds differ: recompute
            h = run_rounds(model, embed(torch.cat([cur[:, None], drafts_t], 1)), verify_pos,
                           cache, col, range(1, num_rounds + 1))
            passes += num_rounds
        target = model.lm_head(h).float()
        q_t = torch.stack(qs, 1) if temperature >= SAMPLING_EPS else None
        n, nxt = _accept(drafts_t, q_t, target, temperature, gen)
        for b, (nb, drafted, y) in enumerate(zip(n.tolist(), drafts_t.tolist(), nxt.tolist())):
            cache.key_mask[b, col + nb + 1: col + k + 1] = False    # roll back rejected columns
            if done[b]:
                continue
            st = stats[b]
            st.steps, st.drafted, st.accepted, st.emitted = (
                st.steps + 1, st.drafted + k, st.accepted + nb, st.emitted + nb + 1)
            for t in drafted[:nb] + [y]:
                tokens[b].append(t)
                if len(tokens[b]) >= max_tokens or t == eos_token_id:
                    done[b] = True
                    break
        pos, cur = pos + n + 1, nxt
    return SpeculativeGeneration(tokens, stats, passes, cache.length,
                                 time.perf_counter() - started)
