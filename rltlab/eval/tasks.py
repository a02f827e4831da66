"""Evaluation tasks: the embedded arithmetic task, held-out text perplexity, GSM8K (gsm8k_cot).

Generation goes through a generic ``generate_fn(prompts: list[list[int]]) -> list[output]``;
an output is anything with ``token_ids`` and optionally ``exit_depths``/``executed_depths``
(the engine's RequestOutput) or a GenOutput. Factories:

    plain_generate_fn(model, max_new_tokens, ...)   rltlab.generate.generate_plain
    engine_generate_fn(llm, sampling_params)         rltlab.engine.LLM.generate

GSM8K follows lm-eval's ``gsm8k_cot`` task (lm_eval/tasks/gsm8k/gsm8k-cot.yaml, version 3.0):
prompt = few-shot exemplars "Q: <question>\\nA: <target>" joined by "\\n\\n", then
"Q: <question>\\nA:"; greedy; the continuation is cut at the first stop string; the
"strict-match" filter takes the FIRST match of ``The answer is (\\-?[0-9\\.\\,]+).``
("[invalid]" if none); exact_match after removing ",", "$", "(?s).*#### ", a trailing "." from
both prediction and reference, case-insensitive. Unparseable counts as wrong.
Defaults that differ from lm-eval's own defaults, on purpose (REFERENCE section 4):
num_fewshot 3 (lm-eval's default is 8; the first 3 of the same fixed list, its "first_n"
sampler), max 1024 new tokens, batch 1, no chat template. lm-eval 3.0 stops at "Q:", "</s>",
"<|im_end|>"; older gsm8k_cot versions (and vllm-rlt's issue text) also stop at "\\n\\n":
``GSM8K_STOP`` holds the 3.0 list and ``GSM8K_STOP_LEGACY`` adds "\\n\\n".
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from rltlab.eval.metrics import depth_stats, mean_with_se
from rltlab.gates import at_least_fp32

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
    """generate_fn over rltlab.generate.generate_plain; `policy`: depth / threshold / min_loops /
    max_loops / temperature / seed, as generate_plain takes them. Executed = selected."""
    from rltlab.generate import generate_plain

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

    def generate(prompts: list[list[int]]) -> list[GenOutput]:
        outs = llm.generate([list(p) for p in prompts], sampling_params)
        return _gen_outputs(outs)
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
            "output_tokens": sum(len(o.token_ids) for o in outs), **stats}


# ----------------------------------------------------------------------------- arithmetic

def arithmetic_prompt(tokenizer, question: str, bos_id: int | None = 0) -> list[int]:
    """[EOT] + encode(question): the embedded model's prompt convention (rltlab.data)."""
    return ([bos_id] if bos_id is not None else []) + _encode(tokenizer, question)


