"""A speculative iteration as one device program (one CUDA graph replay on a GPU).

For a batch on the static decode path, one `run()` does the whole of rltlab.engine.spec.decoder's
iteration on the device:

  for i in 0..K:  token_i -> embed -> rounds 1..d (planes 0..d-1, position P + i) -> h_d[i];
                  if i < K: token_{i+1} = argmax (T = 0) or a draw from q_i = softmax of the
                  processed draft_logits(h_d[i]) (T > 0)
  verify:         the K + 1 positions of every sequence as causal token rows, rounds d+1..R
                  starting from h_d (planes d..R-1) -> target logits, processed like the request
  accept:         T = 0: longest prefix with draft == the target's argmax, then that argmax;
                  T > 0: accept x w.p. min(1, p(x)/q(x)), else draw from normalize(max(0, p - q))
                  and stop; after k_j accepts, draw the bonus from p

and the host reads drafts, accepted counts, next tokens and finite flags back in ONE copy. The
host-driven loop pays a launch and a read-back per draft pass (the draft picks the next pass's
input); here drafts chain through device tensors, so a whole iteration is one replay.

Random numbers: every sampled request draws 2K + 1 uniforms from its own generator per
iteration (K draft draws, K acceptance tests, one final draw; inverse-CDF sampling as in
rltlab.engine.sampling), so seeded requests stay reproducible; greedy requests draw none.

Rows: sequence j's pass i sits at position P_j + min(i, k_j) with its own cache slot (from its
block table, on the device) for i <= k_j and slot -1 beyond (no K/V write, output ignored):
k_j <= K caps drafting by the tokens the sequence may still emit, as in the host loop, so no
write leaves the sequence's admission reservation. Padding rows (bucket > batch) have slot -1
throughout. For greedy requests the rounds, matmuls and argmaxes are the host loop's, so
outputs are token-identical; sampled requests follow the same distribution (tests).
"""
from __future__ import annotations

import numpy as np
import torch

from rltlab.engine.spec.proposers import DraftProposer
from rltlab.engine.sampling import needs_filtering, process_logits
from rltlab.engine.static_decode import BUCKETS


class SpecGraph:
    """Device programs for speculative iterations, one per (bucket, K, sampled, filtering)."""

    def __init__(self, runner, proposer: DraftProposer):
        self.runner, self.proposer = runner, proposer
        self._static = None
        self._programs: dict = {}

    def run(self, seqs, starts: list[int], ks: list[int], k: int):
        """One iteration for `seqs` (pending token at position starts[j], k_j = ks[j] <= k
        drafts) -> per sequence (drafts [k_j], accepted count n, next token, finite flag); the
        target rows' h_R stay readable through verify_hidden()."""
        bucket = next((b for b in BUCKETS if b >= len(seqs)), len(seqs))
        static = self.runner.static_rows(bucket * (k + 1))
        if static is not self._static:            # a new (grown) decoder: new buffers, graphs
            self._static, self._programs = static, {}
        sampled = any(s.params.temperature > 0 for s in seqs)
        filtering = needs_filtering([s.params for s in seqs], static.config.vocab_size)
        key = (bucket, k, sampled, filtering)
        if key not in self._programs:
            self._programs[key] = _Program(static, self.proposer, bucket, k, sampled, filtering,
                                           self.runner.block_size)
        self._last = program = self._programs[key]
        program.stage(seqs, starts, ks)
        flat = program.replay()
        n, nxt, finite = (flat[k * bucket + i * bucket: k * bucket + (i + 1) * bucket]
                          for i in range(3))
        return [([flat[i * bucket + j] for i in range(ks[j])], n[j], nxt[j], bool(finite[j]))
                for j in range(len(seqs))]

    def verify_hidden(self, ks: list[int]) -> torch.Tensor:
        """h_R of the last run's target rows, sequence after sequence ([sum(k_j + 1), H])."""
        program, width = self._last, self._last.k + 1
        return torch.cat([program.verify_hidden[j * width: j * width + k + 1]
                          for j, k in enumerate(ks)])


