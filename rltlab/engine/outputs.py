"""RequestOutput / CompletionOutput (vLLM names), built from a request's state."""
from __future__ import annotations

from dataclasses import dataclass, field

from rltlab.engine.sampling import SamplingParams
from rltlab.engine.sequence import Request, Sequence


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None                 # 1:1 with token_ids (None if not asked)
    top_logprobs: list[dict[int, float]] | None  # when SamplingParams.logprobs > 0
    exit_depths: list[int]                       # round that produced each token (selected)
    executed_depths: list[int]                   # rounds actually computed for it
    weight_versions: list[int]                   # weight version each token was generated under
    finish_reason: str | None                    # stop | length | abort | error | None (running)
    error: str | None = None
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it
    text: str | None = None
    spec_stats: dict | None = None               # speculative steps (set_proposer), else None

    @property
    def weight_version(self) -> int | None:
        return self.weight_versions[-1] if self.weight_versions else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    sampling_params: SamplingParams     # the effective params (seed, loops, policy filled in)
    finished: bool
    weight_version: int | None          # version of the last token (engine version if none)
    metrics: RequestMetrics
    prompt: str | None = None
    extra: dict = field(default_factory=dict)
    spec_stats: dict | None = None      # summed over the n samples (rltlab.engine.spec.decoder)

    def _single(self) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise AttributeError(f"request {self.request_id} has n={len(self.outputs)} samples; "
                                 "read them from .outputs")
        return self.outputs[0]

    # n == 1 convenience: the fields of the single completion.
    token_ids = property(lambda self: self._single().token_ids)
    logprobs = property(lambda self: self._single().logprobs)
    top_logprobs = property(lambda self: self._single().top_logprobs)
    exit_depths = property(lambda self: self._single().exit_depths)
    executed_depths = property(lambda self: self._single().executed_depths)
    weight_versions = property(lambda self: self._single().weight_versions)
    finish_reason = property(lambda self: self._single().finish_reason)
    error = property(lambda self: self._single().error)
    stop_reason = property(lambda self: self._single().stop_reason)
    text = property(lambda self: self._single().text)


def raise_on_errors(outputs: list[RequestOutput], what: str) -> list[RequestOutput]:
    """outputs, unless a request ended in an error (an exit policy or proposer that raised,
    non-finite logits): then a RuntimeError naming `what`, how many failed and the first error.
    A serving caller may read finish_reason "error" per request; the workbench's rollouts,
    evaluations and traces stop instead of training or scoring on requests that ended early."""
    failed = [(out.request_id, comp.error) for out in outputs for comp in out.outputs
              if comp.finish_reason == "error"]
    if failed:
        request_id, error = failed[0]
        raise RuntimeError(f"{what}: {len(failed)} of {len(outputs)} requests ended in an error; "
                           f"the first ({request_id}): {error}")
    return outputs


def _completion(seq: Sequence, tokenizer) -> CompletionOutput:
    want = seq.params.logprobs is not None
    ids = seq.output_token_ids
    if seq.finish_reason == "stop" and seq.stop_reason is None and ids:
        ids = ids[:-1]   # ended at EOS: the token stays in token_ids, not in the text (vLLM)
    text = tokenizer.decode(ids) if tokenizer is not None else None
    if text is not None and seq.text_end is not None:
        text = text[:seq.text_end]
    return CompletionOutput(
        index=seq.index, token_ids=list(seq.output_token_ids),
        logprobs=list(seq.logprobs) if want else None,
        top_logprobs=list(seq.top_logprobs) if want and seq.params.logprobs else None,
        exit_depths=list(seq.exit_depths), executed_depths=list(seq.executed_depths),
        weight_versions=list(seq.weight_versions), finish_reason=seq.finish_reason,
        error=seq.error, text=text, stop_reason=seq.stop_reason,
        spec_stats=_spec_stats(seq))


def _spec_stats(seq: Sequence) -> dict | None:
    """steps / drafted / accepted / emitted / tau / acceptance_rate of the speculative steps,
    spec_tokens = tokens they appended (emitted minus what a stop cut off)."""
    stats = getattr(seq, "spec_stats", None)
    return None if stats is None else {**stats.to_dict(), "spec_tokens": seq.spec_tokens}


def _sum_spec_stats(outputs: list[CompletionOutput]) -> dict | None:
    parts = [o.spec_stats for o in outputs if o.spec_stats is not None]
    if not parts:
        return None
    total = {key: sum(s[key] for s in parts)
             for key in ("steps", "drafted", "accepted", "emitted", "spec_tokens")}
    total["tau"] = total["emitted"] / total["steps"] if total["steps"] else 0.0
    total["acceptance_rate"] = total["accepted"] / total["drafted"] if total["drafted"] else 0.0
    return total


def build_output(request: Request, engine_version: int, tokenizer=None) -> RequestOutput:
    outputs = [_completion(seq, tokenizer) for seq in request.seqs]
    versions = [o.weight_version for o in outputs if o.weight_version is not None]
    firsts = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
    metrics = RequestMetrics(request.arrival_time, min(firsts) if firsts else None,
                             request.finished_time)
    return RequestOutput(
        request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
        outputs=outputs, sampling_params=request.params, finished=request.is_finished,
        weight_version=max(versions) if versions else engine_version, metrics=metrics,
        spec_stats=_sum_spec_stats(outputs))
