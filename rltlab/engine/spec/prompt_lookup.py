"""Prompt-lookup drafts (n-gram speculation) for a TreeProposer's lookup chain (issue 16).

The drafts for positions P + 1..P + L copy what followed the latest earlier occurrence of the
sequence's last n tokens (n = ngram, then fewer where that finds none). If that occurrence ends
d positions before P, the sequence is read as periodic with period d past the present: draft j
is tokens[s + n + (j mod d)], s the occurrence's start. With no occurrence at all, every draft
repeats the token at P. Greedy continuations that loop, as small models' do, are then drafted
to any depth; verification keeps decoding exact whatever the drafts are.

`prompt_lookup` runs on the device inside the tree program (static shapes, no host sync, so it
compiles and graph-captures); `prompt_lookup_ref` is the same rule on a Python list, the spec
in the tests.
"""
from __future__ import annotations

import torch


def prompt_lookup_ref(tokens: list[int], length: int, ngram: int) -> list[int]:
    """Drafts for the `length` positions after tokens[-1] (module docstring)."""
    return prompt_lookup_match(tokens, length, ngram)[0]


def prompt_lookup_match(tokens: list[int], length: int, ngram: int) -> tuple[list[int], int]:
    """-> (prompt_lookup_ref's drafts, the length of the match they came from: 0 for none)."""
    pos = len(tokens) - 1
    for n in range(min(ngram, pos), 0, -1):
        suffix = tokens[pos - n + 1:]
        for start in range(pos - n, -1, -1):       # latest first; ends before pos
            if tokens[start:start + n] == suffix:
                begin, period = start + n, pos + 1 - (start + n)
                return [tokens[begin + j % period] for j in range(length)], n
    return [tokens[pos]] * length, 0


def prompt_lookup(history: torch.Tensor, pos: torch.Tensor, length: int, ngram: int,
                  with_match: bool = False):
    """prompt_lookup_ref on the device: history [T] int64 holds the tokens at positions
    0..pos (later entries are never read), pos [1] int64 -> drafts [length] int64 (with_match:
    and the match length [1], prompt_lookup_match's)."""
    size = history.numel()
    at = torch.arange(size, device=history.device)
    begin = torch.full_like(pos, -1)       # where the chosen continuation starts, -1: none
    matched = torch.zeros_like(pos)
    for n in range(1, ngram + 1):          # a longer match, where there is one, overrides
        match = at <= pos - n              # an occurrence at `at` ends before pos
        for i in range(n):
            match &= history[(at + i).clamp(max=size - 1)] == \
                history[(pos - n + 1 + i).clamp(min=0)]
        latest = torch.where(match, at, -1).max().view(1)
        begin = torch.where(latest >= 0, latest + n, begin)
        matched = torch.where(latest >= 0, n, matched)
    period = (pos + 1 - begin).clamp(min=1)
    j = torch.arange(length, device=history.device)
    drafts = history[torch.where(begin >= 0, begin + j % period, pos)]
    return (drafts, matched) if with_match else drafts
