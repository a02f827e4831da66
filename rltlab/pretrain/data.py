"""Offline data for the small embedded default model: stdlib source text + arithmetic word problems.

Why this mix (REFERENCE.md section 6): code text is "easy" per token and saturates after one or two
loop rounds, while multi-step arithmetic keeps improving with depth; a model trained on both has the
per-token difficulty spread that exit prediction and loop-aware drafting need. All of it is offline:
the text is the running interpreter's own stdlib, the arithmetic is generated, the tokenizer local.

Sequence convention of every tensor built here: token 0 is "<|endoftext|>", both bos and eos. Rows
start with 0 and every document / problem ends with 0, so an arithmetic prompt at eval time is
[0] + encode(problem.question), and generation stops at token 0.
"""
from __future__ import annotations

import json
import os
import random
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
EOT_ID = 0
TEXT_HELDOUT_PERCENT = 3   # share of stdlib files held out for text loss
ARITH_HELDOUT_PERCENT = 5  # share of the question space reserved for arithmetic eval
_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}  # not walked


def _in_split(key: str, percent: int, split: str) -> bool:
    """Stable hash split (Python's hash() is salted per process, so it can't define one)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return (zlib.crc32(key.encode("utf-8")) % 100 < percent) == (split == "heldout")


# ----------------------------------------------------------------------------- text corpus
def stdlib_source_files() -> list[Path]:
    """Sorted .py files of the running interpreter's stdlib, minus tests (huge, repetitive), IDLE,
    installed packages and `_sysconfigdata*` (machine-specific: the corpus would differ by host)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP and not d.startswith("config-")]
        files += [Path(dirpath, f) for f in filenames
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text_documents(max_bytes: int | None = None, split: str = "train") -> list[str]:
    """One string per stdlib file of `split` (~3% of files, by path hash, are "heldout"), up to
    max_bytes (UTF-8) in all. Files are ordered by a hash of their path, not alphabetically, so a
    max_bytes prefix samples the whole stdlib rather than only the modules 'a'..'m'."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root).as_posix() for p in stdlib_source_files()]
    rels = [r for r in rels if _in_split("text:" + r, TEXT_HELDOUT_PERCENT, split)]
    rels.sort(key=lambda r: (zlib.crc32(r.encode()), r))
    docs, total = [], 0
    for rel in rels:  # errors="replace": a stray non-UTF-8 byte must not break the corpus
        raw = (root / rel).read_text(encoding="utf-8", errors="replace").encode("utf-8")
        if max_bytes is not None and total + len(raw) > max_bytes:
            if max_bytes > total:  # cut the last file at a character boundary
                docs.append(raw[: max_bytes - total].decode("utf-8", errors="ignore"))
            break
        docs.append(raw.decode("utf-8"))
        total += len(raw)
    return docs


def load_text_corpus(max_bytes: int | None = None, split: str = "train") -> str:
    """The documents of `load_text_documents` joined by blank lines."""
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


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(vocab_size: int = 1024, max_bytes: int | None = 8_000_000, seed: int = 0):
    """Byte-level BPE (a tokenizers.Tokenizer) on train stdlib text + train arithmetic (~2:1 bytes).
    Digits are split individually, else BPE merges frequent numbers ("12", "100") into opaque tokens
    and arithmetic must be memorised per token. Byte-level pieces make decode(encode(s)) == s for
    any unicode string. "<|endoftext|>" is the first special token, hence id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = load_text_documents(max_bytes, "train")
    n_arith = max(100, sum(map(len, docs)) // 2 // 110)  # ~110 chars per problem
    arith = [p.question + p.answer_text for p in make_arithmetic_problems(n_arith, seed, "train")]
    tok.train_from_iterator(docs + arith, trainer=trainer)
    assert tok.token_to_id(EOT) == EOT_ID
    return tok


def save_tokenizer(tok, directory: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json; AutoTokenizer.from_pretrained(dir) loads it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "unk_token": EOT, "pad_token": EOT, "model_max_length": 2048,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


# ----------------------------------------------------------------------------- tensors
# The pre-tokenizer above (digits isolated, then GPT-2's ByteLevel regex) as ONE regex. BPE never
# merges across pre-token boundaries, so splitting text into pre-tokens here and encoding each
# *distinct* piece once gives exactly tokenizer.encode's ids, several times faster than
# encode_batch on the multi-MB corpus (checked on a sample of docs at run time, with a fallback).
_PRETOK = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)"""
           r"|\s+")


def _encode_segments(tokenizer, segments: list[str]) -> np.ndarray:
    """Concatenated ids of segments whose edges are pre-token boundaries: each distinct segment
    goes through the real tokenizer once, then the ids are gathered with numpy."""
    index = {g: k for k, g in enumerate(dict.fromkeys(segments))}  # dedupe, first-seen order
    idx = np.fromiter(map(index.__getitem__, segments), np.int64, len(segments))
    uniq = [e.ids for e in tokenizer.encode_batch(list(index), add_special_tokens=False)]
    ulen = np.array([len(u) for u in uniq] or [0], np.int64)
    uflat = np.fromiter((t for u in uniq for t in u), np.int32, int(ulen.sum()))
    n = ulen[idx]  # tokens per occurrence; flat position p -> start[seg(p)] + offset within seg
    shift = np.repeat(np.cumsum(ulen)[idx] - n - (np.cumsum(n) - n), n)
    return uflat[shift + np.arange(int(n.sum()))]


def _encode_docs(tokenizer, docs: list[str]) -> np.ndarray:
    """All docs tokenized, each followed by EOT, as one int32 stream."""
    try:  # `regex` is a transformers dependency; stdlib re lacks \p{L} / \p{N}
        import regex
        pat = regex.compile(_PRETOK)
    except ImportError:
        pat = None
    probe = [d for d in docs if EOT not in d][:8]
    if pat is None or not all(np.array_equal(_encode_segments(tokenizer, pat.findall(d)),
                                             tokenizer.encode(d, add_special_tokens=False).ids)
                              for d in probe):  # exact, slower path (e.g. other pre-tokenizer)
        encs = tokenizer.encode_batch(docs, add_special_tokens=False)
        return np.array([t for e in encs for t in (*e.ids, EOT_ID)], np.int32)
    segs: list[str] = []
    for part in (EOT.join(docs) + EOT).split(EOT)[:-1]:  # as the tokenizer, split specials first
        segs += pat.findall(part) + [EOT]
    return _encode_segments(tokenizer, segs)


def _encode_arithmetic(tokenizer, probs: list[ArithmeticProblem]) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths) of question + answer_text + EOT per problem. Digits are isolated by the
    pre-tokenizer, so digit edges are always token boundaries: splitting there leaves only a few
    thousand distinct word segments to encode (exact without replicating any regex)."""
    big = EOT.join(p.question + p.answer_text for p in probs) + EOT
    ids = _encode_segments(tokenizer, re.findall(r"[0-9]|[^0-9]+", big))
    return ids, np.diff(np.flatnonzero(ids == EOT_ID), prepend=-1)  # EOT only as separator


def build_training_tensors(tokenizer, text_bytes: int | None, n_arith: int | None, seed: int,
                           seq_len: int, arith_frac: float = 0.5) -> torch.LongTensor:
    """Packed rows [N, seq_len]: ~arith_frac of each row is whole arithmetic examples (question +
    answer_text + EOT), the rest a contiguous slice of the stdlib text stream (docs + EOT).
    Built once, up front, by batched tokenization and numpy packing (a per-step Python loader was
    the probe's bottleneck). Row = [EOT] examples text, or [EOT] text [EOT] examples (coin flip per
    row, so neither kind is tied to early positions); examples never straddle rows. If text_bytes
    exceeds the train corpus the text stream is repeated; n_arith=None generates enough problems
    for all the text. Rows stop when either source runs out."""
    docs = load_text_documents(text_bytes, "train")
    text = _encode_docs(tokenizer, docs)
    avail = sum(len(d.encode("utf-8")) for d in docs)
    if text_bytes is not None and avail and text_bytes > avail:  # cycle the (finite) corpus
        text = np.tile(text, -(-text_bytes // avail))[: int(len(text) * text_bytes / avail)]
    target = (seq_len - 1) * arith_frac  # arithmetic tokens per row, on average
    cap = min(seq_len - 2, int(2 * target))  # at most this many in any one row
    if n_arith is None:  # enough for all the text, from a sample's mean length
        _, lens = _encode_arithmetic(tokenizer, make_arithmetic_problems(500, seed + 1, "train"))
        n_arith = int(len(text) / (seq_len - 1 - target) * target / lens.mean() * 1.05) + 1
    arith, lens = _encode_arithmetic(tokenizer, make_arithmetic_problems(n_arith, seed, "train"))
    cum = np.concatenate([[0], np.cumsum(lens)])
    rng, rows, i, tpos = random.Random(seed), [], 0, 0
    while i < len(lens):
        if lens[i] > cap:  # an example too long for any row: skip it
            i += 1
            continue
        # whole examples while the running arithmetic total stays <= rows * target: a row that
        # falls short (examples don't divide the budget) is made up by the next ones
        goal = int((len(rows) + 1) * target)  # an int: a float key would copy cum every call
        j = int(np.searchsorted(cum, goal, side="right")) - 1
        j = max(i, min(j, int(np.searchsorted(cum, int(cum[i]) + cap, side="right")) - 1))
        ex = arith[cum[i]: cum[j]]
        tf = int(j > i and rng.random() < 0.5)  # text first? then [EOT] separates it
        n_text = seq_len - 1 - len(ex) - tf
        if tpos + n_text > len(text):
            break
        t = text[tpos: tpos + n_text]
        rows.append(np.concatenate([[EOT_ID], t, [EOT_ID], ex] if tf else [[EOT_ID], ex, t]))
        tpos, i = tpos + n_text, j
    return torch.from_numpy(np.stack(rows).astype(np.int64) if rows
                            else np.zeros((0, seq_len), np.int64))


def build_heldout_tensors(tokenizer, seq_len: int, max_bytes: int | None = None):
    """Held-out stdlib text as rows [N, seq_len] (LongTensor) of [EOT] + contiguous text, for
    held-out text loss. (Arithmetic is evaluated by generation on make_arithmetic_problems(...,
    "heldout") instead.)"""
    text = _encode_docs(tokenizer, load_text_documents(max_bytes, "heldout"))
    n = len(text) // (seq_len - 1)
    body = torch.from_numpy(text[: n * (seq_len - 1)].reshape(n, seq_len - 1).astype(np.int64))
    return torch.cat([torch.full((n, 1), EOT_ID), body], dim=1)
