"""Offline data for the small embedded default model: stdlib source text + arithmetic word problems.

Why this mix (REFERENCE.md section 6): code text is "easy" per token and saturates after one or two
loop rounds, while multi-step arithmetic keeps improving with depth. A model trained on both has the
per-token difficulty spread that exit prediction and loop-aware drafting need. Everything here works
without network access: the text is the running interpreter's own standard library, the arithmetic
is generated, and the tokenizer is trained locally.

Sequence convention used by all tensors built here: token 0 is "<|endoftext|>" and serves as both
bos and eos. Every row starts with 0 and every document / problem ends with 0, so an arithmetic
prompt at eval time is ``[0] + encode(problem.question)`` and generation should stop at token 0.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
EOT_ID = 0
TEXT_HELDOUT_PERCENT = 3   # share of stdlib files held out for text loss
ARITH_HELDOUT_PERCENT = 5  # share of the question space reserved for arithmetic eval
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def _bucket(key: str) -> int:
    """Stable 0..99 bucket (Python's hash() is salted per process, so it can't define a split)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") % 100


# ----------------------------------------------------------------------------- text corpus

def stdlib_source_files() -> list[Path]:
    """Sorted .py files of the running interpreter's stdlib, minus tests, IDLE and installed packages.

    Tests are excluded because they are huge and repetitive; `_sysconfigdata*` because it is
    machine-specific build configuration (it would make the corpus differ between hosts).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place: site-packages alone can be gigabytes, never descend into it
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        files += [Path(dirpath, f) for f in filenames
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text_documents(max_bytes: int | None = None, split: str = "train") -> list[str]:
    """One string per stdlib file of `split`, in a stable hash-shuffled order, up to max_bytes (UTF-8).

    Files are ordered by the hash of their relative path rather than alphabetically, so a max_bytes
    prefix is a spread-out sample of the stdlib instead of just the modules starting with 'a'..'m'.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root).as_posix() for p in stdlib_source_files()]
    rels = [r for r in rels if (_bucket("text:" + r) < TEXT_HELDOUT_PERCENT) == (split == "heldout")]
    rels.sort(key=lambda r: (hashlib.sha1(r.encode()).hexdigest(), r))
    docs, total = [], 0
    for rel in rels:
        # errors="replace": a stray non-UTF-8 byte must not make the corpus machine-dependent.
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        n = len(text.encode("utf-8"))
        if max_bytes is not None and total + n > max_bytes:
            keep = max_bytes - total
            if keep > 0:  # cut the last file at a character boundary
                docs.append(text.encode("utf-8")[:keep].decode("utf-8", errors="ignore"))
            break
        docs.append(text)
        total += n
    return docs


def load_text_corpus(max_bytes: int | None = None, split: str = "train") -> str:
    """The documents of `load_text_documents` joined by blank lines (one string)."""
    return "\n\n".join(load_text_documents(max_bytes, split))


# ----------------------------------------------------------------------------- arithmetic task

@dataclass(frozen=True)
class ArithmeticProblem:
    question: str     # "Q: ...\nA:"  (the prompt)
    answer_text: str  # " 3*7=21. 12+21=33. #### 33"  (the target continuation)
    answer: int


_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo",
          "Mia", "Nora", "Omar", "Pia", "Raj", "Sam", "Tess", "Uma", "Vic", "Wen", "Yara", "Zoe"]
_ITEMS = ["apples", "pens", "books", "cards", "eggs", "shells", "stamps", "coins", "beads",
          "marbles", "cookies", "stickers", "rocks", "plums", "toys", "cups"]
_CONTAINERS = ["bags", "boxes", "packs", "jars", "crates", "baskets"]


