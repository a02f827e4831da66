"""Evaluation tasks: the embedded arithmetic task and held-out text perplexity.

Generation goes through a generic ``generate_fn(prompts: list[list[int]]) -> list[output]``;
an output is anything with ``token_ids`` and optionally ``exit_depths``/``executed_depths``
(the engine's RequestOutput) or a GenOutput. Factories:

    plain_generate_fn(model, max_new_tokens, ...)   rltlab.model.generate.generate_plain
    engine_generate_fn(llm, sampling_params)         rltlab.engine.LLM.generate

GSM8K (lm-eval's gsm8k_cot protocol) lives in rltlab.eval.gsm8k and uses these helpers.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from rltlab.eval.metrics import depth_stats, mean_with_se
from rltlab.model.gates import at_least_fp32

GenerateFn = Callable[[list[list[int]]], list[Any]]


# ----------------------------------------------------------------------------- generation

@dataclass
class GenOutput:
    token_ids: list[int]
    exit_depths: list[int] = field(default_factory=list)      # selected round per output token
    executed_depths: list[int] = field(default_factory=list)  # rounds computed per output token
    logprobs: list[float] | None = None
    weight_version: int | None = None


def as_gen_output(obj: Any) -> GenOutput:
    """Normalize an engine RequestOutput / CompletionOutput / GenOutput / dict / token list."""
    if isinstance(obj, GenOutput):
        return obj
    if isinstance(obj, (list, tuple)):
        return GenOutput(list(obj))
    get = (lambda k: obj.get(k)) if isinstance(obj, dict) else (lambda k: getattr(obj, k, None))
    ids = get("token_ids")
    if ids is None:
        raise TypeError(f"generation output {type(obj).__name__} has no token_ids")
    exits = get("exit_depths")
    if exits is None:
        exits = get("exit_rounds")
    executed = get("executed_depths")
    exits = list(exits) if exits is not None else []
    return GenOutput(list(ids), exits, list(executed) if executed is not None else list(exits),
                     get("logprobs"), get("weight_version"))


def plain_generate_fn(model, max_new_tokens: int, *, batch_size: int = 32,
                      eos_token_id: int | None = 0, **policy) -> GenerateFn:
    """generate_fn over rltlab.model.generate.generate_plain; `policy`: depth / threshold /
    min_loops / max_loops / temperature / seed, as generate_plain takes them.
    Executed = selected."""
    from rltlab.model.generate import generate_plain

    def generate(prompts: list[list[int]]) -> list[GenOutput]:
        outs = []
        for start in range(0, len(prompts), batch_size):
            gen = generate_plain(model, prompts[start:start + batch_size], max_new_tokens,
                                 eos_token_id=eos_token_id, **policy)
            for ids, rounds, logps in zip(gen.token_ids, gen.exit_rounds, gen.logprobs):
                outs.append(GenOutput(ids, rounds, list(rounds), logps))
        return outs
    return generate


def engine_generate_fn(llm, sampling_params, *, stop: Sequence[str] | None = None,
                       tokenizer=None, tail_tokens: int = 16) -> GenerateFn:
    """generate_fn over the rollout engine: llm.generate(prompt token ids, sampling_params).
    With n > 1 the first sample of every request is returned.

    stop: stop STRINGS (the engine only knows stop token ids). Requests are then streamed and
    aborted as soon as the decoded tail (last `tail_tokens` tokens) of sample 0 contains one;
    the caller still cuts the text at the stop string (truncate_at_stop). For greedy decoding
    this gives the same text as generating to the end, without generating to the end.
    """
    if stop:
        if tokenizer is None:
            raise ValueError("engine_generate_fn(stop=...) needs the tokenizer")
        return _engine_stop_fn(llm, sampling_params, list(stop), tokenizer, tail_tokens)

    from rltlab.engine.outputs import raise_on_errors

    def generate(prompts: list[list[int]]) -> list[GenOutput]:
        outs = llm.generate([list(p) for p in prompts], sampling_params)
        return _gen_outputs(raise_on_errors(outs, "evaluation"))
    return generate


def _gen_outputs(outs) -> list[GenOutput]:
    result = []
    for out in outs:
        comp = out.outputs[0] if getattr(out, "outputs", None) else out
        g = as_gen_output(comp)
        g.weight_version = getattr(comp, "weight_version", None)
        result.append(g)
    return result


_STOP_IDS = iter(range(1 << 62))


def _engine_stop_fn(llm, sampling_params, stop: list[str], tokenizer, tail_tokens: int
                    ) -> GenerateFn:
    engine = getattr(llm, "llm_engine", llm)

    def generate(prompts: list[list[int]]) -> list[GenOutput]:
        if engine.has_unfinished_requests():
            raise RuntimeError("engine_generate_fn(stop=...) needs an idle engine")
        ids = [engine.add_request(f"stop-gen-{next(_STOP_IDS)}", list(p), sampling_params,
                                  stream=True) for p in prompts]
        results: dict[str, Any] = {}
        aborted: set[str] = set()
        while len(results) < len(ids):
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                elif out.request_id not in aborted:
                    tail = _decode(tokenizer, out.outputs[0].token_ids[-tail_tokens:])
                    if any(s in tail for s in stop):
                        engine.abort_request(out.request_id)
                        aborted.add(out.request_id)
        return _gen_outputs([results[rid] for rid in ids])
    return generate


def _encode(tokenizer, text: str) -> list[int]:
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
    out = tok.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _strip_eos(ids: list[int], eos_token_id: int | None) -> list[int]:
    if eos_token_id is not None and eos_token_id in ids:
        return ids[:ids.index(eos_token_id)]
    return ids


def _run(generate_fn: GenerateFn, prompts: list[list[int]], batch_size: int | None,
         progress: bool = False) -> list[GenOutput]:
    outs: list[GenOutput] = []
    step = batch_size or len(prompts) or 1
    starts = range(0, len(prompts), step)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc="generate", unit="batch")
    for start in starts:
        batch = prompts[start:start + step]
        got = [as_gen_output(o) for o in generate_fn(batch)]
        if len(got) != len(batch):
            raise RuntimeError(f"generate_fn returned {len(got)} outputs for {len(batch)} prompts")
        outs.extend(got)
    return outs


def _summary(scores: list[float], outs: list[GenOutput], num_rounds: int) -> dict[str, Any]:
    acc, se = mean_with_se(scores)
    stats = depth_stats([o.exit_depths for o in outs],
                        [o.executed_depths or o.exit_depths for o in outs], num_rounds) \
        if all(o.exit_depths for o in outs) else {}
    return {"n": len(scores), "exact_match": acc, "exact_match_se": se,
            "output_tokens": sum(len(o.token_ids) for o in outs),
            "tokens_sha256": tokens_sha256([o.token_ids for o in outs]), **stats}


def tokens_sha256(token_ids: Sequence[Sequence[int]]) -> str:
    """One digest of every generated token, in order: two runs (the CPU and a GPU, say) that
    generated the same tokens have the same digest (rltlab.bench.device_parity)."""
    digest = hashlib.sha256()
    for ids in token_ids:
        digest.update(json.dumps(list(map(int, ids))).encode() + b"\n")
    return digest.hexdigest()


# ----------------------------------------------------------------------------- arithmetic

def arithmetic_prompt(tokenizer, question: str, bos_id: int | None = 0) -> list[int]:
    """[EOT] + encode(question): the embedded model's prompt convention (rltlab.pretrain.data)."""
    return ([bos_id] if bos_id is not None else []) + _encode(tokenizer, question)


