"""LLMEngine: requests in, one round per step, RequestOutputs out.

    step():  [a token window (token_window.py), whole tokens (token_step.py) or a round window
             (round_window.py) when every row decodes under host-fixed depths; otherwise:]
             schedule rows (while rows prefill, decode rows wait: ExecutionConfig.prefill_first)
             [rows that are all fresh whole prompts: their R rounds and token 0 in one step
             (prompt_step.py); otherwise:]
             -> ask round-0 policies (decode tokens about to run round 1) -> run one round
             -> decide exits -> tell observers / the decode capture -> advance spans
             (LAST_EXITED copies)
             -> samples waiting for a prompt computed now take it over (groups.py)
             -> sample exiting rows -> finished outputs

EngineConfig.exit_semantics = "select_only": every token runs all R rounds (no copies); the
output round of a sampling position is selected at round R (rltlab.engine.select_only).
"""
from __future__ import annotations

import itertools
import operator
import time
from typing import Iterable

import numpy as np
import torch

from rltlab.common.device import to_device
from rltlab.engine.block_manager import BlockManager
from rltlab.engine.config import EngineConfig
from rltlab.engine.exit_decider import ExitDecider
from rltlab.engine.exit_policies import ExitPolicy, create_exit_policy
from rltlab.engine.groups import fork_followers
from rltlab.engine.hooks import DecodeCapture, ObserverHandle, RoundEvent, RoundObserver
from rltlab.engine.model_runner import ModelRunner, StepRows, place_model
from rltlab.engine.outputs import RequestOutput, build_output
from rltlab.engine.sampling import SamplingParams, sample_finite
from rltlab.engine.scheduler import Scheduler
from rltlab.engine.spec.proposers import DraftProposer, TreeProposer
from rltlab.engine import select_only, stop_strings
from rltlab.engine.prompt_step import WholePrompts
from rltlab.engine.round_window import RoundWindow
from rltlab.engine.token_step import FusedTokenStep
from rltlab.engine.token_window import TokenWindow
from rltlab.engine.sequence import Request, Sequence, SeqStatus
from rltlab.engine.weights import WeightUpdater
from rltlab.model.architecture import SELECT_ONLY, OuroForCausalLM


def _token_id(token) -> int | None:
    """An integer id (int, numpy or 0-d torch integer) as an int; None for anything else
    (float, str, bool: coercing them would hide a caller's bug)."""
    if isinstance(token, (bool, np.bool_)) or (isinstance(token, torch.Tensor)
                                              and token.dtype == torch.bool):
        return None
    try:
        return operator.index(token)
    except TypeError:
        return None


def _checked_id(position: int, token, vocab: int) -> int:
    """prompt_token_ids[position] as an int id in [0, vocab), or a ValueError naming it."""
    token_id = _token_id(token)
    if token_id is None:
        raise ValueError(f"prompt_token_ids[{position}] = {token!r} is not an integer token id "
                         f"({type(token).__name__})")
    if not 0 <= token_id < vocab:
        raise ValueError(f"prompt_token_ids[{position}] = {token_id} lies outside the "
                         f"vocabulary [0, {vocab})")
    return token_id