def _problem(rng: random.Random) -> tuple[str, list[tuple[int, str, int]]]:
    """One question (without the 'Q:'/'A:' frame) and its solution steps [(a, op, b), ...].

    Multiplications use small factors (2..12) so products stay <= 144; additions/subtractions use
    operands <= 50 plus earlier results. Every result is non-negative by construction.
    """
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    r = rng.randint
    t = r(0, 6)
    if t == 0:  # a + b*c
        a, b, c = r(1, 50), r(2, 9), r(2, 12)
        q = f"{name} has {a} {item}. {name} buys {b} {box} of {c} {item}. How many {item} does {name} have?"
        return q, [(b, "*", c), (a, "+", b * c)]
    if t == 1:  # a - b + c
        a = r(2, 50); b = r(1, a); c = r(1, 50)
        q = f"{name} has {a} {item}. {name} gives away {b} and then finds {c} more. How many {item} does {name} have now?"
        return q, [(a, "-", b), (a - b, "+", c)]
    if t == 2:  # a*b + c*d  (3 steps)
        a, b, c, d = r(2, 9), r(2, 12), r(2, 9), r(2, 12)
        q = f"{name} buys {a} {box} of {b} {item} and {c} {box} of {d} {item}. How many {item} does {name} buy?"
        return q, [(a, "*", b), (c, "*", d), (a * b, "+", c * d)]
    if t == 3:  # a - b*c, with a >= b*c
        b = r(2, 9); c = r(2, 50 // b); a = r(b * c, 50)
        q = f"{name} had {a} {item}. {name} sold {b} {item} each day for {c} days. How many {item} are left?"
        return q, [(b, "*", c), (a, "-", b * c)]
    if t == 4:  # a*b - c
        a, b = r(2, 9), r(2, 12); c = r(0, min(50, a * b))
        q = f"There are {a} {box} with {b} {item} in each. {c} {item} are taken away. How many {item} remain?"
        return q, [(a, "*", b), (a * b, "-", c)]
    if t == 5:  # (a + b) - c
        a, b = r(1, 50), r(1, 50); c = r(0, min(50, a + b))
        q = f"{name} has {a} dollars, earns {b} more and then spends {c}. How many dollars does {name} have?"
        return q, [(a, "+", b), (a + b, "-", c)]
    # t == 6: (a + b) - c*d  (3 steps)
    c, d = r(2, 5), r(2, 9); a = r(1, 50); b = r(max(1, c * d - a), 50)
    q = f"{name} has {a} {item} and buys {b} more, then gives {c} {item} to each of {d} friends. How many {item} are left?"
    return q, [(a, "+", b), (c, "*", d), (a + b, "-", c * d)]


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_arithmetic_problems(n: int, seed: int, split: str = "train") -> list[ArithmeticProblem]:
    """`n` distinct 2-3 step word problems with a short chain of thought, deterministic in (seed, split).

    Train/heldout are disjoint by construction: a question belongs to exactly one split, decided by
    a stable hash of its text, and candidates of the other split are discarded.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{seed}:{split}")  # str seeds are hashed with sha512: stable everywhere
    out: list[ArithmeticProblem] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise RuntimeError("could not generate enough distinct problems")
        body, steps = _problem(rng)
        question = f"Q: {body}\nA:"
        if question in seen or (_bucket("arith:" + question) < ARITH_HELDOUT_PERCENT) != (split == "heldout"):
            continue
        seen.add(question)
        parts = [f"{a}{op}{b}={_apply(a, op, b)}." for a, op, b in steps]
        answer = _apply(*steps[-1])
        out.append(ArithmeticProblem(question, " " + " ".join(parts) + f" #### {answer}", answer))
    return out


_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text: str) -> int | None:
    """lm-eval gsm8k "strict-match": the number after the first '#### ', None if absent/unparseable."""
    m = _ANSWER_RE.search(text)
    if m is None:
        return None
    s = m.group(1).replace(",", "").rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    return int(v) if v.is_integer() else None


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(vocab_size: int = 1024, max_bytes: int | None = 8_000_000, seed: int = 0):
    """Byte-level BPE over train stdlib text + train arithmetic text (roughly 2:1 in bytes).

    Digits are split individually so numbers are always digit sequences: otherwise BPE would merge
    frequent numbers ("12", "100") into opaque tokens and arithmetic would have to be memorised per
    token. Byte-level pieces make decode(encode(s)) == s for any unicode string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],  # first => id 0
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    docs = load_text_documents(max_bytes, "train")
    n_text = sum(len(d) for d in docs)
    n_arith = max(100, n_text // 2 // 110)  # ~110 chars per problem
    arith = [p.question + p.answer_text for p in make_arithmetic_problems(n_arith, seed, "train")]
    tok.train_from_iterator(docs + arith, trainer=trainer)
    assert tok.token_to_id(EOT) == EOT_ID
    return tok


def save_tokenizer(tok, directory: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json so transformers' AutoTokenizer loads it offline."""
    import json

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "unk_token": EOT, "pad_token": EOT, "model_max_length": 2048,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


# ----------------------------------------------------------------------------- tensors

def _text_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """All docs tokenized (in parallel by the Rust side), each followed by EOT, as one int32 array."""
    encs = tokenizer.encode_batch(docs, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.array([EOT_ID], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def build_training_tensors(tokenizer, text_bytes: int | None, n_arith: int | None, seed: int,
                           seq_len: int, arith_frac: float = 0.5) -> torch.LongTensor:
    """Packed training rows [N, seq_len]: ~arith_frac of each row's tokens are whole arithmetic
    examples (question + answer_text + EOT), the rest a contiguous slice of the stdlib text stream.

    Built once, up front, with batched Rust tokenization and numpy packing (a per-step Python loader
    was the probe's bottleneck). Row layout: [EOT] + examples + text, or [EOT] + text + [EOT] +
    examples (coin flip per row, so neither kind is tied to early positions). Arithmetic examples
    never straddle rows, so every one is seen with its full question. If `text_bytes` exceeds the
    train corpus the text stream is repeated; `n_arith=None` picks enough problems to use all text.
    Rows stop when either source runs out.
    """
    docs = load_text_documents(text_bytes, "train")
    text = _text_stream(tokenizer, docs)
    avail = sum(len(d.encode("utf-8")) for d in docs)
    if text_bytes is not None and avail and text_bytes > avail:  # cycle the (finite) corpus
        reps = -(-text_bytes // avail)
        text = np.tile(text, reps)[: int(len(text) * text_bytes / avail)]
    budget = int((seq_len - 1) * arith_frac)
    if n_arith is None:  # enough examples for all text rows, estimated from a sample's length
        sample = make_arithmetic_problems(500, seed + 1, "train")
        mean = np.mean([len(e.ids) + 1 for e in tokenizer.encode_batch(
            [p.question + p.answer_text for p in sample], add_special_tokens=False)])
        n_rows = len(text) // max(1, seq_len - 2 - budget) + 1
        n_arith = int(n_rows * budget / mean * 1.05) + 1
    probs = make_arithmetic_problems(n_arith, seed, "train")
    encs = tokenizer.encode_batch([p.question + p.answer_text for p in probs], add_special_tokens=False)
    lens = np.fromiter((len(e.ids) + 1 for e in encs), dtype=np.int64, count=len(encs))
    arith = np.fromiter((t for e in encs for t in (*e.ids, EOT_ID)), dtype=np.int32, count=int(lens.sum()))
    cum = np.concatenate([[0], np.cumsum(lens)])

    rng = np.random.default_rng(seed)
    rows, i, tpos = [], 0, 0
    while i < len(lens):
        j = int(np.searchsorted(cum, cum[i] + budget, side="right")) - 1
        j = max(j, i + 1) if lens[i] < seq_len - 2 else j  # guard: an example longer than budget
        if j <= i:
            i += 1
            continue
        ex = arith[cum[i]: cum[j]]
        text_first = bool(rng.integers(2))
        n_text = seq_len - 1 - len(ex) - int(text_first)
        if n_text < 0 or tpos + n_text > len(text):
            break
        t = text[tpos: tpos + n_text]
        tpos += n_text
        i = j
        parts = ([t, [EOT_ID], ex] if text_first else [ex, t])
        rows.append(np.concatenate([[EOT_ID], *parts]).astype(np.int64))
    if not rows:
        return torch.zeros((0, seq_len), dtype=torch.long)
    return torch.from_numpy(np.stack(rows))


def build_heldout_tensors(tokenizer, seq_len: int, max_bytes: int | None = None,
                          max_rows: int | None = None) -> torch.LongTensor:
    """Held-out stdlib text as rows [N, seq_len] of [EOT] + contiguous text, for held-out text loss.

    Files in this split never enter training (split by path hash, see load_text_documents).
    Arithmetic is evaluated by generation instead: make_arithmetic_problems(n, seed, "heldout").
    """
    text = _text_stream(tokenizer, load_text_documents(max_bytes, "heldout"))
    n = len(text) // (seq_len - 1)
    if max_rows is not None:
        n = min(n, max_rows)
    body = text[: n * (seq_len - 1)].reshape(n, seq_len - 1).astype(np.int64)
    return torch.from_numpy(np.concatenate([np.zeros((n, 1), np.int64), body], axis=1))
