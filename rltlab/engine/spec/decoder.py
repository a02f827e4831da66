"""Loop-aware speculative decoding inside the paged engine (docs/ouro.md, issue #7).

`LLMEngine.set_proposer(DraftProposer(K, d, head))` turns it on. When every running sequence is
at a decode boundary (its pending token sampled, nothing in flight) and no waiting request can
be admitted, `step()` hands over to `SpecDecoder.step()`, which runs ONE speculative iteration
for all of them (otherwise the ordinary one-round-per-step path runs: prefill, admissions,
weight-update recompute, requests that are not eligible):

  draft:   the pending token t (position P) and drafts x1..xK go through rounds 1..d, one
           batched pass of d rounds per draft position (K+1 passes; the last only for h_d of
           xK); x_{i+1} ~ proposer.draft_logits(h_d). Their K/V lands in planes 1..d of the
           sequence's own slots, exactly where the target would write it;
  verify:  ONE batched causal pass of rounds d+1..R over the K+1 positions of every sequence,
           starting from the drafts' h_d and reading/writing planes d+1..R (exact reuse);
  accept:  T = 0: longest prefix with x_i == argmax of the target, then the target's token
           (correction, or bonus after K accepts). T > 0: accept x w.p. min(1, p(x)/q(x)), else
           resample from normalize(max(0, p - q)) and stop; p and q are the processed
           distributions (temperature, top-k, top-p) of the request;
  rollback: positions P+n+1..P+K (rejected drafts) keep stale K/V in blocks the sequence
           already owns; they are never read (a query attends to positions <= its own, and the
           next token at P+n+1 overwrites its slot before attending) and are overwritten later.
           K is capped per sequence by the tokens it may still emit, so no position outside its
           admission reservation (prompt + max_tokens - 1) is ever touched: nothing to free.

Exit policy: the target is fixed full depth R. Only requests whose policy always runs R rounds
are eligible (`fixed` at depth R, or `q_exit` / `q_exit_delayed` with exit_threshold >= 1 and
max_loops = R, the defaults for Ouro's config); while any running request is not eligible the
engine steps normally, so outputs never change semantics. Every speculatively emitted token has
exit_depths = executed_depths = R and its log-prob from the target's h_R at its position.

Only the runner's public API is used (execute, or prepare + run_round; logits): a speculative
span is a `Span` on a thin view of the sequence whose token_ids include the drafts. One step
reads the device back once per draft pass (the draft tokens) and once after verification,
except on the static path (ExecutionConfig.fused_spec): there drafts chain on the device and the
whole iteration, acceptance and rejection sampling included, is one program with one read-back
(rltlab.engine.spec.draft_program).
Round observers are not called for speculative steps.

A TreeProposer (lookahead heads and a tree of their candidates) instead hands each step to
rltlab.engine.spec.tree_graph: one full-depth pass verifies the whole tree, greedy or by
speculative sampling, for a request without log-probs while exactly one runs (docs/engine.md
section 7.3); its other steps (log-probs, c >= 2) go to the generic tree verifier with its
candidates as the tree
(rltlab.engine.spec.tree_drafts). Any other object with propose / observe (the Proposer
protocol, rltlab.engine.spec.protocol) is verified by that generic path
(rltlab.engine.spec.tree_verify): host loop, any temperature, any number of requests.

Switch-off: above ExecutionConfig.spec_max_concurrency running sequences, or while a request
whose exit policy is not full depth runs, the engine decodes without speculation (and with
target-only decoding's own fast paths: LLMEngine.step hides the proposer then), and says so
once per engine and reason (a warnings.warn naming it).
"""
from __future__ import annotations

import warnings

import torch

from rltlab.engine.spec.proposers import DraftProposer, TreeProposer
from rltlab.engine.spec.protocol import is_proposer
from rltlab.engine.sampling import process_logits
from rltlab.engine.sequence import Sequence, Span
from rltlab.model.generate import SAMPLING_EPS
from rltlab.model.speculative import SpecStats