def evaluate_arithmetic(generate_fn: GenerateFn, tokenizer, problems: Sequence[Any], *,
                        num_rounds: int = 4, batch_size: int | None = None, bos_id: int | None = 0,
                        eos_token_id: int | None = 0, keep_text: bool = False) -> dict[str, Any]:
    """Exact match on the embedded model's problems (word problems and k-hop problems, as
    dataclasses or dicts with question/answer[/hops]): rltlab.pretrain.tasks.answer_of(problem,
    decoded output) == answer; unparseable counts as wrong.

    Returns exact_match (+ se), per-example `scores` (0/1, in problem order, for paired
    differences), depth statistics (first output token excluded) and optionally the texts.
    """
    from rltlab.pretrain.tasks import answer_of

    questions = [p["question"] if isinstance(p, dict) else p.question for p in problems]
    answers = [p["answer"] if isinstance(p, dict) else p.answer for p in problems]
    prompts = [arithmetic_prompt(tokenizer, q, bos_id) for q in questions]
    outs = _run(generate_fn, prompts, batch_size)
    texts = [_decode(tokenizer, _strip_eos(o.token_ids, eos_token_id)) for o in outs]
    preds = [answer_of(p, t) for p, t in zip(problems, texts)]
    scores = [float(p is not None and p == int(a)) for p, a in zip(preds, answers)]
    result = {**_summary(scores, outs, num_rounds), "scores": scores, "predictions": preds}
    if keep_text:
        result["texts"] = texts
    return result


