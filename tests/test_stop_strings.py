"""SamplingParams.stop (vLLM's semantics): generation ends at a stop string, the text is cut
before it (kept with include_stop_str_in_output), token ids are kept, stop_reason names it; a
stop string across token boundaries is found; the earliest occurrence wins; bad values and an
engine without a tokenizer are refused."""
from __future__ import annotations

import pytest

from rltlab.engine import LLM, SamplingParams
from rltlab.engine.stop_strings import find_stop
from rltlab.model.checkpoint import load_model


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer, _ = load_model(None, device="cpu")
    return LLM(model, tokenizer), tokenizer


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_generation_ends_at_a_stop_string_and_the_text_is_cut(embedded):
    llm, tokenizer = embedded
    prompt = "The cat sat on the"
    full = llm.generate(prompt, greedy())[0]
    text = full.text
    # a stop string from the middle of the unstopped output, spanning a token boundary
    cut = len(tokenizer.decode(full.token_ids[:6]))
    stop = text[cut - 2: cut + 2]
    assert len(stop) == 4 and stop not in text[:cut - 2]
    out = llm.generate(prompt, greedy(stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut - 2]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    kept = llm.generate(prompt, greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == text[:cut + 2] and kept.token_ids == out.token_ids


def test_the_earliest_stop_string_wins_and_absent_ones_do_nothing(embedded):
    llm, _ = embedded
    prompt = "The cat sat on the"
    text = llm.generate(prompt, greedy())[0].text
    early, late = text[3:6], text[10:14]
    assert early not in text[:3]
    out = llm.generate(prompt, greedy(stop=[late, early]))[0]
    assert out.stop_reason == early and out.text == text[:3]
    none = llm.generate(prompt, greedy(stop=["\u2603never"]))[0]
    assert none.finish_reason == "length" and none.text == text and none.stop_reason is None


def test_stop_token_ids_report_their_stop_reason(embedded):
    llm, _ = embedded
    full = llm.generate("x = ", greedy(max_tokens=8))[0]
    out = llm.generate("x = ", greedy(max_tokens=8, stop_token_ids=[full.token_ids[2]]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == full.token_ids[2]


def test_an_eos_stop_keeps_the_token_but_not_its_text():
    """vLLM: a sequence that ends at EOS keeps the id in token_ids; the text leaves it out.
    LLM(path) decodes with a transformers tokenizer, whose decode writes special tokens: the
    README's example read "5<|endoftext|>"."""
    from rltlab.common.paths import embedded_model_dir

    llm = LLM(str(embedded_model_dir()))
    out = llm.generate("Q: a=3; f=7; b=a+4; c=b-2; c=?\nA:",
                       SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == llm.llm_engine.eos_token_id
    tokenizer = llm.llm_engine.tokenizer
    assert tokenizer.decode(out.token_ids[-1:]) == "<|endoftext|>"
    assert out.text == tokenizer.decode(out.token_ids[:-1]) and "<|endoftext|>" not in out.text


class _Chars:
    """A tokenizer of one character per id."""

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_find_stop_looks_only_where_the_newest_token_can_complete_a_string():
    tok = _Chars()
    assert find_stop(tok, [0, 1, 2, 3], ["cd"]) == ("cd", 2)
    assert find_stop(tok, [0, 1, 2, 3], ["zz"]) is None
    long = [25] * 40 + [0, 1]          # "z"*40 + "ab": the tail still sees "ab"
    assert find_stop(tok, long, ["ab", "zza"]) == ("zza", 38)


@pytest.mark.parametrize("bad", [[""], [3], "", ["ok", None]])
def test_bad_stop_values_are_refused(bad):
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=bad)


@pytest.mark.slow
def test_stop_strings_without_a_tokenizer_are_refused(embedded):
    llm, _ = embedded
    bare = LLM(llm.llm_engine.model)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate([[1, 2, 3]], greedy(stop=["a"]))
