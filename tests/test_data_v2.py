"""The embedded model v2's data: k-hop binding problems, the package corpus with digests, the
bos post-processor and the packed tensor with k-hop examples and bare text rows (CPU, < 30 s)."""
import re

import pytest
import torch

from rltlab.pretrain import corpus as C
from rltlab.pretrain import data as D
from rltlab.pretrain import tasks as T

STATEMENT = re.compile(r"^([a-z])=(?:(\d)|([a-z])(?:([+-])(\d))?)$")


def _solve(question: str) -> tuple[int, int]:
    """(value, hops) of the queried variable, by an interpreter written apart from the
    generator: every statement is parsed, evaluated, and its chain length recorded."""
    body = question.removeprefix("Q: ").removesuffix("=?\nA:")
    *statements, queried = body.split("; ")
    value, depth = {}, {}
    for s in statements:
        name, literal, src, op, d = STATEMENT.match(s).groups()
        assert name not in value, f"{name} assigned twice in {question!r}"
        if literal is not None:
            value[name], depth[name] = int(literal), 1
        else:
            v = value[src] + (int(d) if op == "+" else -int(d) if op == "-" else 0)
            value[name], depth[name] = v, depth[src] + 1
    return value[queried], depth[queried]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_hop_problems_are_correct_and_labelled(split):
    problems = T.make_hop_problems(3000, 3, split, hops=(1, 8))
    assert len({p.question for p in problems}) == 3000
    seen_k = set()
    for p in problems:
        value, hops = _solve(p.question)
        assert (value, hops) == (p.answer, p.hops) and 0 <= value <= 9
        assert p.answer_text == f" {value}" and T.extract_hop_answer(p.answer_text) == value
        seen_k.add(hops)
    assert seen_k == set(range(1, 9))


def test_hop_problems_deterministic_split_disjoint_and_length_does_not_give_k():
    a = T.make_hop_problems(500, 0)
    assert a == T.make_hop_problems(500, 0) and a != T.make_hop_problems(500, 1)
    held = T.make_hop_problems(500, 0, "heldout")
    assert not {p.question for p in a} & {p.question for p in held}
    assert all(T._in_split("hops:" + p.question, T.HOPS_HELDOUT_PERCENT, "heldout") for p in held)
    # distractors: statement counts of k = 2 and k = 5 overlap
    count = {k: {p.question.count(";") for p in a if p.hops == k} for k in (2, 5)}
    assert count[2] & count[5]
    with pytest.raises(ValueError):
        T.make_hop_problems(5, 0, hops=(3, 2))
    assert T.extract_hop_answer("x") is None and T.extract_hop_answer(" 7\n") == 7


def _fake_site_packages(root):
    (root / "alpha").mkdir(parents=True)
    (root / "beta" / "tests").mkdir(parents=True)
    (root / "alpha" / "a.py").write_text("def a():\n    return 1\n" * 50)
    (root / "alpha" / "b.py").write_text("def b():\n    return 2\n" * 50)
    (root / "beta" / "copy.py").write_text("def a():\n    return 1\n" * 50)    # vendored copy
    (root / "beta" / "table.py").write_text("X = [" + "1, " * 300 + "]\n")    # one huge line
    (root / "beta" / "c.py").write_text("class C:\n    pass\n" * 40)
    (root / "beta" / "tests" / "t.py").write_text("def test():\n    pass\n")
    (root / "gamma.py").write_text("import os\n" * 30)
    return root


def test_package_documents_dedup_filter_interleave_and_digest(tmp_path):
    root = _fake_site_packages(tmp_path / "site")
    docs, manifest = C.load_package_documents(10**6, [root])
    assert len(docs) == 4 and manifest["files"] == 4                  # a, b, c, gamma
    assert set(manifest["packages"]) == {"alpha", "beta", "gamma"}
    assert manifest["packages"]["beta"]["files"] == 1                 # copy, table, tests out
    again = C.load_package_documents(10**6, [root])
    assert again == (docs, manifest)
    (root / "alpha" / "b.py").write_text("def b():\n    return 3\n" * 50)
    changed = C.load_package_documents(10**6, [root])[1]
    assert changed["sha256"] != manifest["sha256"]
    assert changed["packages"]["alpha"]["sha256"] != manifest["packages"]["alpha"]["sha256"]
    assert changed["packages"]["beta"] == manifest["packages"]["beta"]
    # round robin: a budget of about two files takes alpha's first and beta's first, not
    # alpha's second
    two = C.load_package_documents(1500, [root])[1]
    assert {n: v["files"] for n, v in two["packages"].items()} == {"alpha": 1, "beta": 1}


@pytest.fixture(scope="module")
def tok():
    return D.train_tokenizer(vocab_size=512, max_bytes=200_000)


def test_tokenizer_puts_bos_in_front(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    text = "Q: a=3; b=a+4; b=?\nA:"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.encode(text).ids == [D.EOT_ID] + ids and ids[0] != D.EOT_ID
    hf = AutoTokenizer.from_pretrained(str(D.save_tokenizer(tok, tmp_path / "tok")))
    assert hf.encode(text) == [D.EOT_ID] + ids
    assert hf.encode(text, add_special_tokens=False) == ids
    assert hf.decode(hf.encode(text), skip_special_tokens=True) == text


def test_training_tensor_with_hops_and_bare_rows(tok):
    docs = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(300)]
    x = D.build_training_tensors(tok, 150_000, None, 0, 256, arith_frac=0.1, hop_frac=0.3,
                                 package_docs=docs, bare_frac=0.2)
    assert torch.equal(x, D.build_training_tensors(tok, 150_000, None, 0, 256, arith_frac=0.1,
                                                   hop_frac=0.3, package_docs=docs,
                                                   bare_frac=0.2))
    bare = x[:, 0] != D.EOT_ID
    assert 0.12 < bare.float().mean() < 0.28
    n_hop = n_arith = total = 0
    for row in x[~bare][:80].tolist():
        segs, cur = [], []
        for t in row[1:]:
            cur.append(t)
            if t == 0:
                segs.append(cur)
                cur = []
        for seg in segs + [cur]:
            s = tok.decode([t for t in seg if t != 0])
            total += len(seg)
            if s.startswith("Q: ") and "=?" in s:
                question, answer = s.split("\nA:")
                assert seg[-1] == 0 and _solve(question + "\nA:")[0] == int(answer)
                n_hop += len(seg)
            elif s.startswith("Q: "):
                n_arith += len(seg)
    assert 0.2 < n_hop / total < 0.4 and 0.04 < n_arith / total < 0.17
    assert all("Q: " not in tok.decode(r) for r in x[bare].tolist())   # bare rows: text only
    assert any("def f" in tok.decode(r) for r in x[-20:].tolist())     # package docs follow
    with pytest.raises(ValueError, match="arith_frac"):
        D.build_training_tensors(tok, 10_000, None, 0, 64, arith_frac=0.6, hop_frac=0.5)