class GraphProgram:
    """A device program on the static decoder: `_program()` writes `out`; on CUDA it is
    captured as a graph at the first replay (after the first stage(), so that the capture's
    warm-up writes the real rows' K/V) and replayed after that."""

    static: object
    out: torch.Tensor
    _graph = None

    def _warmup(self) -> None:
        """The capture's warm-up run (an idempotent program is its own)."""
        self._program()

    def launch(self) -> None:
        """Run the program (replay its graph) without waiting for it."""
        if not self.static.cuda_graphs:
            self._program()
        else:
            if self._graph is None:
                self._graph = self.static._capture(self._program, self._warmup)
            self._graph.replay()

    def read(self) -> list[int]:
        """The program's output (waits for it)."""
        return self.out.tolist()

    def replay(self) -> list[int]:
        self.launch()
        return self.read()


class _Program(GraphProgram):
    """Buffers and (on CUDA) the captured graph of one (bucket, K, sampled, filtering)."""

    def __init__(self, static, proposer: DraftProposer, bucket: int, k: int, sampled: bool,
                 filtering: bool, block_size: int):
        self.static, self.proposer, self.bucket, self.k = static, proposer, bucket, k
        self.sampled, self.filtering = sampled, filtering
        self.block_size = block_size
        b, nb, dev = bucket, static.max_blocks, static.device
        pin = dev.type == "cuda"
        # int32: [tokens | base positions | caps | top-k | live (a sequence, not padding) |
        # tables]
        self._sizes = [b, b, b, b, b, b * nb]
        self.index = torch.zeros(sum(self._sizes), dtype=torch.int32, device=dev)
        self._staging = torch.zeros(sum(self._sizes), dtype=torch.int32, pin_memory=pin)
        # fp32: [temperature | top-p] and the sampled rows' uniforms [b, 2K + 1]
        self.params = torch.zeros(2, b, dtype=torch.float32, device=dev)
        self._param_staging = torch.zeros(2, b, dtype=torch.float32, pin_memory=pin)
        self.uniforms = torch.zeros(b, 2 * k + 1, dtype=torch.float32, device=dev)
        self._no_draw = torch.zeros(2 * k + 1, dtype=torch.float32, device=dev)
        # int64 out: [drafts K x b | accepted b | next token b | finite b]
        self.out = torch.zeros((k + 3) * b, dtype=torch.int64, device=dev)
        self.verify_hidden = torch.zeros(b * (k + 1), static.config.hidden_size,
                                         dtype=static.dtype, device=dev)

    def _views(self, buf):
        ends = np.cumsum(self._sizes)
        tokens, base, caps, top_k, live, tables = (buf[e - n: e]
                                                   for e, n in zip(ends, self._sizes))
        return tokens, base, caps, top_k, live, tables.reshape(self.bucket, self.static.max_blocks)

    def stage(self, seqs, starts, ks) -> None:
        tokens, base, caps, top_k, live, tables = self._views(self._staging.numpy())
        temperature, top_p = self._param_staging.numpy()
        c = len(seqs)
        tokens[c:], base[c:], caps[c:], top_k[c:], live[c:] = 0, 0, 0, 0, 0
        temperature[c:], top_p[c:] = 0.0, 1.0
        draws = []
        for j, seq in enumerate(seqs):
            p = seq.params
            tokens[j], base[j], caps[j], top_k[j] = seq.output_token_ids[-1], starts[j], ks[j], \
                p.top_k
            live[j] = 1
            temperature[j], top_p[j] = p.temperature, p.top_p
            table = seq.block_table
            tables[j, : len(table)] = table
            if self.sampled:   # greedy rows draw nothing (their uniforms are unused)
                gen = seq.generator
                draws.append(torch.rand(2 * self.k + 1, generator=gen, device=gen.device)
                             if p.temperature > 0 else self._no_draw)
        self.index.copy_(self._staging, non_blocking=True)
        self.params.copy_(self._param_staging, non_blocking=True)
        if self.sampled:
            self.uniforms[:c].copy_(torch.stack(draws))

    @torch.no_grad()
    def _program(self) -> None:
        """Drafts chained on the device, verification, acceptance (see the module docstring).
        Reads only the staged inputs, so running it twice (the capture's warm-up) rewrites the
        same K/V with the same values."""
        st, b, k = self.static, self.bucket, self.k
        model, d, R = st.model, self.proposer.draft_rounds, st.config.num_rounds
        tokens, base, caps, top_k, live, tables = self._views(self.index)
        temperature, top_p = self.params
        steps = torch.arange(k + 1, dtype=torch.int32, device=st.device)[:, None]
        positions = base[None] + torch.minimum(steps, caps[None])           # [K+1, b]
        bs = self.block_size
        blocks = tables.gather(1, (positions // bs).t().long()).t()          # [K+1, b]
        writes = (steps <= caps[None]) & (live[None] > 0)
        slots = torch.where(writes, blocks * bs + positions % bs, -1)
        token, h_d, drafts, qs = tokens.long(), [], [], []
        for i in range(k + 1):
            x = model.model.embed_tokens(token)
            rows = (positions[i], slots[i], positions[i] + 1, tables)
            for r in range(d):
                x = self._round(x, b, r, rows)
            h_d.append(x.clone())
            if i < k:
                raw = self.proposer.draft_logits(x, model.lm_head)
                token = raw.argmax(-1)   # greedy drafts: the raw argmax, as the host loop
                if self.sampled:
                    q = torch.softmax(self._process(raw, temperature, top_k, top_p), -1)
                    qs.append(q)
                    token = torch.where(temperature > 0, _draw(q, self.uniforms[:, i]), token)
                drafts.append(token)
        n = b * (k + 1)    # verification rows, sequence j's positions at j(K+1)..j(K+1)+K
        pos_v = positions.t().reshape(n)
        rows = (pos_v, slots.t().reshape(n), pos_v + 1, tables.repeat_interleave(k + 1, 0))
        x = torch.stack(h_d, 1).reshape(n, -1)
        for r in range(d, R):
            x = self._round(x, n, r, rows)
        self.verify_hidden.copy_(x)
        logits = model.lm_head(x).float()
        finite = torch.isfinite(logits).all(-1).view(b, k + 1)
        target = logits
        if self.sampled or self.filtering:
            def rep(t): return t.repeat_interleave(k + 1)
            target = self._process(logits, rep(temperature), rep(top_k), rep(top_p))
        target = target.view(b, k + 1, -1)
        accepted, nxt = self._accept(target, drafts, qs, caps, temperature)
        within = steps.t() <= caps[:, None]                                  # [b, K+1]
        parts = [torch.stack(drafts).flatten()] if drafts else []
        self.out.copy_(torch.cat(parts + [accepted, nxt, (finite | ~within).all(-1).long()]))

    def _accept(self, target, drafts, qs, caps, temperature):
        """-> (accepted count [b], next token [b]) from the processed target logits
        [b, K+1, V] (see the module docstring)."""
        b, k, rows = self.bucket, self.k, torch.arange(self.bucket, device=target.device)
        best = target.argmax(-1)                                             # [b, K+1]
        q = torch.stack(qs, 1) if qs else None                               # [b, K, V]
        if not k:
            accepted = torch.zeros(b, dtype=torch.long, device=target.device)
        else:
            x = torch.stack(drafts, 1)                                       # [b, K]
            live = torch.arange(k, device=x.device)[None] < caps[:, None]
            ok = x == best[:, :k]
            if self.sampled:
                p = torch.softmax(target[:, :k], -1)
                p_x, q_x = p.gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]
                test = self.uniforms[:, k: 2 * k] * q_x < p_x    # u < min(1, p/q); q_x > 0
                ok = torch.where(temperature[:, None] > 0, test, ok)
            accepted = (ok & live).long().cumprod(1).sum(1)
        nxt = best[rows, accepted]
        if self.sampled:
            p_n = torch.softmax(target[rows, accepted], -1)
            dist = p_n
            if k:
                resid = (p_n - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)
                mass = resid.sum(-1, keepdim=True)
                rejected = (accepted < caps)[:, None] & (mass > 0)
                dist = torch.where(rejected, resid / mass.clamp(min=1e-30), p_n)
            nxt = torch.where(temperature > 0, _draw(dist, self.uniforms[:, 2 * k]), nxt)
        return accepted, nxt

    def _process(self, logits, temperature, top_k, top_p):
        return process_logits(logits, temperature, top_k, top_p, self.filtering)

    def _round(self, x, n: int, plane: int, rows) -> torch.Tensor:
        self.static._round(n, plane=plane, rows=rows, x=x)
        return self.static.hidden_out[:n]


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one per row of probs [b, V] with uniforms u [b] (as
    rltlab.engine.sampling: u * total searched in the CDF; a draw rounded onto the end of the
    support goes to the last token with mass)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    idx = idx.clamp(max=probs.shape[-1] - 1)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1)
    return torch.where(probs.gather(-1, idx[:, None])[:, 0] > 0, idx, last)
