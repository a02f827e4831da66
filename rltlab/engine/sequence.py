"""Request and sequence state.

A request holds n sequences (samples). A sequence moves through its tokens one *span* at a
time; a span is a run of positions that go through the rounds together, one round per engine
step:

* a fixed span: prompt positions (always R rounds), or, after a weight update, already generated
  positions recomputed at their recorded exit rounds. A position whose exit round is reached
  leaves the span (its K/V is copied into the deeper planes). If the span ends at the last known
  token, that token's final state samples the next token.
* a decode span: the single last token; the exit policy decides when it leaves, then it samples.

Position numbering: prompt tokens are 0..P-1; output token i is the input at position P+i.
exit_depths[i] is the round at which the position that *produced* output token i exited
(position P+i-1; for i = 0 that is the last prompt token, which always runs R rounds).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from rltlab.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class PendingDecision:
    """A lagged policy's answer for one token: targets[index], readable once `ready` is done."""
    due_round: int                      # read it at the end of this round
    asked_round: int
    policy: str
    targets: torch.Tensor               # host tensor (filled by an async device->host copy)
    index: int
    ready: object | None                # torch.cuda.Event, or None when already on the host

    def read(self) -> int:
        if self.ready is not None:
            self.ready.synchronize()    # normally long done: recorded L rounds ago
        return int(self.targets[self.index])


@dataclass
class Span:
    start: int                          # first position
    length: int
    exit_rounds: torch.Tensor | None    # int64 [length]; None = a decode span (policy decides)
    emits: bool                         # the last position samples the next token
    round: int = 0                      # rounds completed
    active: torch.Tensor | None = None  # int64 offsets (into the span) still running
    hidden: torch.Tensor | None = None  # [len(active), H]: h of the last completed round
    planned_exit: int | None = None     # decode span: round the policy committed to
    # decode span: answers of lagged policies not read yet (see exit_policies.decision_lag)
    pending: list["PendingDecision"] = field(default_factory=list)
    # select_only, a span that samples: (h_r, g_r) of its last position per completed round
    select_states: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.active is None:
            self.active = torch.arange(self.length)

    @property
    def num_active(self) -> int:
        return int(self.active.numel())


class Sequence:
    def __init__(self, seq_id: int, request: "Request", index: int, generator: torch.Generator):
        self.seq_id, self.request, self.index, self.generator = seq_id, request, index, generator
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.params: SamplingParams = request.params
        self.output_token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[dict[int, float] | None] = []
        self.exit_depths: list[int] = []
        self.executed_depths: list[int] = []
        self.weight_versions: list[int] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None   # the stop token id or stop string, as vLLM
        self.text_end: int | None = None   # where a stop string cuts the output text (chars)
        self.error: str | None = None
        self.block_table: list[int] = []
        self.block_table_t: torch.Tensor | None = None   # the same, as int64 (set on allocation)
        self.max_output_tokens = request.params.max_tokens   # capped by max_model_len
        self.reserved_positions = 0     # KV positions reserved at admission
        self.num_computed = 0           # positions whose K/V is final in every plane
        self.span: Span | None = None
        self.gate_row: int | None = None    # row of the engine's device gate history
        self.share = None   # groups.ShareGroup: samples sharing this prompt's blocks
        self.first_token_time: float | None = None
        # (i, h): output token i was sampled from lm_head(h) (h on the model's device); read
        # by round-0 exit policies for the input token i (engine_patches.lookahead_exit)
        self.emit_hidden: tuple[int, torch.Tensor] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def at_token_boundary(self) -> bool:
        """Decoding, its pending token sampled, every earlier position final, nothing in flight."""
        return self.span is None and bool(self.output_token_ids) \
            and self.num_computed == self.num_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = self.num_prompt_tokens
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt: end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    def fixed_exit_rounds(self, start: int, end: int, num_rounds: int) -> list[int]:
        """Rounds the already known positions start..end-1 run when they are computed or
        recomputed: R for the prompt, the recorded executed depth for outputs (the exit round
        under LAST_EXITED, R under select_only). Position p >= prompt length is output p -
        prompt + 1's input, so its depth is executed_depths[p - prompt + 1]."""
        prompt = self.num_prompt_tokens
        in_prompt = max(0, min(end, prompt) - start)
        first, stop = max(start, prompt) - prompt + 1, max(end, prompt) - prompt + 1
        return [num_rounds] * in_prompt + self.executed_depths[first: stop]

    def reset_computation(self) -> None:
        """Forget all K/V (e.g. computed under older weights): recompute from position 0."""
        self.num_computed, self.span = 0, None

    def append_token(self, token: int, logprob, top_logprobs, exit_depth: int,
                     executed_depth: int, weight_version: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top_logprobs)
        self.exit_depths.append(exit_depth)
        self.executed_depths.append(executed_depth)
        self.weight_versions.append(weight_version)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 stream: bool = False):
        self.request_id, self.prompt_token_ids, self.params = request_id, prompt_token_ids, params
        self.stream = stream
        self.seqs: list[Sequence] = []
        self.arrival_time = time.perf_counter()
        self.finished_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
