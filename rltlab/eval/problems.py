"""Prompt and problem sets shared by the stages: held-out arithmetic problems, training-split
rollout prompts, held-out text rows. Prompts are [EOT] + encode(text)."""
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


def eval_problems(model_dir: str | os.PathLike | None, n: int, seed: int = 1234
                  ) -> list[dict[str, Any]]:
    """Held-out arithmetic problems: <model_dir>/eval/arithmetic_heldout.jsonl when it exists
    (the checkpoint's own eval set), else make_arithmetic_problems(n, seed, "heldout")."""
    from rltlab.pretrain.data import make_arithmetic_problems

    path = Path(model_dir) / "eval" / "arithmetic_heldout.jsonl" if model_dir else None
    if path is not None and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) >= n:
            return rows[:n]
    return [{"question": p.question, "answer_text": p.answer_text, "answer": p.answer}
            for p in make_arithmetic_problems(n, seed, "heldout")]


def rollout_prompts(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """Training-split arithmetic prompts ([EOT] + question) for rollouts, and their problems."""
    from rltlab.pretrain.data import EOT_ID, make_arithmetic_problems

    problems = [{"question": p.question, "answer": p.answer}
                for p in make_arithmetic_problems(n, seed, "train")]
    return [[EOT_ID] + encode(tokenizer, p["question"]) for p in problems], problems


def heldout_text_rows(tokenizer, model_dir: str | os.PathLike | None, seq_len: int,
                      max_rows: int) -> torch.Tensor:
    """[N, seq_len] rows of [EOT] + held-out text (the checkpoint's eval/heldout_text.txt if
    present, else the held-out stdlib split)."""
    from rltlab.pretrain.data import EOT_ID, load_text_corpus

    path = Path(model_dir) / "eval" / "heldout_text.txt" if model_dir else None
    text = path.read_text(encoding="utf-8") if path is not None and path.is_file() else \
        load_text_corpus(max_bytes=max(20_000, seq_len * max_rows * 8), split="heldout")
    ids = encode(tokenizer, text)
    body = seq_len - 1
    rows = [[EOT_ID] + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)][:max_rows]
    if not rows:
        raise ValueError(f"held-out text too short for one row of {seq_len} tokens")
    return torch.tensor(rows, dtype=torch.long)