class LLMEngine:
    def __init__(self, model: OuroForCausalLM, config: EngineConfig | None = None,
                 tokenizer=None, weight_version: int = 0, *, private_model: bool = False):
        """The engine works on its own copy of `model` (the caller's model, its values and its
        train/eval mode are never touched; only the weight-update API changes the engine's
        weights). private_model=True: nobody else holds `model` (build_engine loaded it), so
        it is used without a copy."""
        self.config = config = config or EngineConfig()
        param = next(model.parameters())
        device = torch.device(config.device or param.device)
        static = config.use_static_decode(device)
        run = config.execution
        self.model = place_model(model, config.dtype, device, copy=not private_model)
        self.model_config, self.tokenizer = self.model.config, tokenizer
        self.num_rounds = self.model_config.num_rounds
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        num_blocks = config.resolve_num_blocks(self.model_config, self.max_model_len,
                                               next(self.model.parameters()).element_size(),
                                               device)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager, self.num_rounds)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size,
                                  static_decode=static, max_batch=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  cuda_graphs=run.cuda_graphs, compile=run.compile,
                                  small_batch_kernels=run.small_batch_kernels,
                                  gemv_rows=run.gemv_rows,
                                  pdl=run.pdl, fused_qkv_rope=run.fused_qkv_rope,
                                  l2_prefetch_mb=run.l2_prefetch_mb,
                                  fused_prefill=run.fused_prefill,
                                  cudnn_prefill_after=run.cudnn_prefill_after,
                                  pad_prefill_attention=run.pad_prefill_attention,
                                  shared_prefix_attention=run.shared_prefix_attention,
                                  prefill_graph_tokens=run.prefill_graph_tokens)
        self.weights = WeightUpdater(self.model, weight_version)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        # every id of a list-valued config eos_token_id stops too (as in HF generate)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | (
            set() if self.eos_token_id is None else {self.eos_token_id})
        if self.eos_token_id is None:
            self.eos_token_id = next(iter(self.model_config.eos_token_ids), None)
        self.policies = {config.exit_policy: create_exit_policy(
            config.exit_policy, self.model_config, **config.exit_policy_args)}
        self.select_only = config.exit_semantics == SELECT_ONLY
        if self.select_only:
            select_only.check_policy(self.policies[config.exit_policy], "EngineConfig.exit_policy")
        self.exit_decider = ExitDecider(self, config.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.paused = False
        self.observers: list[ObserverHandle] = []
        self.capture: DecodeCapture | None = None   # set_decode_capture
        self.proposer: DraftProposer | TreeProposer | None = None
        self.spec_graphs: dict = {}   # id(proposer) -> its SpecGraph (spec_decode)
        # select_only needs every round's state of a token: no whole-token launches
        self._whole_tokens = (FusedTokenStep(self) if static and run.fused_tokens
                              and not self.select_only else None)
        self._round_window = (RoundWindow(self, run.round_window)
                              if self._whole_tokens and run.round_window else None)
        self._token_window = (TokenWindow(self, run.token_window)
                              if self._whole_tokens and run.token_window > 1 else None)
        self._whole_prompts = WholePrompts(self) if run.whole_prompt_steps else None
        self._outputs: list[RequestOutput] = []
        self._failed: dict[int, str] = {}   # seq_id -> why, within one step
        self._streamed: dict[str, Request] = {}
        self._seq_ids, self._request_ids = itertools.count(), itertools.count()

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, stream: bool = False) -> str:
        auto = False
        while request_id is None or (auto and request_id in self.requests):
            auto, request_id = True, str(next(self._request_ids))
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is not a str or is already running")
        prompt = self._check_prompt(prompt_token_ids)
        params = self.resolve_params(SamplingParams() if params is None else params)
        policy = self.policy(params.exit_policy)
        policy.check_arg_names(params)
        policy.validate(params, self.num_rounds)
        if self.select_only:
            select_only.check_policy(policy, f"request {request_id!r}")
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

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """The effective params a request with `params` runs under (SamplingParams.resolve with
        this engine's model and defaults; a seed is drawn where none is given)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to read the output text: "
                             "build the engine with one (or use stop_token_ids)")
        return params.resolve(
            num_rounds=self.num_rounds, vocab_size=self.model_config.vocab_size,
            default_min_loops=self.config.resolve_default_min_loops(),
            default_threshold=self.model_config.early_exit_threshold,
            default_policy=self.config.exit_policy)

    def _check_prompt(self, tokens) -> list[int]:
        """Plain int ids in [0, vocab): a float, str or bool is refused, not coerced."""
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        # Plain ints in range, the common case, are checked in C (min/max): checking each
        # token in Python cost ~1 ms per 1K-token prompt, paid between engine steps (GPU idle)
        # for every request a closed loop admits. Anything else is checked token by token,
        # which names the first bad position.
        if set(map(type, tokens)) == {int} and 0 <= min(tokens) and max(tokens) < vocab:
            tokens = list(tokens)
        else:
            tokens = [_checked_id(i, token, vocab) for i, token in enumerate(tokens)]
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
        if self.proposer is not None:
            if self._spec.ready():   # all decoding: speculate
                return self._spec.step()
            if self._spec.switched_off():   # e.g. above spec_max_concurrency: decode as
                proposer, self.proposer = self.proposer, None   # target only does, windows
                try:                                            # and whole tokens included
                    return self.step()
                finally:
                    self.proposer = proposer
        depth = self._whole_tokens.ready() if self._whole_tokens else None
        if isinstance(depth, int):   # all decoding at one host-fixed depth: one launch a token
            if self._token_window and self._token_window.fits(self.scheduler.running):
                return self._token_window.step(depth)   # several tokens, one read-back
            return self._whole_tokens.step(depth)
        window = self._round_window.plan() if self._round_window else None
        if window:   # mixed host-fixed depths: round steps, the host once per window
            return self._round_window.step(window)
        if depth:   # mixed depths, whole tokens deepest first
            return self._whole_tokens.step(depth)
        hold = self._whole_tokens.hold() if self._whole_tokens else frozenset()
        if self._round_window:   # prefill first (ExecutionConfig.prefill_first): decode rows wait
            hold |= self._round_window.held()
        seqs = [] if self.paused else self.scheduler.schedule(hold)
        if seqs and self._whole_prompts and self._whole_prompts.fits(seqs):
            self._whole_prompts.step(seqs)   # fresh prompts: all R rounds in one step
        elif seqs:
            self._failed = {}
            self.exit_decider.ask_before_round1(seqs)   # round-0 (lookahead) policies only
            seqs, rows, hidden, gate_logits = self.runner.execute(seqs)
            exits = self.exit_decider.decide(seqs, rows, hidden, gate_logits)
            if self.observers:
                self._notify_observers(seqs, rows, hidden, gate_logits, exits)
            if self.capture is not None:
                self._capture_round(seqs, rows, hidden, gate_logits)
            emitting = self._advance_spans(seqs, rows, hidden, gate_logits, exits)
            forked = fork_followers(self.runner, seqs, emitting)   # n > 1: one prefill
            self._sample(emitting + forked)
            self._finish_failed(seqs + [seq for seq, _, _ in forked])
        return self._drain_outputs()

    def _finish_failed(self, seqs) -> None:
        """End the step's sequences that failed in it (self._failed) with an error output."""
        for seq in seqs:
            if seq.seq_id in self._failed and not seq.is_finished:
                self._finish(seq, "error", self._failed[seq.seq_id])

    def _notify_observers(self, seqs, batch: StepRows, hidden, gate_logits, exits) -> None:
        want_logits = any(o.with_logits for o in self.observers)
        event = RoundEvent.build(seqs, batch.row_sizes, batch.rounds, batch.positions, hidden,
                                 gate_logits, exits, self.weights.version,
                                 self.runner.logits(hidden) if want_logits else None)
        for observer in list(self.observers):
            observer.fn(event)

    def _capture_round(self, seqs, batch: StepRows, hidden, gate_logits) -> None:
        """The step's decode rows (one token each) to the decode capture."""
        decode = [(seq, lo) for seq, lo in zip(seqs, batch.offsets)
                  if seq.span.exit_rounds is None]
        if not decode:
            return
        starts = [lo for _, lo in decode]
        rows = to_device(starts, torch.int64, hidden.device)
        self.capture.round([seq for seq, _ in decode],
                           [batch.position_list[lo] for lo in starts],
                           [batch.round_list[lo] for lo in starts],
                           hidden.index_select(0, rows), gate_logits.index_select(0, rows),
                           self.weights.version)

    def _capture_tokens(self, seqs: list[Sequence], positions: list[int], depth: int,
                        rows: torch.Tensor | None = None) -> None:
        """After a capturing whole-token launch (StaticDecoder.launch_token): hand the decode
        capture rounds 1..depth of the launch's rows `rows` (device int64; default 0..n-1),
        seqs[i]'s token at positions[i] in row rows[i]."""
        static = self.runner.static
        hidden, gates = static.captured_hidden[:, :depth], static.captured_gates[:, :depth]
        if rows is None:   # copies: the next launch overwrites the buffers
            hidden, gates = hidden[: len(seqs)].clone(), gates[: len(seqs)].clone()
        else:
            hidden, gates = hidden.index_select(0, rows), gates.index_select(0, rows)
        self.capture.tokens(seqs, positions, hidden, gates, self.weights.version)

    def _advance_spans(self, seqs, batch: StepRows, hidden, gate_logits, exits) -> list:
        """Move every row one round on; LAST_EXITED copies for tokens leaving before R.
        Returns (seq, h, exit round) for the rows whose last token samples now (select_only:
        h and round of the selected round)."""
        copy_slots, copy_rounds, emitting, emit_states = [], [], [], []
        exit_list, slot_list = exits.tolist(), batch.slot_list
        for seq, lo, n in zip(seqs, batch.offsets, batch.row_sizes):
            if seq.seq_id in self._failed:
                continue
            span = seq.span
            span.round += 1
            if self.select_only and span.emits:   # nothing leaves before R: row n-1 samples
                # clones: the static path's output buffers are overwritten next round
                span.select_states.append((hidden[lo + n - 1].clone(),
                                           gate_logits[lo + n - 1].clone()))
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
                emit_states.append(span.select_states)
            if all(leave):
                seq.num_computed, seq.span = span.start + span.length, None
            else:
                stay = ~exits[lo: lo + n]
                span.active, span.hidden = span.active[stay], hidden[lo: lo + n][stay]
        self.runner.last_exited_copy(copy_slots, copy_rounds)
        if self.select_only:
            return select_only.choose_outputs(emitting, emit_states, self.policy)
        return emitting

    def _sample(self, emitting, before_read=None) -> None:
        """before_read: sampling.sample_finite's (a launch behind a whole-prompt step)."""
        if not emitting:
            return
        finite, result = sample_finite(self.runner, torch.stack([h for _, h, _ in emitting]),
                                       [s.params for s, _, _ in emitting],
                                       [s.generator for s, _, _ in emitting],
                                       self.config.logprobs_mode, before_read=before_read)
        for (seq, _, _), ok in zip(emitting, finite):
            if not ok:
                self._failed[seq.seq_id] = "non-finite logits"
        if result is None:
            return
        for seq, h, _ in emitting:   # the state output token num_output_tokens comes from
            seq.emit_hidden = (seq.num_output_tokens, h)
        kept = [row for row, ok in zip(emitting, finite) if ok]
        for i, (seq, _, depth) in enumerate(kept):
            self._accept_token(seq, result.tokens[i], result.logprobs[i], result.top_logprobs[i],
                               depth)

    def _accept_token(self, seq: Sequence, token: int, logprob, top_logprobs, depth: int) -> None:
        """Append a sampled token (its input position exited at round `depth`), then stop?"""
        executed = self.num_rounds if self.select_only else depth
        seq.append_token(token, logprob, top_logprobs, depth, executed, self.weights.version)
        if seq.request.stream:
            self._streamed[seq.request_id] = seq.request
        self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            self._finish(seq, "stop")
        elif token in seq.params.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, "stop")
        elif seq.params.stop and self._stop_string(seq):
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_output_tokens:
            self._finish(seq, "length")

    def _stop_string(self, seq: Sequence) -> bool:
        """Whether the output text now holds one of the request's stop strings (rltlab.engine.
        stop_strings: the earliest one ending in the newest token's text); if so, record it
        and where it cuts the text."""
        found = stop_strings.find_stop(self.tokenizer, seq.output_token_ids, seq.params.stop)
        if found is None:
            return False
        seq.stop_reason, start = found
        seq.text_end = start + (len(found[0]) if seq.params.include_stop_str_in_output else 0)
        return True

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(seq)
        self.exit_decider.release(seq)
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

    @property
    def decode_capture_available(self) -> bool:
        """Whether this engine runs whole-token steps, the decode capture's fast path (the
        static decode path, ExecutionConfig.fused_tokens, not select_only)."""
        return self._whole_tokens is not None

    def set_decode_capture(self, capture: DecodeCapture | None) -> None:
        """Hand every decode token's per-round h_r and gate logit to `capture` (a
        hooks.DecodeCapture) from now on, None: stop. Unlike a round observer it leaves
        whole-token steps and token windows running (hooks.py); round windows, and whole
        tokens of mixed depths, step round by round meanwhile. Needs
        decode_capture_available."""
        if capture is not None and not self.decode_capture_available:
            raise ValueError("the decode capture needs whole-token steps: the static decode "
                             "path with ExecutionConfig.fused_tokens, not select_only")
        self.capture = capture

    def set_proposer(self, proposer) -> None:
        """Speculative decoding (rltlab.engine.spec.decoder; docs/engine.md section 7), lossless:
        a DraftProposer(num_draft_tokens, draft_rounds, head), a TreeProposer(heads, tree)
        (rltlab.engine.spec.tree_graph), or any object with propose / observe (the Proposer
        protocol, rltlab.engine.spec.protocol: draft trees verified by
        rltlab.engine.spec.tree_verify) turns it on, None turns it off. Anything else: TypeError."""
        spec = None
        if proposer is not None:
            from rltlab.engine.spec.decoder import SpecDecoder
            spec = SpecDecoder(self, proposer)   # validates
        self.proposer, self._spec = proposer, spec