# ----------------------------------------------------------------------------- perplexity

@torch.no_grad()
def text_perplexity(model, rows: torch.Tensor | Sequence[Sequence[int]], *,
                    per_round: bool = False, depth: int | None = None,
                    exit_fn=None, exit_rounds: torch.Tensor | None = None,
                    batch_size: int = 16) -> dict[str, Any]:
    """Teacher-forced next-token loss (nats/token) and perplexity on held-out token rows.

    per_round=True: fixed depth r for every r (round-r logits of a full-depth forward: every
    position at round r attends over round-r K/V, which IS the fixed-depth-r model) ->
    {"rounds": [{round, loss, ppl}, ...]}. Otherwise one figure for a policy: fixed `depth`,
    an `exit_fn` (as OuroForCausalLM.forward takes it; e.g. rltlab.model.generate.make_exit_fn for
    the Q-exit) or explicit `exit_rounds` [N, T]; LAST_EXITED applies, and mean_rounds is the
    mean exit round over scored positions. Rows: equal-length tensor [N, T] or lists (padded).
    """
    device = next(model.parameters()).device
    num_rounds = model.config.num_rounds
    if not isinstance(rows, torch.Tensor):
        width = max(len(r) for r in rows)
        if any(len(r) != width for r in rows):
            raise ValueError("text_perplexity needs equally long rows (use a [N, T] tensor)")
        rows = torch.tensor([list(r) for r in rows], dtype=torch.long)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [N, T>=2], got {tuple(rows.shape)}")
    nll = torch.zeros(num_rounds if per_round else 1, dtype=torch.float64)
    depth_sum, count = 0.0, 0
    for start in range(0, rows.shape[0], batch_size):
        ids = rows[start:start + batch_size].to(device)
        target = ids[:, 1:]
        if per_round:
            out = model(ids, all_logits=True)
            for r, logits in enumerate(out.logits):
                nll[r] += F.cross_entropy(at_least_fp32(logits[:, :-1]).transpose(1, 2), target,
                                          reduction="sum").double().cpu()
        else:
            kwargs = {}
            if depth is not None:
                kwargs["exit_rounds"] = torch.full_like(ids, int(depth))
            elif exit_rounds is not None:
                kwargs["exit_rounds"] = exit_rounds[start:start + batch_size].to(device)
            elif exit_fn is not None:
                kwargs["exit_fn"] = exit_fn
            out = model(ids, **kwargs)
            final = at_least_fp32(out.final_logits[:, :-1])
            nll[0] += F.cross_entropy(final.transpose(1, 2), target,
                                      reduction="sum").double().cpu()
            depth_sum += float(out.exit_rounds[:, :-1].double().sum())
        count += target.numel()
    if per_round:
        return {"tokens": count, "rounds": [
            {"round": r + 1, "loss": float(nll[r] / count), "ppl": math.exp(nll[r] / count)}
            for r in range(num_rounds)]}
    loss = float(nll[0] / count)
    return {"tokens": count, "loss": loss, "ppl": math.exp(loss),
            "mean_rounds": depth_sum / count}
