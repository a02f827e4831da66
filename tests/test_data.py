"""Tests of rltlab.pretrain.data: stdlib corpus, arithmetic task, tokenizer, packed tensors
(CPU, < 30 s). The k-hop task and the package corpus are in tests/test_data_v2.py."""
import random
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from rltlab.pretrain import data as D

STEP = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)\.")


@pytest.fixture(scope="module")
def tok():
    return D.train_tokenizer(vocab_size=512, max_bytes=300_000)


def _random_strings(seed, n=60):
    rng = random.Random(seed)
    pools = [
        [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", "\r", "  ", "\u00a0", "\u3000"],
        ["def f(x):\n", "    return x**2", " # é", "'s", "'ll", "１２３", "٣", "²", "Ⅻ",
         "\x1c", "\x0b"],
        [chr(rng.randrange(0x80, 0x2FFFF)) for _ in range(500)],
    ]
    out = []
    for _ in range(n):
        s = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 80)))
        out.append("".join(c for c in s if not 0xD800 <= ord(c) <= 0xDFFF))
    return out + ["", " ", "x  \n  y", "a  8", "12345", "#### 33", "🎉 héllo 世界 \U0001F600"]


# ----------------------------------------------------------------------------- text corpus
def test_stdlib_files_sorted_and_filtered():
    files = D.stdlib_source_files()
    assert len(files) > 100 and files == D.stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels)
    for f in files:
        parts = set(f.relative_to(root).parts)
        assert f.suffix == ".py" and not parts & {"site-packages", "idlelib", "test", "tests"}


def test_text_split_is_disjoint_and_deterministic():
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in D.stdlib_source_files()]
    held = [r for r in rels if D._in_split("text:" + r, D.TEXT_HELDOUT_PERCENT, "heldout")]
    train = [r for r in rels if D._in_split("text:" + r, D.TEXT_HELDOUT_PERCENT, "train")]
    assert not set(held) & set(train) and len(held) + len(train) == len(rels)
    assert 0 < len(held) < 0.1 * len(rels)
    docs = D.load_text_documents(200_000, "train")
    assert docs == D.load_text_documents(200_000, "train")
    assert sum(len(d.encode()) for d in docs) <= 200_000 and len(docs) > 3
    assert D.load_text_corpus(50_000, "heldout") == "\n\n".join(
        D.load_text_documents(50_000, "heldout"))
    with pytest.raises(ValueError):
        D.load_text_documents(1000, "valid")


# ----------------------------------------------------------------------------- arithmetic
def test_problems_deterministic_and_seeded():
    a, b = D.make_arithmetic_problems(300, 0), D.make_arithmetic_problems(300, 0)
    assert a == b and len(a) == 300 and len({p.question for p in a}) == 300
    assert a != D.make_arithmetic_problems(300, 1)
    assert (D.make_arithmetic_problems(50, 0, "heldout")
            == D.make_arithmetic_problems(50, 0, "heldout"))


def test_train_heldout_disjoint():
    train = {p.question for s in (0, 1) for p in D.make_arithmetic_problems(20_000, s)}
    held = [p.question for s in (0, 1234) for p in D.make_arithmetic_problems(500, s, "heldout")]
    assert not train & set(held)
    assert all(D._in_split("arith:" + q, D.ARITH_HELDOUT_PERCENT, "heldout") for q in held)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_problem_format_and_cot_correct(split):
    for p in D.make_arithmetic_problems(2000, 7, split):
        assert p.question.startswith("Q: ") and p.question.endswith("\nA:")
        assert p.answer_text.startswith(" ") and p.answer_text.endswith(f"#### {p.answer}")
        assert D.extract_answer(p.answer_text) == p.answer >= 0
        assert all(int(x) <= 50 for x in re.findall(r"\d+", p.question))
        steps = STEP.findall(p.answer_text)
        assert 2 <= len(steps) <= 3
        assert p.answer_text == " " + " ".join(f"{a}{o}{b}={c}." for a, o, b, c in steps) \
            + f" #### {p.answer}"
        for a, op, b, c in steps:
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
        assert int(steps[-1][3]) == p.answer