def evaluate_arithmetic(generate_fn: GenerateFn, tokenizer, problems: Sequence[Any], *,
                        num_rounds: int = 4, batch_size: int | None = None, bos_id: int | None = 0,
                        eos_token_id: int | None = 0, keep_text: bool = False) -> dict[str, Any]:
    """Exact match on arithmetic word problems (ArithmeticProblem or dicts with question/answer):
    rltlab.data.extract_answer(decoded output) == answer; unparseable counts as wrong.

    Returns exact_match (+ se), per-example `scores` (0/1, in problem order, for paired
    differences), depth statistics (first output token excluded) and optionally the texts.
    """
    from rltlab.data import extract_answer

    questions = [p["question"] if isinstance(p, dict) else p.question for p in problems]
    answers = [p["answer"] if isinstance(p, dict) else p.answer for p in problems]
    prompts = [arithmetic_prompt(tokenizer, q, bos_id) for q in questions]
    outs = _run(generate_fn, prompts, batch_size)
    texts = [_decode(tokenizer, _strip_eos(o.token_ids, eos_token_id)) for o in outs]
    preds = [extract_answer(t) for t in texts]
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
    an `exit_fn` (as OuroForCausalLM.forward takes it; e.g. rltlab.generate.make_exit_fn for
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


# ----------------------------------------------------------------------------- GSM8K

# The fixed few-shot list of lm-eval's gsm8k_cot (chain-of-thought exemplars of Wei et al.
# 2022), in order; the "first_n" sampler takes the first num_fewshot.
GSM8K_COT_EXEMPLARS: list[tuple[str, str]] = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. "
     "After they are done, there will be 21 trees. How many trees did the grove workers plant "
     "today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. "
     "So there must have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the "
     "parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they "
     "have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = "
     "74. After eating 35, they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How "
     "many lollipops did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave "
     "Denny 20 - 12 = 8. The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many "
     "toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 "
     "more toys. 5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each "
     "day, from monday to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So "
     "5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 "
     "more. How many golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. "
     "After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she "
     "has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8."),
]
GSM8K_NUM_FEWSHOT = 3
GSM8K_MAX_NEW_TOKENS = 1024
GSM8K_STOP = ("Q:", "</s>", "<|im_end|>")
GSM8K_STOP_LEGACY = ("Q:", "</s>", "<|im_end|>", "\n\n")
GSM8K_STRICT_RE = re.compile(r"The answer is (\-?[0-9\.\,]+).")
_GSM8K_IGNORE = [re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$")]
INVALID = "[invalid]"


def gsm8k_cot_prompt(question: str, num_fewshot: int = GSM8K_NUM_FEWSHOT) -> str:
    """lm-eval gsm8k_cot context: exemplars "Q: ..\\nA: .." + "\\n\\n" + "Q: <q>\\nA:"."""
    if not 0 <= num_fewshot <= len(GSM8K_COT_EXEMPLARS):
        raise ValueError(f"num_fewshot must lie in [0, {len(GSM8K_COT_EXEMPLARS)}]")
    shots = [f"Q: {q}\nA: {a}" for q, a in GSM8K_COT_EXEMPLARS[:num_fewshot]]
    return "\n\n".join(shots + [f"Q: {question}\nA:"])


def truncate_at_stop(text: str, stop: Sequence[str] = GSM8K_STOP) -> str:
    """lm-eval generate_until: cut the continuation at the first occurrence of any stop string."""
    for s in stop:
        if s:
            text = text.split(s)[0]
    return text


def gsm8k_strict_match(text: str) -> str:
    """The strict-match filter: first regex match's group, stripped; "[invalid]" if none."""
    match = GSM8K_STRICT_RE.findall(text)
    if not match:
        return INVALID
    first = match[0]
    if isinstance(first, tuple):
        first = next((m for m in first if m), "")
    return first.strip()


def _normalize(text: str) -> str:
    for pattern in _GSM8K_IGNORE:
        text = pattern.sub("", text)
    return text.lower()


def gsm8k_reference(answer: str) -> str:
    """doc_to_target: the text after the last '####', stripped."""
    return answer.split("####")[-1].strip()


def gsm8k_is_correct(prediction: str, answer: str) -> bool:
    """exact_match (ignore_case, regexes_to_ignore) of the filtered prediction vs the target."""
    if prediction == INVALID:
        return False
    return _normalize(prediction) == _normalize(gsm8k_reference(answer))


def load_gsm8k_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, str]]:
    """Records {question, answer} from a local JSONL (the HF openai/gsm8k test split layout)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "question" not in rec or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: a GSM8K record needs 'question' and 'answer'")
            records.append({"question": rec["question"], "answer": rec["answer"]})
            if limit is not None and len(records) >= limit:
                break
    return records


def evaluate_gsm8k(generate_fn: GenerateFn, tokenizer, records: Sequence[dict[str, str]] | str
                   | os.PathLike, *, num_fewshot: int = GSM8K_NUM_FEWSHOT,
                   stop: Sequence[str] = GSM8K_STOP, limit: int | None = None,
                   batch_size: int = 1, bos_ids: Sequence[int] = (),
                   eos_token_id: int | None = None, num_rounds: int = 4,
                   progress: bool = False, keep_text: bool = True) -> dict[str, Any]:
    """gsm8k_cot, strict-match exact_match. generate_fn must be greedy with up to
    GSM8K_MAX_NEW_TOKENS new tokens and stop at EOS (the stop strings are applied here, after
    decoding: for greedy decoding the result is the same as stopping early). Batch 1 by
    default, as the protocol. Returns exact_match (+ se), per-example `scores`, predictions,
    depth statistics and (keep_text) the truncated continuations."""
    if not isinstance(records, (list, tuple)):
        records = load_gsm8k_jsonl(records, limit)
    records = list(records)[:limit] if limit is not None else list(records)
    prompts = [list(bos_ids) + _encode(tokenizer, gsm8k_cot_prompt(r["question"], num_fewshot))
               for r in records]
    outs = _run(generate_fn, prompts, batch_size, progress)
    texts = [truncate_at_stop(_decode(tokenizer, _strip_eos(o.token_ids, eos_token_id)), stop)
             for o in outs]
    preds = [gsm8k_strict_match(t) for t in texts]
    scores = [float(gsm8k_is_correct(p, r["answer"])) for p, r in zip(preds, records)]
    result = {**_summary(scores, outs, num_rounds), "scores": scores, "predictions": preds,
              "protocol": {"task": "gsm8k_cot (lm-eval 3.0 prompt/filter)",
                           "filter": "strict-match",
                           "num_fewshot": num_fewshot, "stop": list(stop),
                           "batch_size": batch_size}}
    if keep_text:
        result["texts"] = texts
    return result
