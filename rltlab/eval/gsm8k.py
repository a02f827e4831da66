"""GSM8K in lm-eval's gsm8k_cot protocol (docs/ouro.md), for users with real Ouro
weights, read from a local JSONL (question / answer records).

GSM8K follows lm-eval's ``gsm8k_cot`` task (lm_eval/tasks/gsm8k/gsm8k-cot.yaml, version 3.0):
prompt = few-shot exemplars "Q: <question>\\nA: <target>" joined by "\\n\\n", then
"Q: <question>\\nA:"; greedy; the continuation is cut at the first stop string; the
"strict-match" filter takes the FIRST match of ``The answer is (\\-?[0-9\\.\\,]+).``
("[invalid]" if none); exact_match after removing ",", "$", "(?s).*#### ", a trailing "." from
both prediction and reference, case-insensitive. Unparseable counts as wrong.
Defaults that differ from lm-eval's own defaults, on purpose (docs/ouro.md):
num_fewshot 3 (lm-eval's default is 8; the first 3 of the same fixed list, its "first_n"
sampler), max 1024 new tokens, batch 1, no chat template. lm-eval 3.0 stops at "Q:", "</s>",
"<|im_end|>"; older gsm8k_cot versions (and vllm-rlt's issue text) also stop at "\\n\\n":
``GSM8K_STOP`` holds the 3.0 list and ``GSM8K_STOP_LEGACY`` adds "\\n\\n".

As a task set of the workbench (TASKS "gsm8k": rltlab.eval.problems), one local JSONL gives both
the rollout (training) problems and the evaluation (held-out) ones, split by a stable hash of
the question (``gsm8k_problems``: crc32 % 100 < GSM8K_HELDOUT_PERCENT is held out), as the
embedded problems are split (rltlab.pretrain.tasks).
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any, Sequence

from rltlab.eval.tasks import GenerateFn, _decode, _encode, _run, _strip_eos, _summary

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
GSM8K_HELDOUT_PERCENT = 50   # share of the questions held out for evaluation (by hash)
SPLITS = ("train", "heldout")


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
    """Records {question, answer} from a local JSONL (the HF openai/gsm8k test split layout).
    A bad line raises ValueError naming the file, the line number and the field; a file without
    records is refused (its exact match would be NaN)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    records = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON (truncated line?): {err}") \
                    from err
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: a GSM8K record must be a JSON object, got "
                                 f"{type(rec).__name__}")
            for key in ("question", "answer"):
                if not isinstance(rec.get(key), str) or not rec[key].strip():
                    raise ValueError(f"{path}:{lineno}: field {key!r} must be a non-empty "
                                     f"string, got {rec.get(key)!r:.80}")
            records.append({"question": rec["question"], "answer": rec["answer"]})
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{path} holds no GSM8K records (an empty file scores NaN, not 0)")
    return records


def gsm8k_split_of(question: str) -> str:
    """"heldout" or "train": a stable hash of the question text (zlib.crc32, as the embedded
    problems are split; Python's hash() is salted per process)."""
    return "heldout" if zlib.crc32(question.encode("utf-8")) % 100 < GSM8K_HELDOUT_PERCENT \
        else "train"


def gsm8k_problems(path: str | os.PathLike, split: str, n: int | None = None
                   ) -> list[dict[str, Any]]:
    """The first n records of one split of a local GSM8K JSONL (load_gsm8k_jsonl), in file
    order, as problems {question, answer, kind: "gsm8k"}: split "train" (rollouts) or "heldout"
    (evaluation), disjoint by gsm8k_split_of. Asking for more than the split holds is a
    ValueError naming the file and the counts (never silently fewer)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    records = [r for r in load_gsm8k_jsonl(path) if gsm8k_split_of(r["question"]) == split]
    if n is not None and len(records) < n:
        raise ValueError(f"{path} holds {len(records)} GSM8K problems of the {split!r} split "
                         f"(questions split {GSM8K_HELDOUT_PERCENT}% held out by hash), "
                         f"{n} asked for: ask for fewer or use a larger file")
    return [{**r, "kind": "gsm8k"} for r in records[:n]]


def gsm8k_prompt_ids(tokenizer, question: str, num_fewshot: int = GSM8K_NUM_FEWSHOT,
                     bos_ids: Sequence[int] = ()) -> list[int]:
    """The token ids of the gsm8k_cot prompt of `question` (what evaluate_gsm8k generates from)."""
    return list(bos_ids) + _encode(tokenizer, gsm8k_cot_prompt(question, num_fewshot))


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
    if not records:
        raise ValueError("evaluate_gsm8k got no records (exact match of nothing is NaN)")
    prompts = [gsm8k_prompt_ids(tokenizer, r["question"], num_fewshot, bos_ids)
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
