"""Prompt and problem sets shared by the stages: the mixed held-out problem set (k-hop binding and
word problems), training-split rollout prompts, held-out text rows. Prompts are [EOT] +
encode(text)."""
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


def eval_problems(model_dir: str | os.PathLike | None, n: int, seed: int = 1234,
                  kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """The mixed held-out problem set: n problems, k-hop and word problems in turn (`kinds`
    picks one or both). Each kind comes from <model_dir>/eval/ (hops_heldout.jsonl,
    arithmetic_heldout.jsonl: the checkpoint's own eval set) when it holds enough, else it is
    generated (make_hop_problems(.., 4321, "heldout"), make_arithmetic_problems(.., seed,
    "heldout")). k-hop problems carry `hops` (their depth label)."""
    from rltlab.pretrain.data import make_arithmetic_problems, make_hop_problems

    files = {"hops": "hops_heldout.jsonl", "arith": "arithmetic_heldout.jsonl"}
    groups = []
    for kind, count in _split_counts(n, kinds).items():
        path = Path(model_dir) / "eval" / files[kind] if model_dir else None
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
    """[N, seq_len] rows of [EOT] + held-out text (the checkpoint's eval/heldout_text.txt if
    present, else the held-out stdlib split); max_rows >= 1."""
    from rltlab.pretrain.data import EOT_ID, load_text_corpus

    if max_rows < 1:
        raise ValueError(f"heldout_text_rows: max_rows must be >= 1, got {max_rows}")
    path = Path(model_dir) / "eval" / "heldout_text.txt" if model_dir else None
    text = path.read_text(encoding="utf-8") if path is not None and path.is_file() else \
        load_text_corpus(max_bytes=max(20_000, seq_len * max_rows * 8), split="heldout")
    ids = encode(tokenizer, text)
    body = seq_len - 1
    rows = [[EOT_ID] + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)][:max_rows]
    if not rows:
        raise ValueError(f"held-out text too short for one row of {seq_len} tokens")
    return torch.tensor(rows, dtype=torch.long)
