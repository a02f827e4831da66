"""Prompt and problem sets shared by the stages: the mixed held-out problem set (k-hop binding and
word problems), training-split rollout prompts, held-out text rows. Prompts are [EOT] +
encode(text).

Task sets (TASK_SETS, the notebooks' TASKS parameter): "embedded" (the embedded model's k-hop
binding and word problems above) or "gsm8k" (GSM8K-format problems from a local JSONL of
question / answer records, with lm-eval's gsm8k_cot few-shot prompt and stop strings:
rltlab.eval.gsm8k). Either way the rollout (training) and evaluation (held-out) problems are
disjoint by a stable hash of the question. The embedded model's eval files (eval/*.jsonl,
eval/heldout_text.txt) are read from the checkpoint when it has them, else from the embedded
artifact (a stand-in or a real Ouro checkpoint has none: task_file).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text, no special tokens (a tokenizers.Tokenizer or a transformers one)."""
    from rltlab.eval.tasks import _encode
    return _encode(tokenizer, text)


KINDS = ("hops", "arith")  # the mixed set: k-hop binding (depth-graded) and word problems


def _interleave(groups: list[list[dict]]) -> list[dict]:
    """One item of each group in turn (the mixed set's order; any prefix stays mixed)."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def _split_counts(n: int, kinds: tuple[str, ...]) -> dict[str, int]:
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    return {k: n // len(kinds) + (i < n % len(kinds)) for i, k in enumerate(kinds)}


def task_file(model_dir: str | os.PathLike | None, name: str) -> Path | None:
    """<model_dir>/eval/<name> when the checkpoint has it, else the embedded artifact's
    (rltlab.common.paths.embedded_model_dir(), also for model_dir None), else None (the caller
    generates the problems / text instead)."""
    from rltlab.common.paths import embedded_model_dir

    if model_dir is not None and (Path(model_dir) / "eval" / name).is_file():
        return Path(model_dir) / "eval" / name
    try:
        path = embedded_model_dir() / "eval" / name
    except FileNotFoundError:   # no embedded artifact (a partial checkout): generate
        return None
    return path if path.is_file() else None


def eval_problems(model_dir: str | os.PathLike | None, n: int, seed: int = 1234,
                  kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The mixed held-out problem set: n problems, k-hop and word problems in turn (`kinds`
    picks one or both). Each kind comes from <model_dir>/eval/ (hops_heldout.jsonl,
    arithmetic_heldout.jsonl: the checkpoint's own eval set; task_file: the embedded
    artifact's when the checkpoint has none) when it holds enough, else it is
    generated (make_hop_problems(.., 4321, "heldout"), make_arithmetic_problems(.., seed,
    "heldout")). k-hop problems carry `hops` (their depth label)."""
    from rltlab.pretrain.data import make_arithmetic_problems, make_hop_problems

    files = {"hops": "hops_heldout.jsonl", "arith": "arithmetic_heldout.jsonl"}
    groups = []
    for kind, count in _split_counts(n, kinds).items():
        path = task_file(model_dir, files[kind])
        rows = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                if path is not None and path.is_file() else [])
        if len(rows) < count:
            made = (make_hop_problems(count, 4321, "heldout") if kind == "hops"
                    else make_arithmetic_problems(count, seed, "heldout"))
            rows = [{k: v for k, v in vars(p).items()} for p in made]
        groups.append([{**r, "kind": kind} for r in rows[:count]])
    return _interleave(groups)


def rollout_prompts(tokenizer, n: int, seed: int, kinds: tuple[str, ...] = KINDS
                    ) -> tuple[list[list[int]], list[dict]]:
    """Training-split prompts ([EOT] + question) for rollouts, k-hop and word problems in turn,
    and their problems (never the held-out eval set: the question spaces are split by hash)."""
    from rltlab.pretrain.data import EOT_ID, make_arithmetic_problems, make_hop_problems

    groups = []
    for kind, count in _split_counts(n, kinds).items():
        made = (make_hop_problems(count, seed, "train") if kind == "hops"
                else make_arithmetic_problems(count, seed, "train"))
        groups.append([{"question": p.question, "answer": p.answer, "kind": kind,
                        **({"hops": p.hops} if kind == "hops" else {})} for p in made])
    problems = _interleave(groups)
    return [[EOT_ID] + encode(tokenizer, p["question"]) for p in problems], problems


