"""Prompt-lookup drafts (rltlab.engine.spec.prompt_lookup): the rule on hand-checked cases, and the
device version equal to it on random histories with planted loops, never reading past the
present (the entries there are out-of-vocabulary markers that would show up in the drafts)."""
import random

import pytest
import torch

from rltlab.engine.spec.prompt_lookup import prompt_lookup, prompt_lookup_match, prompt_lookup_ref


def test_the_rule_on_hand_checked_cases():
    # (5, 6) occurred at 0: continue from position 2, period 6 - 2 = 4
    assert prompt_lookup_ref([5, 6, 7, 8, 5, 6], 6, 2) == [7, 8, 5, 6, 7, 8]
    tokens = [1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3]
    # ngram 3: (1, 2, 3) at 0 beats the later (2, 3) at 5; period 11 - 3 = 8
    assert prompt_lookup_ref(tokens, 9, 3) == [9, 4, 2, 3, 7, 1, 2, 3, 9]
    # ngram 2: the latest (2, 3) earlier than the end, at 5; period 4
    assert prompt_lookup_ref(tokens, 5, 2) == [7, 1, 2, 3, 7]
    assert prompt_lookup_ref([8, 4, 4], 3, 3) == [4, 4, 4]      # period 1
    assert prompt_lookup_ref([1, 2, 3], 3, 3) == [3, 3, 3]      # no occurrence: repeat
    assert prompt_lookup_ref([4], 2, 3) == [4, 4]
    # the match lengths behind them (TreeProposer's "agree" rule reads them)
    assert prompt_lookup_match(tokens, 9, 3)[1] == 3 and prompt_lookup_match(tokens, 5, 2)[1] == 2
    assert prompt_lookup_match([8, 4, 4], 3, 3)[1] == 1
    assert prompt_lookup_match([1, 2, 3], 3, 3)[1] == 0 and prompt_lookup_match([4], 2, 3)[1] == 0


@pytest.mark.parametrize("seed", range(24))
def test_device_drafts_equal_the_rule(seed):
    rng = random.Random(seed)
    vocab, size = rng.choice([2, 4, 9, 50]), 40
    pos = rng.randrange(0, size - 1)
    tokens = [rng.randrange(vocab) for _ in range(pos + 1)]
    if seed % 2:                               # a loop of a few tokens at the end
        period = rng.randint(1, 6)
        for i in range(max(period, pos - rng.randint(0, 12)), pos + 1):
            tokens[i] = tokens[i - period]
    history = torch.tensor(tokens + [1000 + i for i in range(size - pos - 1)])
    for length in (1, 5, 16):
        for ngram in (1, 2, 3, 4):
            got, matched = prompt_lookup(history, torch.tensor([pos]), length, ngram, True)
            assert (got.tolist(), int(matched)) == prompt_lookup_match(tokens, length, ngram), \
                (length, ngram)
