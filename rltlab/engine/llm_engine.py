"""LLMEngine: requests in, one round per step, RequestOutputs out.

    step():  schedule rows -> run one round -> decide exits -> tell observers
             -> advance spans (LAST_EXITED copies) -> sample exiting rows -> finished outputs
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable

import torch

from rltlab.engine.block_manager import BlockManager
from rltlab.engine.config import EngineConfig
from rltlab.engine.exit_policies import ExitPolicy, RoundInfo, create_exit_policy
from rltlab.engine.hooks import DraftProposer, ObserverHandle, RoundEvent, RoundObserver
from rltlab.engine.model_runner import ModelRunner, StepRows, place_model
from rltlab.engine.outputs import RequestOutput, build_output
from rltlab.engine.sampling import SamplingParams, sample
from rltlab.engine.scheduler import Scheduler
from rltlab.engine.sequence import PendingDecision, Request, Sequence, SeqStatus
from rltlab.engine.weights import WeightUpdater
from rltlab.model import OuroForCausalLM


class LLMEngine:
    def __init__(self, model: OuroForCausalLM, config: EngineConfig | None = None,
                 tokenizer=None, weight_version: int = 0):
        self.config = config = config or EngineConfig()
        param = next(model.parameters())
        static = config.use_static_decode(torch.device(config.device or param.device))
        self.model = place_model(model, config.dtype, config.device, own=static)
        self.model_config, self.tokenizer = self.model.config, tokenizer
        self.num_rounds = self.model_config.num_rounds
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        num_blocks = config.resolve_num_blocks(self.model_config, self.max_model_len,
                                               next(self.model.parameters()).element_size())
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager, self.num_rounds)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size,
                                  static_decode=static, max_batch=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  cuda_graphs=config.cuda_graphs, compile=config.compile)
        self.weights = WeightUpdater(self.model, weight_version)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_token_id is None:
            self.eos_token_id = self.model_config.eos_token_id
        self.policies = {config.exit_policy: create_exit_policy(
            config.exit_policy, self.model_config, **config.exit_policy_args)}
        # g_1..g_R of every running decode token, one row per sequence (policies read it on the
        # device; rows are handed out on first use and returned when the sequence finishes).
        self._gate_history = torch.zeros(config.max_num_seqs, self.num_rounds,
                                         dtype=torch.float32, device=self.runner.device)
        self._free_gate_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.requests: dict[str, Request] = {}
        self.paused = False
        self.observers: list[ObserverHandle] = []
        self.proposer: DraftProposer | None = None
        self._outputs: list[RequestOutput] = []
        self._failed: dict[int, str] = {}   # seq_id -> why, within one step
        self._streamed: dict[str, Request] = {}
        self._seq_ids, self._request_ids = itertools.count(), itertools.count()

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, stream: bool = False) -> str:
        if self.weights.state == self.weights.FAILED:
            self.weights.check_ready()
        auto = False
        while request_id is None or (auto and request_id in self.requests):
            auto, request_id = True, str(next(self._request_ids))
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is not a str or is already running")
        prompt = self._check_prompt(prompt_token_ids)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.resolve(
            num_rounds=self.num_rounds, vocab_size=self.model_config.vocab_size,
            default_min_loops=self.config.default_min_loops,
            default_threshold=self.model_config.early_exit_threshold,
            default_policy=self.config.exit_policy)
        self.policy(params.exit_policy).validate(params, self.num_rounds)
        max_output = min(params.max_tokens, self.max_model_len - len(prompt))
        reserved = len(prompt) + max_output - 1
        self.block_manager.check_fits(reserved, f"request {request_id!r}")
        request = Request(request_id, prompt, params, stream)
        for index in range(params.n):
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.sample_seed(index))
            seq = Sequence(next(self._seq_ids), request, index, gen)
            seq.max_output_tokens, seq.reserved_positions = max_output, reserved
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _check_prompt(self, tokens) -> list[int]:
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        tokens = [int(t) for t in tokens]
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt_token_ids hold ids outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(f"prompt of {len(tokens)} tokens leaves no room to generate: "
                             f"max_model_len is {self.max_model_len}")
        return tokens

    def policy(self, name: str) -> ExitPolicy:
        if name not in self.policies:
            self.policies[name] = create_exit_policy(name, self.model_config)
        return self.policies[name]

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Abort requests (their blocks are freed now; the final output comes from step())."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        found = False
        for rid in ids:
            request = self.requests.get(rid)
            for seq in request.seqs if request else []:
                if not seq.is_finished:
                    self._finish(seq, "abort")
            found |= request is not None
        return found

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        self.weights.check_ready()
        if self.proposer is not None and self._spec.ready():   # all decoding: speculate
            return self._spec.step()
        seqs = [] if self.paused else self.scheduler.schedule()
        if seqs:
            self._failed = {}
            seqs, rows, hidden, gate_logits = self.runner.execute(seqs)
            exits = self._decide_exits(seqs, rows, hidden, gate_logits)
            if self.observers:
                self._notify_observers(seqs, rows, hidden, gate_logits, exits)
            emitting = self._advance_spans(seqs, rows, hidden, exits)
            self._sample(emitting)
            for seq in seqs:
                if seq.seq_id in self._failed and not seq.is_finished:
                    self._finish(seq, "error", self._failed[seq.seq_id])
        return self._drain_outputs()

    def _decide_exits(self, seqs, batch: StepRows, hidden, gate_logits) -> torch.Tensor:
        """bool [T] on the host: which tokens leave after this round (fixed spans: their
        recorded exit; decode tokens: max_loops, a committed plan, a lagged answer that is due
        now, or their policy's answer now). Reads the device only for policies that need it."""
        exits = torch.zeros(len(batch.slot_list), dtype=torch.bool)
        asking: dict[str, list[tuple[int, Sequence]]] = {}
        gate_rows: list[tuple[int, Sequence]] = []
        for seq, lo in zip(seqs, _offsets(batch.row_sizes)):
            span, rnd = seq.span, seq.span.round + 1
            if span.exit_rounds is not None:
                exits[lo: lo + span.num_active] = span.exit_rounds[span.active] == rnd
                continue
            policy = self.policy(seq.params.exit_policy)
            if policy.reads_gates:
                gate_rows.append((lo, seq))
            self._read_due_decisions(seq, rnd)
            if rnd >= min(self.num_rounds, seq.params.max_loops) or span.planned_exit == rnd:
                exits[lo] = True
            elif span.planned_exit is None and seq.seq_id not in self._failed:
                asking.setdefault(policy.name, []).append((lo, seq))
        if gate_rows:
            self._record_gates(gate_rows, gate_logits)
        for name, rows in asking.items():
            self._ask_policy(self.policy(name), rows, hidden, exits)
        return exits

    def _record_gates(self, rows, gate_logits) -> None:
        """g_r of each decode token into its sequence's row of the device gate history."""
        for _, seq in rows:
            if seq.gate_row is None:
                seq.gate_row = self._free_gate_rows.pop()
        dev = gate_logits.device
        tokens = torch.tensor([lo for lo, _ in rows]).to(dev, non_blocking=True)
        hist_rows = torch.tensor([seq.gate_row for _, seq in rows]).to(dev, non_blocking=True)
        cols = torch.tensor([seq.span.round for _, seq in rows]).to(dev, non_blocking=True)
        self._gate_history[hist_rows, cols] = gate_logits[tokens]

    def _read_due_decisions(self, seq: Sequence, rnd: int) -> None:
        span = seq.span
        due = [p for p in span.pending if p.due_round == rnd]
        if not due:
            return
        span.pending = [p for p in span.pending if p.due_round != rnd]
        for decision in due:
            target = decision.read()
            if target == 0 or span.planned_exit is not None:
                continue
            if rnd <= target <= self.num_rounds:
                span.planned_exit = target
            else:
                self._failed[seq.seq_id] = (
                    f"exit policy {decision.policy!r} answered round {target} after round "
                    f"{decision.asked_round} (its decision_lag promises >= {decision.due_round})")

    def _ask_policy(self, policy, rows, hidden, exits) -> None:
        rounds = torch.tensor([seq.span.round + 1 for _, seq in rows])
        gates = None
        if policy.reads_gates:
            hist_rows = torch.tensor([seq.gate_row for _, seq in rows]).to(hidden.device,
                                                                           non_blocking=True)
            done = torch.arange(self.num_rounds)[None, :] < rounds[:, None]
            gates = self._gate_history[hist_rows] * done.to(hidden.device, non_blocking=True)
        info = RoundInfo(rounds, gates, hidden[[lo for lo, _ in rows]],
                         [seq for _, seq in rows], self.num_rounds)
        try:
            targets = policy.decide(info)
            if len(targets) != len(rows):
                raise RuntimeError(f"returned {len(targets)} targets for {len(rows)} rows")
            if policy.decision_lag > 0:
                self._defer(policy, rows, rounds.tolist(), targets)
                return
            targets = targets.tolist()
        except Exception as err:  # isolate the failing request(s): retry one row at a time
            if len(rows) > 1:
                for row in rows:
                    self._ask_policy(policy, [row], hidden, exits)
            else:
                self._failed[rows[0][1].seq_id] = f"exit policy {policy.name!r} failed: {err!r}"
            return
        for (lo, seq), target, rnd in zip(rows, targets, rounds.tolist()):
            if target == rnd:
                exits[lo] = True
            elif target > rnd and target <= self.num_rounds:
                seq.span.planned_exit = int(target)
            elif target != 0:
                self._failed[seq.seq_id] = (f"exit policy {policy.name!r} answered round "
                                            f"{target} after round {rnd}")

    def _defer(self, policy, rows, rounds: list[int], targets: torch.Tensor) -> None:
        """Start the device->host copy of a lagged policy's answers; read decision_lag rounds
        later (PendingDecision.read), so this round's work never waits for the host."""
        ready = None
        if targets.device.type == "cuda":
            host = torch.empty(targets.shape, dtype=targets.dtype, pin_memory=True)
            host.copy_(targets, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = targets
        for i, ((_, seq), rnd) in enumerate(zip(rows, rounds)):
            seq.span.pending.append(PendingDecision(rnd + policy.decision_lag, rnd, policy.name,
                                                    host, i, ready))

    def _notify_observers(self, seqs, batch: StepRows, hidden, gate_logits, exits) -> None:
        want_logits = any(o.with_logits for o in self.observers)
        event = RoundEvent.build(seqs, batch.row_sizes, batch.rounds, batch.positions, hidden,
                                 gate_logits, exits, self.weights.version,
                                 self.runner.logits(hidden) if want_logits else None)
        for observer in list(self.observers):
            observer.fn(event)

    def _advance_spans(self, seqs, batch: StepRows, hidden, exits) -> list:
        """Move every row one round on; LAST_EXITED copies for tokens leaving before R.
        Returns (seq, h, exit round) for the rows whose last token samples now."""
        copy_slots, copy_rounds, emitting = [], [], []
        exit_list, slot_list = exits.tolist(), batch.slot_list
        for seq, lo, n in zip(seqs, _offsets(batch.row_sizes), batch.row_sizes):
            if seq.seq_id in self._failed:
                continue
            span = seq.span
            span.round += 1
            leave = exit_list[lo: lo + n]
            if not any(leave):
                span.hidden = hidden[lo: lo + n]
                continue
            if span.round < self.num_rounds:
                leaving = [slot for slot, out in zip(slot_list[lo: lo + n], leave) if out]
                copy_slots += leaving
                copy_rounds += [span.round] * len(leaving)
            if span.emits and leave[-1] and int(span.active[-1]) == span.length - 1:
                emitting.append((seq, hidden[lo + n - 1], span.round))
            if all(leave):
                seq.num_computed, seq.span = span.start + span.length, None
            else:
                stay = ~exits[lo: lo + n]
                span.active, span.hidden = span.active[stay], hidden[lo: lo + n][stay]
        self.runner.last_exited_copy(copy_slots, copy_rounds)
        return emitting

    def _sample(self, emitting) -> None:
        if not emitting:
            return
        logits = self.runner.logits(torch.stack([h for _, h, _ in emitting]))
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for (seq, _, _), ok in zip(emitting, finite):
            if not ok:
                self._failed[seq.seq_id] = "non-finite logits"
        keep = [i for i, ok in enumerate(finite) if ok]
        if not keep:
            return
        rows = [emitting[i] for i in keep]
        result = sample(logits[keep], [s.params for s, _, _ in rows],
                        [s.generator for s, _, _ in rows], self.config.logprobs_mode)
        for i, (seq, _, depth) in enumerate(rows):
            token = result.tokens[i]
            seq.append_token(token, result.logprobs[i], result.top_logprobs[i], depth, depth,
                             self.weights.version)
            if seq.request.stream:
                self._streamed[seq.request_id] = seq.request
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if token == self.eos_token_id and not seq.params.ignore_eos:
            self._finish(seq, "stop")
        elif token in seq.params.stop_token_ids:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_output_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(seq)
        if seq.gate_row is not None:
            self._free_gate_rows.append(seq.gate_row)
            seq.gate_row = None
        seq.status, seq.finish_reason, seq.error = SeqStatus.FINISHED, reason, error
        request = seq.request
        if request.is_finished and request.request_id in self.requests:
            request.finished_time = time.perf_counter()
            del self.requests[request.request_id]
            self._streamed.pop(request.request_id, None)
            self._outputs.append(build_output(request, self.weights.version, self.tokenizer))

    def _drain_outputs(self) -> list[RequestOutput]:
        outputs = self._outputs + [build_output(r, self.weights.version, self.tokenizer)
                                   for r in self._streamed.values()]
        self._outputs, self._streamed = [], {}
        return outputs

    # ---------------------------------------------------------------------- weight updates
    def start_weight_update(self, version: int) -> None:
        self.weights.start(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.weights.update(named_tensors)

    def finish_weight_update(self) -> int:
        version = self.weights.finish()
        for seq in self.scheduler.running:   # K/V from older weights is never reused
            seq.reset_computation()
        return version

    def get_weight_version(self) -> int:
        return self.weights.version

    def pause_generation(self, mode: str = "keep") -> None:
        """keep: in-flight requests wait (recomputed if the weights change); abort: end them."""
        if mode not in ("keep", "abort"):
            raise ValueError(f"pause_generation mode must be 'keep' or 'abort', got {mode!r}")
        self.paused = True
        if mode == "abort":
            self.abort_request(list(self.requests))

    def resume_generation(self) -> None:
        self.paused = False

    def reset_prefix_cache(self) -> bool:
        """No prefix cache exists (nothing is shared between requests or versions): True."""
        return True

    # --------------------------------------------------------------------------------- hooks
    def add_round_observer(self, fn: RoundObserver, with_logits: bool = False) -> ObserverHandle:
        handle = ObserverHandle(fn, with_logits)
        self.observers.append(handle)
        return handle

    def remove_round_observer(self, handle: ObserverHandle) -> None:
        self.observers.remove(handle)

    def set_proposer(self, proposer: DraftProposer | None) -> None:
        """Loop-aware speculative decoding (rltlab.engine.spec_decode; docs/engine.md): a
        DraftProposer(num_draft_tokens, draft_rounds, head) turns it on, None turns it off."""
        spec = None
        if proposer is not None:
            from rltlab.engine.spec_decode import SpecDecoder
            spec = SpecDecoder(self, proposer)   # validates
        self.proposer, self._spec = proposer, spec


def _offsets(sizes: list[int]) -> list[int]:
    return list(itertools.accumulate([0] + sizes[:-1]))