def heldout_text_rows(tokenizer, model_dir: str | os.PathLike | None, seq_len: int,
                      max_rows: int) -> torch.Tensor:
    """[N, seq_len] rows of [EOT] + held-out text (eval/heldout_text.txt of the checkpoint or,
    without one, of the embedded artifact: task_file; else the held-out stdlib split);
    max_rows >= 1."""
    from rltlab.pretrain.data import EOT_ID, load_text_corpus

    if max_rows < 1:
        raise ValueError(f"heldout_text_rows: max_rows must be >= 1, got {max_rows}")
    path = task_file(model_dir, "heldout_text.txt")
    text = path.read_text(encoding="utf-8") if path is not None and path.is_file() else \
        load_text_corpus(max_bytes=max(20_000, seq_len * max_rows * 8), split="heldout")
    ids = encode(tokenizer, text)
    body = seq_len - 1
    rows = [[EOT_ID] + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)][:max_rows]
    if not rows:
        raise ValueError(f"held-out text too short for one row of {seq_len} tokens")
    return torch.tensor(rows, dtype=torch.long)


# ----------------------------------------------------------------------------- task sets

TASK_SETS = ("embedded", "gsm8k")


def check_task_set(tasks: str, gsm8k_path: str | os.PathLike | None = None) -> None:
    """A ValueError in one line for an unknown task set, or "gsm8k" without a readable JSONL."""
    if tasks not in TASK_SETS:
        raise ValueError(f"TASKS must be one of {', '.join(TASK_SETS)}, got {tasks!r}")
    if tasks == "gsm8k":
        if not gsm8k_path:
            raise ValueError("TASKS 'gsm8k' needs GSM8K_PATH: a local JSONL of question / "
                             "answer records (the HF openai/gsm8k layout)")
        if not Path(gsm8k_path).is_file():
            raise ValueError(f"GSM8K_PATH {gsm8k_path}: no such file")


def task_stop(tasks: str) -> list[str]:
    """The stop strings of a task set's generations (gsm8k: lm-eval's gsm8k_cot "until")."""
    from rltlab.eval.gsm8k import GSM8K_STOP
    return list(GSM8K_STOP) if tasks == "gsm8k" else []


def task_rollout_prompts(tokenizer, tasks: str, n: int, seed: int, *,
                         gsm8k_path: str | os.PathLike | None = None, num_fewshot: int = 3
                         ) -> tuple[list[list[int]], list[dict]]:
    """Training-split rollout prompts and their problems of a task set: "embedded" is
    rollout_prompts (k-hop and word problems, [EOT] + question); "gsm8k" the first n problems
    of GSM8K_PATH's training split (rltlab.eval.gsm8k.gsm8k_problems) with the gsm8k_cot
    few-shot prompt (no BOS, as evaluate_gsm8k). `seed` draws the embedded problems only (the
    GSM8K ones are the file's, in order)."""
    check_task_set(tasks, gsm8k_path)
    if tasks == "embedded":
        return rollout_prompts(tokenizer, n, seed)
    from rltlab.eval.gsm8k import gsm8k_problems, gsm8k_prompt_ids

    problems = gsm8k_problems(gsm8k_path, "train", n)
    return [gsm8k_prompt_ids(tokenizer, p["question"], num_fewshot) for p in problems], problems


def task_eval_problems(model_dir: str | os.PathLike | None, tasks: str, n: int, *,
                       gsm8k_path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Held-out problems of a task set: "embedded" is eval_problems (the mixed set); "gsm8k"
    the first n of GSM8K_PATH's held-out split (never a rollout problem: split by hash)."""
    check_task_set(tasks, gsm8k_path)
    if tasks == "embedded":
        return eval_problems(model_dir, n)
    from rltlab.eval.gsm8k import gsm8k_problems
    return gsm8k_problems(gsm8k_path, "heldout", n)


def max_prompt_len(tokenizer, problems: list[dict], tasks: str = "embedded",
                   num_fewshot: int = 3) -> int:
    """The longest prompt (tokens) of these problems as the task set encodes them (sizes an
    engine's KV pool: rltlab.eval.engines)."""
    if not problems:
        return 1
    if tasks == "gsm8k":
        from rltlab.eval.gsm8k import gsm8k_prompt_ids
        return max(len(gsm8k_prompt_ids(tokenizer, p["question"], num_fewshot))
                   for p in problems)
    return 1 + max(len(encode(tokenizer, p["question"])) for p in problems)
