"""The embedded model's task data: held-out problems with a known answer.

* Word problems: 2-3 step arithmetic with a short chain of thought ("Q: Kim has 40 dollars, ...
  A: 40+15=55. 55-45=10. #### 10"). The chain of thought makes each step shallow: these test
  that depth is NOT needed once the work is written out.
* k-hop variable binding (depth-graded): "Q: a=3; f=7; b=a+4; g=f-2; c=b-2; c=?\nA: 5". The
  queried variable sits at the end of a chain of k assignments, with distractor chains
  interleaved; there is no chain of thought, so the answer digit must be computed inside the
  forward pass, and the work grows with k (one lookup and one small addition per hop). `hops`
  labels each problem with its k.

Splits are by a stable hash of the question text (disjoint train / heldout question spaces).
"""
from __future__ import annotations

import random
import re
import string
import zlib
from dataclasses import dataclass

ARITH_HELDOUT_PERCENT = 5  # share of the question space reserved for arithmetic eval
HOPS_HELDOUT_PERCENT = 5   # the same for k-hop problems


def _in_split(key: str, percent: int, split: str) -> bool:
    """Stable hash split (Python's hash() is salted per process, so it can't define one)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return (zlib.crc32(key.encode("utf-8")) % 100 < percent) == (split == "heldout")


# ----------------------------------------------------------------------------- word problems
@dataclass(frozen=True)
class ArithmeticProblem:
    question: str     # "Q: ...\nA:"  (the prompt)
    answer_text: str  # " 3*7=21. 12+21=33. #### 33"  (the target continuation)
    answer: int


_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo",
          "Mia", "Nora", "Omar", "Pia", "Raj", "Sam", "Tess", "Uma", "Vic", "Wen", "Yara", "Zoe"]
_ITEMS = ["apples", "pens", "books", "cards", "eggs", "shells", "stamps", "coins", "beads",
          "marbles", "cookies", "stickers", "rocks", "plums", "toys", "cups"]
_BOXES = ["bags", "boxes", "packs", "jars", "crates", "baskets"]


def _problem(rng: random.Random) -> tuple[str, list[tuple[int, str, int]]]:
    """A question body and its solution steps [(a, op, b), ...]. Question numbers are <= 50, every
    product has a factor <= 9 (so <= 108), every result is non-negative: the intermediate steps are
    where extra loop rounds can help, yet a 4M-param model learns much of it in minutes."""
    r = lambda lo, hi, u=rng.random: lo + int(u() * (hi - lo + 1))  # noqa: E731, 3x randint's speed
    n, it, bx = _NAMES[r(0, len(_NAMES) - 1)], _ITEMS[r(0, len(_ITEMS) - 1)], _BOXES[r(0, 5)]
    t = r(0, 6)
    if t == 0:  # a + b*c
        a, b, c = r(1, 50), r(2, 9), r(2, 12)
        return (f"{n} has {a} {it}. {n} buys {b} {bx} of {c} {it}. How many {it} does {n} have?",
                [(b, "*", c), (a, "+", b * c)])
    if t == 1:  # a - b + c
        a = r(2, 50); b = r(1, a); c = r(1, 50)
        return (f"{n} has {a} {it}. {n} gives away {b} and then finds {c} more. How many {it} "
                f"does {n} have now?", [(a, "-", b), (a - b, "+", c)])
    if t == 2:  # a*b + c*d
        a, b, c, d = r(2, 9), r(2, 12), r(2, 9), r(2, 12)
        return (f"{n} buys {a} {bx} of {b} {it} and {c} {bx} of {d} {it}. How many {it} does "
                f"{n} buy?", [(a, "*", b), (c, "*", d), (a * b, "+", c * d)])
    if t == 3:  # a - b*c
        b = r(2, 9); c = r(2, 50 // b); a = r(b * c, 50)
        return (f"{n} had {a} {it}. {n} sold {b} {it} each day for {c} days. How many {it} are "
                f"left?", [(b, "*", c), (a, "-", b * c)])
    if t == 4:  # a*b - c
        a, b = r(2, 9), r(2, 12); c = r(0, min(50, a * b))
        return (f"There are {a} {bx} with {b} {it} in each. {c} {it} are taken away. How many "
                f"{it} remain?", [(a, "*", b), (a * b, "-", c)])
    if t == 5:  # a + b - c
        a, b = r(1, 50), r(1, 50); c = r(0, min(50, a + b))
        return (f"{n} has {a} dollars, earns {b} more and then spends {c}. How many dollars does "
                f"{n} have?", [(a, "+", b), (a + b, "-", c)])
    c, d = r(2, 5), r(2, 9); a = r(1, 50); b = r(max(1, c * d - a), 50)  # a + b - c*d
    return (f"{n} has {a} {it} and buys {b} more, then gives {c} {it} to each of {d} friends. "
            f"How many {it} are left?", [(a, "+", b), (c, "*", d), (a + b, "-", c * d)])


_OPS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}


def make_arithmetic_problems(n: int, seed: int, split: str = "train") -> list[ArithmeticProblem]:
    """`n` distinct 2-3 step word problems with a short chain of thought, deterministic in
    (seed, split). Train and heldout are disjoint: each question text belongs to exactly one
    split (stable hash, ~5% heldout) and candidates of the other split are discarded."""
    rng = random.Random(f"{seed}:{split}")  # str seeds go through sha512: stable everywhere
    out: list[ArithmeticProblem] = []
    seen: set[str] = set()
    for _ in range(200 * n + 10_000):  # bounded, should the question space ever run out
        if len(out) == n:
            return out
        body, steps = _problem(rng)
        q = f"Q: {body}\nA:"
        if q in seen or not _in_split("arith:" + q, ARITH_HELDOUT_PERCENT, split):
            continue
        seen.add(q)
        vals = [_OPS[op](a, b) for a, op, b in steps]
        cot = " ".join(f"{a}{op}{b}={v}." for (a, op, b), v in zip(steps, vals))
        out.append(ArithmeticProblem(q, f" {cot} #### {vals[-1]}", vals[-1]))
    raise RuntimeError(f"only {len(out)} distinct problems found, {n} asked")


_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k "strict-match"


def extract_answer(text: str) -> int | None:
    """The integer after the first '#### ' ("1,234." -> 1234), None if absent or not an integer."""
    m = _ANSWER_RE.search(text)
    s = m.group(1).replace(",", "").removesuffix(".") if m else ""
    return int(s) if re.fullmatch(r"-?[0-9]+", s) else None


# ----------------------------------------------------------------------------- k-hop binding
@dataclass(frozen=True)
class HopProblem:
    question: str     # "Q: a=3; f=7; b=a+4; c=b-2; c=?\nA:"  (the prompt)
    answer_text: str  # " 5"  (the target continuation)
    answer: int       # 0..9
    hops: int         # k: assignments on the queried chain, literal included


def _chain(rng: random.Random, names: list[str], length: int) -> tuple[list[str], int]:
    """Statements of one chain of `length` assignments ("a=3", "b=a+4", "c=b-2", "d=c") and the
    value of its last variable. Values stay in 0..9, so each hop is a lookup and a one-digit
    addition or subtraction (or a plain copy)."""
    value = rng.randrange(10)
    out = [f"{names[0]}={value}"]
    for prev, name in zip(names, names[1:]):
        kind = rng.randrange(5)
        if kind == 0:
            out.append(f"{name}={prev}")
            continue
        up = kind <= 2 if 0 < value < 9 else value == 0
        d = rng.randint(1, 9 - value) if up else rng.randint(1, value)
        out.append(f"{name}={prev}{'+' if up else '-'}{d}")
        value += d if up else -d
    return out, value


def make_hop_problems(n: int, seed: int, split: str = "train",
                      hops: tuple[int, int] = (1, 10)) -> list[HopProblem]:
    """`n` distinct k-hop binding problems, k uniform in hops[0]..hops[1], deterministic in
    (seed, split). One or two distractor chains (2-6 statements in all) are interleaved with the
    queried chain, each chain in its own order, so neither the prompt's length nor the queried
    variable's position gives k away."""
    lo, hi = hops
    if not 1 <= lo <= hi <= 20:
        raise ValueError(f"hops must satisfy 1 <= lo <= hi <= 20, got {hops}")
    rng = random.Random(f"hops:{seed}:{split}")
    out: list[HopProblem] = []
    seen: set[str] = set()
    for _ in range(50 * n + 10_000):
        if len(out) == n:
            return out
        k = rng.randint(lo, hi)
        n_distract = rng.randint(2, 6)
        cuts = (sorted(rng.sample(range(1, n_distract), 1))
                if n_distract > 2 and rng.random() < .5 else [])
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n_distract])]
        names = rng.sample(string.ascii_lowercase, k + n_distract)
        target, value = _chain(rng, names[:k], k)
        chains, used = [target], k
        for length in lengths:
            chains.append(_chain(rng, names[used:used + length], length)[0])
            used += length
        # interleave: pick the next chain at random, weighted by what it has left
        order = [i for i, c in enumerate(chains) for _ in c]
        rng.shuffle(order)
        cursor = [0] * len(chains)
        statements = []
        for i in order:
            statements.append(chains[i][cursor[i]])
            cursor[i] += 1
        q = f"Q: {'; '.join(statements)}; {names[k - 1]}=?\nA:"
        if q in seen or not _in_split("hops:" + q, HOPS_HELDOUT_PERCENT, split):
            continue
        seen.add(q)
        out.append(HopProblem(q, f" {value}", value, k))
    raise RuntimeError(f"only {len(out)} distinct problems found, {n} asked")


_HOP_ANSWER_RE = re.compile(r"\s*(\d)")


def extract_hop_answer(text: str) -> int | None:
    """The digit a k-hop answer starts with (" 5" -> 5), None if it does not start with one."""
    m = _HOP_ANSWER_RE.match(text)
    return int(m.group(1)) if m else None


def answer_of(problem, text: str) -> int | None:
    """The answer a continuation gives to `problem` (a dict or dataclass): the first digit for a
    k-hop problem (one with `hops`), the number after '#### ' for a word problem."""
    hops = problem.get("hops") if isinstance(problem, dict) else getattr(problem, "hops", None)
    return extract_hop_answer(text) if hops is not None else extract_answer(text)