# ExecutionConfig.spec_max_concurrency's default on CUDA (None there): speculate while at most
# this many sequences run, and while any of them samples (T > 0) only alone; no limit off CUDA.
# From `python -m rltlab.bench.spec_replay` at the Ouro-1.4B shape (docs/results.md H23, H24): at
# T = 0 replayed acceptance stops paying between c = 8 and 32; at T = 1 the generic verifier
# that serves c >= 2 does not pay, while a lone sampled request's tree program does.
SPEC_MAX_CONCURRENCY_CUDA = 8
SPEC_MAX_CONCURRENCY_CUDA_SAMPLED = 1


class SpeculationOffWarning(UserWarning):
    """Speculative decoding does not run for some requests (warned once per engine and reason)."""


class _View:
    """A sequence as runner.prepare sees it, with a speculative span whose tokens (drafts
    included) start at span.start; everything else is the sequence's."""

    def __init__(self, seq: Sequence, span: Span, tokens: list[int]):
        self._seq, self.span, self._tokens = seq, span, tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        return self._tokens[start - self.span.start: end - self.span.start]

    def __getattr__(self, name):
        return getattr(self._seq, name)


class SpecDecoder:
    def __init__(self, engine, proposer):
        self.engine, self.proposer, self.runner = engine, proposer, engine.runner
        self._graph = self._tree = None   # each iteration as one device program
        self._generic = None              # the tree verifier (tree_verify.py)
        self._off: str | None = None      # why the last ready() said no, if it lasts
        static = engine.config.execution.fused_spec and getattr(engine.runner, "static", None) is not None
        # Programs are kept per proposer for the engine's life: setting a proposer again
        # (switching drafters) reuses their captured graphs (and a tree's private blocks). The
        # program holds the proposer, so the id stays unique.
        graphs = engine.spec_graphs
        from rltlab.engine.spec.tree_verify import TreeVerifier
        if isinstance(proposer, TreeProposer):
            if not static:
                raise ValueError("a TreeProposer needs the engine's static decode path "
                                 "(ExecutionConfig.fused_spec and the fused static decoder)")
            if id(proposer) not in graphs:
                from rltlab.engine.spec.tree_graph import TreeGraph
                graphs[id(proposer)] = TreeGraph(engine, proposer)
            self._tree = graphs[id(proposer)]
            from rltlab.engine.spec.tree_drafts import TreeDrafts
            # the generic steps borrow the program's private blocks for their forks first
            self._generic = TreeVerifier(engine, TreeDrafts(proposer), self,
                                         self._tree.private.flatten().tolist())
            return
        if not isinstance(proposer, DraftProposer):
            if not is_proposer(proposer):
                raise TypeError("set_proposer needs a DraftProposer, a TreeProposer or a "
                                "Proposer (callable propose and observe: "
                                f"rltlab.engine.spec.protocol), got {type(proposer).__name__}")
            self._generic = TreeVerifier(engine, proposer, self)
            return
        R = engine.num_rounds
        if not 1 <= proposer.draft_rounds < R:
            raise ValueError(f"DraftProposer.draft_rounds must lie in [1, {R - 1}], "
                             f"got {proposer.draft_rounds}")
        if static:
            from rltlab.engine.spec.draft_program import SpecGraph
            if id(proposer) not in graphs:
                graphs[id(proposer)] = SpecGraph(engine.runner, proposer)
            self._graph = graphs[id(proposer)]

    # ----------------------------------------------------------------------------- dispatch
    def eligible(self, seq: Sequence) -> bool:
        """The request's exit policy always runs R rounds (the speculation target)."""
        p, R = seq.params, self.engine.num_rounds
        if p.max_loops != R:
            return False
        if p.exit_policy == "fixed":
            return p.exit_policy_args.get("depth", R) == R
        return p.exit_policy in ("q_exit", "q_exit_delayed") and p.exit_threshold >= 1.0

    def _graph_takes(self, seq: Sequence) -> bool:
        """A TreeProposer's device program serves this request alone, greedy or sampled
        (top-k / top-p too), without log-probs (the generic verifier serves the rest)."""
        return seq.params.logprobs is None

    def max_concurrency(self) -> int | None:
        """Most running sequences that speculate (ExecutionConfig.spec_max_concurrency; its
        None: on CUDA SPEC_MAX_CONCURRENCY_CUDA, or SPEC_MAX_CONCURRENCY_CUDA_SAMPLED while a
        running sequence samples; no limit elsewhere)."""
        limit = getattr(self.engine.config.execution, "spec_max_concurrency", None)
        if limit is None and self.runner.device.type == "cuda":
            return SPEC_MAX_CONCURRENCY_CUDA_SAMPLED if self._sampling() else \
                SPEC_MAX_CONCURRENCY_CUDA
        return limit or None

    def _sampling(self) -> bool:
        """Whether a running sequence samples (T >= SAMPLING_EPS)."""
        return any(seq.params.temperature >= SAMPLING_EPS
                   for seq in self.engine.scheduler.running)

    def ready(self) -> bool:
        """True if this step should be speculative (see the module docstring). Where the
        answer is no for a reason that lasts (switched_off), it is warned once per engine."""
        eng = self.engine
        sch = eng.scheduler
        self._off = None
        if eng.paused or not sch.running:
            return False
        if not all(seq.at_token_boundary for seq in sch.running) or sch.can_admit():
            return False
        off = next((seq for seq in sch.running if not self.eligible(seq)), None)
        if off is not None:
            p = off.params
            self._off = "policy"
            self._warn("policy", f"speculative decoding is off while request "
                       f"{off.request_id!r} runs: its exit policy ({p.exit_policy!r}, "
                       f"max_loops={p.max_loops}, exit_threshold={p.exit_threshold}) does not "
                       f"run every token at full depth R={eng.num_rounds}, which speculation "
                       "verifies (exit_policy='fixed' or exit_threshold=1.0 speculate)")
            return False
        limit = self.max_concurrency()
        if limit is not None and len(sch.running) > limit:
            self._off = "concurrency"
            configured = eng.config.execution.spec_max_concurrency is not None
            which = f"ExecutionConfig.spec_max_concurrency={limit}" if configured else \
                f"the CUDA default of {limit}{' for sampled requests' if self._sampling() else ''}" \
                " (ExecutionConfig.spec_max_concurrency=None)"
            self._warn("concurrency", f"speculative decoding is off while {len(sch.running)} "
                       f"sequences run: above {which} (where speculation stops paying), the "
                       "engine decodes without it")
            return False
        return True

    def switched_off(self) -> bool:
        """The last ready() said no for a reason that lasts (a request not at full depth,
        concurrency above the limit): the step may decode as if no proposer were set."""
        return self._off is not None

    def _warn(self, reason: str, message: str) -> None:
        """warnings.warn(message) once per engine and reason."""
        warned = self.engine.__dict__.setdefault("_spec_warned", set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(message + " (warned once per engine)", SpeculationOffWarning,
                          stacklevel=4)

    # --------------------------------------------------------------------------------- step
    def _rounds(self, views: list[_View], count: int) -> torch.Tensor:
        """Run `count` rounds for the views' spans, one runner round each -> last h [T, H]
        in view order. With the runner's static path (CUDA graphs on a GPU), draft spans go
        through runner.execute and verification spans through runner.run_token_rows (their
        K + 1 positions as causal token rows); otherwise runner.prepare + run_round."""
        hidden = None
        static = getattr(self.runner, "static", None) is not None
        for _ in range(count):
            if static and views[0].span.exit_rounds is not None:   # verification: token rows
                rows = [(v, v.span.start + i, v.span.round) for v in views
                        for i in range(v.span.length)]
                hidden, _, _ = self.runner.run_token_rows(
                    rows, torch.cat([v.span.hidden for v in views]))
                order, sizes = views, [v.span.length for v in views]
            elif hasattr(self.runner, "execute"):
                order, rows, hidden, _ = self.runner.execute(views)
                sizes = rows.row_sizes
            else:
                batch = self.runner.prepare(views)
                hidden, _ = self.runner.run_round(batch)
                order, sizes = views, batch.row_sizes
            parts = dict(zip(map(id, order), hidden.split(sizes)))
            for view in views:
                view.span.round += 1
                view.span.hidden = parts[id(view)]
            if [id(v) for v in order] != [id(v) for v in views]:
                hidden = torch.cat([v.span.hidden for v in views])
        return hidden

    @torch.no_grad()
    def step(self):
        eng, prop = self.engine, self.proposer
        seqs = list(eng.scheduler.running)
        if self._tree is not None and len(seqs) == 1 and self._graph_takes(seqs[0]):
            return self._tree_step(seqs[0])
        if self._generic is not None:
            return self._generic.step(seqs)
        R, d, lm_head = eng.num_rounds, prop.draft_rounds, eng.model.lm_head
        k_max = max(0, min(prop.num_draft_tokens,
                           eng.config.max_num_batched_tokens // len(seqs) - 1))
        # each sequence's own K (DraftProposer.adaptive), capped by the batch and by the
        # tokens it may still emit
        own = [getattr(s, "spec_k", k_max) if prop.adaptive else k_max for s in seqs]
        ks = [max(0, min(k_max, own_k, s.max_output_tokens - s.num_output_tokens - 1))
              for s, own_k in zip(seqs, own)]
        if prop.adaptive:   # draft passes only as far as the longest K asks
            k_max = min(k_max, max(1, *ks))
        starts = [s.num_tokens - 1 for s in seqs]
        if self._graph is not None:
            return self._program_step(seqs, starts, ks, k_max)
        tokens = [[s.output_token_ids[-1]] for s in seqs]
        h_d = [[] for _ in seqs]
        q = [[] for _ in seqs]      # draft distributions (T > 0 rows only)
        for i in range(max(ks) + 1):                      # draft passes
            rows = [j for j in range(len(seqs)) if i <= ks[j]]
            views = [_View(seqs[j], Span(starts[j] + i, 1, None, True), tokens[j][i:])
                     for j in rows]
            hidden = self._rounds(views, d)
            for n, j in enumerate(rows):
                h_d[j].append(hidden[n])
            drafting = [n for n, j in enumerate(rows) if i < ks[j]]
            if drafting:
                logits = prop.draft_logits(hidden[drafting], lm_head)
                for n, x, qx in zip(drafting, *self._draw([seqs[rows[n]] for n in drafting],
                                                          logits)):
                    tokens[rows[n]].append(x)
                    q[rows[n]].append(qx)
        views = [_View(s, Span(starts[j], ks[j] + 1, torch.full((ks[j] + 1,), R), True,
                               round=d, hidden=torch.stack(h_d[j])), tokens[j])
                 for j, s in enumerate(seqs)]
        target = self.runner.logits(self._rounds(views, R - d))   # verify: rounds d+1..R
        sizes = [k + 1 for k in ks]
        best = iter(_split(target.argmax(-1).tolist(), sizes))      # one read-back for all
        finite = iter(_split(torch.isfinite(target).all(-1).tolist(), sizes))
        for j, (seq, rows) in enumerate(zip(seqs, target.split(sizes))):
            self._finish_seq(seq, starts[j], tokens[j][1:], q[j], rows, next(best),
                             all(next(finite)))
        return eng._drain_outputs()

    def _program_step(self, seqs: list[Sequence], starts: list[int], ks: list[int], k: int):
        """The iteration as one device program (draft_program); target logits only if a
        request wants log-probs."""
        results = self._graph.run(seqs, starts, ks, k)
        logits = [None] * len(seqs)
        if any(s.params.logprobs is not None for s in seqs):
            target = self.runner.logits(self._graph.verify_hidden(ks))
            logits = target.split([k_j + 1 for k_j in ks])
        for j, (seq, (drafts, n, nxt, finite)) in enumerate(zip(seqs, results)):
            if not finite:
                self.engine._finish(seq, "error", "non-finite logits")
                continue
            self._emit(seq, starts[j], drafts, n, nxt, logits[j])
        return self.engine._drain_outputs()

    def _tree_step(self, seq: Sequence):
        """Tree iterations, one a device program (tree_graph), up to
        ExecutionConfig.spec_pipeline such programs, each launched while the host handles the
        last one's tokens (one program for a streamed request)."""
        p = seq.params
        stops = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else frozenset(self.engine.eos_token_ids))
        for result in self._tree.run(seq, self._tree_launches(seq), stops):
            if seq.is_finished:
                continue
            path, nxt, finite, nodes = result
            if not finite:
                self.engine._finish(seq, "error", "non-finite logits")
                continue
            self._emit(seq, seq.num_tokens - 1, path, len(path), nxt, None, drafted=nodes)
        return self.engine._drain_outputs()

    def _tree_launches(self, seq: Sequence) -> int:
        """Programs a step for the sequence's tree steps."""
        return 1 if seq.request.stream else self.engine.config.execution.spec_pipeline

    def first_launcher(self, seq: Sequence, hidden: torch.Tensor):
        """Where `seq`, about to sample token 0 from `hidden` (a lone whole-prompt row), will
        be handed to the tree by the next step: a before_read for sampling.sample_finite that
        launches its first program from the token on the device (TreeGraph.launch_first);
        else None (prompt_step.py, ExecutionConfig.launch_behind_prompt)."""
        if self._tree is None or not (self.eligible(seq) and self._graph_takes(seq)):
            return None
        launches = self._tree_launches(seq)
        return lambda tokens, finite: self._tree.launch_first(seq, tokens, hidden, launches)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor):
        """Draft tokens (argmax at T = 0, else sampled from q with the sequence's generator)
        -> (tokens, q rows or None)."""
        greedy = logits.argmax(-1).tolist()
        out_tokens, out_q = [], []
        for n, seq in enumerate(seqs):
            p = seq.params
            if p.temperature == 0:
                out_tokens.append(greedy[n])
                out_q.append(None)
                continue
            qn = torch.softmax(_processed(logits[n: n + 1], p)[0], -1)
            out_tokens.append(int(torch.multinomial(qn, 1, generator=seq.generator)))
            out_q.append(qn)
        return out_tokens, out_q

    def _finish_seq(self, seq: Sequence, start: int, drafts: list[int], q, logits,
                    best: list[int], finite: bool) -> None:
        """Host loop: accept / correct / bonus for one sequence, then _emit. logits [k+1, V]
        fp32 of the target at positions start..start+k; best = their argmax."""
        eng, p, k = self.engine, seq.params, len(drafts)
        if not finite:
            eng._finish(seq, "error", "non-finite logits")
            return
        processed = None
        if p.temperature == 0:
            if p.top_k > 0 or p.top_p < 1:   # the sampler's argmax over processed (exact ties)
                processed = _processed(logits, p)
                best = processed.argmax(-1).tolist()
            n = next((i for i in range(k) if drafts[i] != best[i]), k)
            nxt = best[n]
        else:
            processed = _processed(logits, p)
            n, nxt = _reject_sample(drafts, q, torch.softmax(processed, -1), seq.generator)
        self._emit(seq, start, drafts, n, nxt, logits, processed)

    def _emit(self, seq: Sequence, start: int, drafts: list[int], n: int, nxt: int, logits,
              processed=None, drafted: int | None = None) -> None:
        """Append drafts[:n] and nxt with their log-probs (logits: the target's [k+1, V] rows,
        needed only for log-probs), update the stats (drafted: the tokens verified, if not
        the drafts: a tree's nodes), stop checks."""
        emitted = drafts[:n] + [nxt]
        logps, tops = _logprobs(logits, processed, emitted, seq.params,
                                self.engine.config.logprobs_mode)
        self._append(seq, start, emitted, logps, tops, len(drafts) if drafted is None else drafted,
                     n)

    def _append(self, seq: Sequence, start: int, emitted: list[int], logps, tops, drafted: int,
                n: int) -> int:
        """Append the iteration's tokens (n accepted drafts and the target's next token) with
        their log-probs, update the stats (drafted: the nodes verified), stop checks -> the
        tokens appended (fewer where a stop ended the sequence)."""
        eng = self.engine
        stats = getattr(seq, "spec_stats", None) or SpecStats()
        seq.spec_stats = stats
        stats.steps, stats.drafted = stats.steps + 1, stats.drafted + drafted
        stats.accepted, stats.emitted = stats.accepted + n, stats.emitted + n + 1
        if isinstance(self.proposer, DraftProposer) and self.proposer.adaptive and drafted:
            seq.spec_k = self.proposer.next_draft_length(drafted, n)
        for i, token in enumerate(emitted):
            seq.append_token(token, logps[i], tops[i], eng.num_rounds, eng.num_rounds,
                             eng.weights.version)
            seq.spec_tokens = getattr(seq, "spec_tokens", 0) + 1
            if seq.request.stream:
                eng._streamed[seq.request_id] = seq.request
            eng._check_stop(seq, token)
            if seq.is_finished:
                return i + 1
        seq.num_computed = start + len(emitted)   # P..P+n are final in every plane
        return len(emitted)


def _split(values: list, sizes: list[int]) -> list[list]:
    out, lo = [], 0
    for n in sizes:
        out.append(values[lo: lo + n])
        lo += n
    return out


def _processed(logits: torch.Tensor, p) -> torch.Tensor:
    rows, dev = logits.shape[0], logits.device
    return process_logits(logits, torch.full((rows,), float(p.temperature), device=dev),
                          torch.full((rows,), p.top_k, device=dev),
                          torch.full((rows,), float(p.top_p), device=dev))


def _reject_sample(drafts: list[int], q: list[torch.Tensor], probs: torch.Tensor, gen):
    """Rejection sampling (lossless): -> (accepted count n, next token)."""
    k = len(drafts)
    if k:
        x = torch.tensor(drafts, device=probs.device)
        q_t = torch.stack(q)
        p_x, q_x = probs[:k].gather(-1, x[:, None])[:, 0], q_t.gather(-1, x[:, None])[:, 0]
        u = torch.rand(k, generator=gen, device=gen.device).to(probs.device)
        n = int((u * q_x < p_x).long().cumprod(0).sum())   # u < min(1, p/q); q_x > 0 (x ~ q)
    else:
        n = 0
    dist = probs[n]
    if n < k:
        resid = (probs[n] - q_t[n]).clamp(min=0)
        mass = resid.sum()
        dist = resid / mass if mass > 0 else probs[n]
    return n, int(torch.multinomial(dist, 1, generator=gen))


def _logprobs(logits, processed, emitted, p, mode):
    """Per emitted token i (from target row i): log-prob and top-k dict, as the sampler does."""
    m = len(emitted)
    if p.logprobs is None:
        return [None] * m, [None] * m
    if mode != "raw_logprobs" and processed is None:
        processed = _processed(logits, p)
    logp = torch.log_softmax((logits if mode == "raw_logprobs" else processed)[:m], -1)
    chosen = logp.gather(-1, torch.tensor(emitted, device=logp.device)[:, None])[:, 0].tolist()
    tops = [None] * m
    if p.logprobs > 0:
        vals, ids = logp.topk(p.logprobs, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen, tops
