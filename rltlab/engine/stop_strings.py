"""Stop strings (SamplingParams.stop, vLLM's semantics): a sequence stops when its detokenized
output contains one of the strings; its text is cut where the string starts (or ends, with
include_stop_str_in_output); its token ids are kept whole.

The check runs after every token, so a string that was not there before must end in the newest
token's text: each check decodes only a tail of the output (enough tokens for the longest
string plus slack) and stays O(1) per token. Only when a tail matches is the whole output
decoded, to find where the earliest stop string starts in the text the user gets.
"""
from __future__ import annotations

SLACK_TOKENS = 4   # tokens of less than one character (special tokens, split UTF-8 bytes)


def tail_tokens(stops: list[str]) -> int:
    """Tokens a tail must hold so that any stop string ending in its last token lies inside it
    (every other token decodes to at least one byte)."""
    return max(len(s.encode("utf-8")) for s in stops) + SLACK_TOKENS


def find_stop(tokenizer, output_ids: list[int], stops: list[str]) -> tuple[str, int] | None:
    """(the stop string, where it starts in the decoded output) for the earliest occurrence of
    any of `stops` in the output's text, if the newest tokens completed one; else None."""
    tail = tokenizer.decode(output_ids[-tail_tokens(stops):])
    if not any(s in tail for s in stops):
        return None
    text = tokenizer.decode(output_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    start, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
    return stop, start