def test_extract_answer():
    assert D.extract_answer(" 3*7=21. 12+21=33. #### 33") == 33
    assert D.extract_answer("#### 1,234.") == 1234
    assert D.extract_answer("#### -5 then #### 7") == -5
    assert D.extract_answer("#### 12<|endoftext|>junk") == 12
    for bad in ["", "33", "####33", "#### ", "#### abc", "#### 3.5", "#### 1.2.3", "#### ."]:
        assert D.extract_answer(bad) is None, bad


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_special_and_digits(tok):
    assert tok.token_to_id(D.EOT) == 0 and tok.id_to_token(0) == D.EOT
    assert tok.encode(D.EOT, add_special_tokens=False).ids == [0]
    assert tok.get_vocab_size() == 512
    for s in ["0123456789", "x = 1234567 + 89", "#### 2026"]:
        enc = tok.encode(s, add_special_tokens=False)
        digit_toks = [t for t in enc.ids if any(c.isdigit() for c in tok.decode([t]))]
        assert all(len(tok.decode([t])) == 1 for t in digit_toks)
        assert len(digit_toks) == sum(c.isdigit() for c in s)


def test_tokenizer_round_trip(tok):
    code = D.load_text_documents(20_000, "heldout")
    for s in _random_strings(0) + code:
        assert tok.decode(tok.encode(s).ids) == s  # the bos token 0 decodes to nothing


def test_auto_tokenizer_loads_saved_dir(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    d = D.save_tokenizer(tok, tmp_path / "tok")
    for hf in (AutoTokenizer.from_pretrained(str(d)),
               PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))):
        s = "def f(x):\n    return 12 + x  # é 世界"
        assert (hf.encode(s) == tok.encode(s).ids
                == [0] + tok.encode(s, add_special_tokens=False).ids)
        assert hf.decode(hf.encode(s), skip_special_tokens=True) == s
    hf = AutoTokenizer.from_pretrained(str(d))
    assert hf.bos_token_id == hf.eos_token_id == 0


# ----------------------------------------------------------------------------- tensors
def test_fast_encoders_match_tokenizer(tok):
    import regex
    pat = regex.compile(D._PRETOK)
    for s in _random_strings(1, n=200):
        assert D._encode_segments(tok, pat.findall(s)).tolist() == \
            tok.encode(s, add_special_tokens=False).ids, repr(s)
    docs = D.load_text_documents(150_000, "train") + ["a <|endoftext|> b", "x"]
    ref = [t for e in tok.encode_batch(docs, add_special_tokens=False) for t in (*e.ids, 0)]
    assert D._encode_docs(tok, docs).tolist() == ref
    probs = D.make_arithmetic_problems(300, 3)
    ids, lens = D._encode_arithmetic(tok, probs)
    ref = [tok.encode(p.question + p.answer_text, add_special_tokens=False).ids + [0]
           for p in probs]
    assert ids.tolist() == [t for r in ref for t in r] and lens.tolist() == [len(r) for r in ref]


def test_build_training_tensors(tok):
    x = D.build_training_tensors(tok, 200_000, None, seed=0, seq_len=256)
    assert x.dtype == torch.long and x.shape[1] == 256 and x.shape[0] > 50
    assert torch.equal(x, D.build_training_tensors(tok, 200_000, None, seed=0, seq_len=256))
    assert (x[:, 0] == 0).all() and 0 <= int(x.min()) and int(x.max()) < 512
    n_arith = n_text = 0
    for row in x[:40].tolist():
        segs, cur = [], []
        for t in row[1:]:
            cur.append(t)
            if t == 0:
                segs.append(cur)
                cur = []
        segs.append(cur)
        for seg in segs:
            s = tok.decode([t for t in seg if t != 0])
            if s.startswith("Q: "):  # arithmetic examples are whole and correct
                assert seg[-1] == 0 and s.split("\nA:")[1].startswith(" ")
                assert D.extract_answer(s) == int(s.rsplit(" ", 1)[1])
                n_arith += len(seg)
            else:
                n_text += len(seg)
    assert 0.35 < n_arith / (n_arith + n_text) < 0.65
    # text longer than the corpus is cycled; a fixed n_arith bounds the rows
    y = D.build_training_tensors(tok, 200_000, 100, seed=1, seq_len=256)
    assert 0 < len(y) <= 100


def test_build_heldout_tensors(tok):
    h = D.build_heldout_tensors(tok, 128, max_bytes=30_000)
    assert h.dtype == torch.long and h.shape[1] == 128 and len(h) > 10
    assert (h[:, 0] == 0).all()
    text = D.load_text_corpus(30_000, "heldout")
    assert tok.decode(h[0, 1:].tolist())[:50] == text[:50]
    assert np.all(h.numpy() < 512)


def test_prompt_and_answer_tokenize_independently(tok):
    # eval feeds [0] + encode(question) and compares the generated continuation: the split point
    # "\nA:" | " 3*7=..." must be a token boundary, as it is in the packed training rows
    for p in D.make_arithmetic_problems(300, 5, "heldout"):
        enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        assert enc(p.question) + enc(p.answer_text) == enc(p.question + p.answer_text)
