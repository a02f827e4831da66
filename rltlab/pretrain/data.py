"""Offline data for the embedded default model: the tokenizer and the packed training tensor.

Text (rltlab.pretrain.corpus: the stdlib and installed packages' Python source) and task examples
(rltlab.pretrain.tasks: word problems with a chain of thought, k-hop variable binding) are
tokenized once and packed into rows [N, seq_len]; a per-step Python loader was the first
probe's bottleneck (docs/ouro.md).

Sequence convention: token 0 is "<|endoftext|>", the bos, eos and document separator. The
shipped tokenizer adds it in front of every encoded text by itself (a post-processor, as Hugging
Face tokenizers with `add_bos_token` do), so `tokenizer.encode(text)` == [0] + ids; the packing
code here encodes without special tokens and places the 0s itself. Most rows start with 0 and
then a window of the text stream that starts anywhere in a document; a share of rows
(`bare_frac`) is a text window with no leading 0 at all, so the model does not depend on it.
Every task example ends with 0, so an eval prompt is [0] + encode(question) and generation stops
at token 0.
"""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from rltlab.pretrain.corpus import (TEXT_HELDOUT_PERCENT, load_package_documents,  # noqa: F401
                                    load_text_corpus, load_text_documents, stdlib_manifest,
                                    stdlib_source_files)
from rltlab.pretrain.tasks import (ARITH_HELDOUT_PERCENT, ArithmeticProblem,  # noqa: F401
                                   HopProblem, _in_split, answer_of, extract_answer,
                                   extract_hop_answer,
                                   make_arithmetic_problems, make_hop_problems)

EOT = "<|endoftext|>"
EOT_ID = 0


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(vocab_size: int = 1024, max_bytes: int | None = 8_000_000, seed: int = 0,
                    extra_docs: list[str] = ()):
    """Byte-level BPE (a tokenizers.Tokenizer) on train stdlib text (+ `extra_docs`, e.g. a
    sample of package source) + train word problems and k-hop problems. Digits are split
    individually, else BPE merges frequent numbers ("12", "100") into opaque tokens and
    arithmetic must be memorised per token. Byte-level pieces make decode(encode(s)) == s for
    any unicode string. "<|endoftext|>" is the first special token, hence id 0, and the
    post-processor puts it in front of every encoded text (add_special_tokens=False leaves it
    out)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = load_text_documents(max_bytes, "train") + list(extra_docs)
    n_tasks = max(100, sum(map(len, docs)) // 2 // 110)  # ~110 chars per problem
    tasks = [p.question + p.answer_text for p in make_arithmetic_problems(n_tasks, seed, "train")]
    tasks += [p.question + p.answer_text for p in make_hop_problems(n_tasks // 2, seed, "train")]
    tok.train_from_iterator(docs + tasks, trainer=trainer)
    assert tok.token_to_id(EOT) == EOT_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, EOT_ID)])
    return tok


def save_tokenizer(tok, directory: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json; AutoTokenizer.from_pretrained(dir) loads it
    (and, like the tokenizers.Tokenizer, puts the bos token 0 in front of encoded text)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "unk_token": EOT, "pad_token": EOT, "model_max_length": 2048,
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False}
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


def _encode_arithmetic(tokenizer, probs) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths) of question + answer_text + EOT per problem (word problems or k-hop
    problems). Digits are isolated by the pre-tokenizer, so digit edges are always token
    boundaries: splitting there leaves only a few thousand distinct word segments to encode
    (exact without replicating any regex)."""
    big = EOT.join(p.question + p.answer_text for p in probs) + EOT
    ids = _encode_segments(tokenizer, re.findall(r"[0-9]|[^0-9]+", big))
    return ids, np.diff(np.flatnonzero(ids == EOT_ID), prepend=-1)  # EOT only as separator


def encode_documents(tokenizer, docs: list[str], workers: int = 1) -> np.ndarray:
    """_encode_docs over `workers` processes (contiguous chunks, same stream); a multi-hundred-MB
    corpus takes minutes on one core."""
    if workers <= 1 or len(docs) < 4 * workers:
        return _encode_docs(tokenizer, docs)
    size = -(-len(docs) // workers)
    chunks = [(tokenizer.to_str(), docs[i:i + size]) for i in range(0, len(docs), size)]
    with ProcessPoolExecutor(workers) as pool:
        return np.concatenate(list(pool.map(_encode_chunk, chunks)))


def _encode_chunk(args) -> np.ndarray:
    from tokenizers import Tokenizer
    tokenizer_json, docs = args
    return _encode_docs(Tokenizer.from_str(tokenizer_json), docs)


_TASK_SHARDS = 16  # problems are generated in this many seeded shards (fixed: any worker count
#                    gives the same data)


def _task_shard(args) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths) of one shard of `n` problems of `kind`, each question + answer + EOT."""
    from tokenizers import Tokenizer
    tokenizer_json, kind, n, seed = args
    make = make_arithmetic_problems if kind == "arith" else make_hop_problems
    ids = _encode_docs(Tokenizer.from_str(tokenizer_json),
                       [p.question + p.answer_text for p in make(n, seed, "train")])
    return ids, np.diff(np.flatnonzero(ids == EOT_ID), prepend=-1)


def _task_examples(tokenizer, tokens: float, arith_frac: float, hop_frac: float, seed: int,
                   n_arith: int | None, workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(stream, lengths) of about `tokens` task tokens, word problems and k-hop problems in the
    ratio arith_frac : hop_frac, in a seeded random order. A given n_arith fixes the number of
    word problems instead (and takes no k-hop problems). Problems of a kind are distinct within
    each of the _TASK_SHARDS seeded shards (repeats across shards are rare and harmless)."""
    want = {"arith": n_arith} if n_arith is not None else {}
    if n_arith is None:
        for kind, frac, make in (("arith", arith_frac, make_arithmetic_problems),
                                 ("hops", hop_frac, make_hop_problems)):
            if frac > 0:
                sample = _encode_docs(tokenizer, [p.question + p.answer_text
                                                  for p in make(500, seed + 1, "train")])
                want[kind] = int(tokens * frac / (arith_frac + hop_frac) * 500 / len(sample)) + 1
    jobs = [(tokenizer.to_str(), kind, n // _TASK_SHARDS + (shard < n % _TASK_SHARDS),
             seed * _TASK_SHARDS + shard)
            for kind, n in want.items() for shard in range(_TASK_SHARDS)]
    jobs = [job for job in jobs if job[2] > 0]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            shards = list(pool.map(_task_shard, jobs))
    else:
        shards = [_task_shard(job) for job in jobs]
    parts = [ids[start:end] for ids, lens in shards
             for start, end in zip(np.cumsum(lens) - lens, np.cumsum(lens))]
    random.Random(seed).shuffle(parts)
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(parts), np.array([len(x) for x in parts], np.int64)


def build_training_tensors(tokenizer, text_bytes: int | None, n_arith: int | None, seed: int,
                           seq_len: int, arith_frac: float = 0.5, *, hop_frac: float = 0.0,
                           package_docs: list[str] = (), bare_frac: float = 0.0,
                           workers: int = 1) -> torch.LongTensor:
    """Packed rows [N, seq_len]: ~(arith_frac + hop_frac) of each row is whole task examples
    (question + answer_text + EOT; word problems and k-hop problems in that ratio), the rest a
    contiguous slice of the text stream (stdlib docs, then `package_docs`, each + EOT).
    Row = [EOT] examples text, or [EOT] text [EOT] examples (coin flip per row, so neither kind
    is tied to early positions); examples never straddle rows. A share bare_frac of rows is a
    text window alone, with no leading EOT. If text_bytes exceeds the stdlib train corpus its
    stream is repeated; n_arith=None generates enough problems for all the text. Rows stop when
    either source runs out."""
    if not (0 < arith_frac + hop_frac < 1 and min(arith_frac, hop_frac) >= 0
            and 0 <= bare_frac < 1):
        raise ValueError(f"need 0 < arith_frac + hop_frac < 1 and 0 <= bare_frac < 1, got "
                         f"{arith_frac}, {hop_frac}, {bare_frac}")
    docs = load_text_documents(text_bytes, "train")
    text = encode_documents(tokenizer, docs, workers)
    avail = sum(len(d.encode("utf-8")) for d in docs)
    if text_bytes is not None and avail and text_bytes > avail:  # cycle the (finite) corpus
        text = np.tile(text, -(-text_bytes // avail))[: int(len(text) * text_bytes / avail)]
    if package_docs:
        text = np.concatenate([text, encode_documents(tokenizer, list(package_docs), workers)])
    target = (seq_len - 1) * (arith_frac + hop_frac)  # task tokens per row, on average
    cap = min(seq_len - 2, int(2 * target))  # at most this many in any one row
    wanted = len(text) / (seq_len - 1 - target) * target * 1.05 / (1 - bare_frac)
    tasks, lens = _task_examples(tokenizer, wanted, arith_frac, hop_frac, seed, n_arith,
                                 workers)
    cum = np.concatenate([[0], np.cumsum(lens)])
    rng, rows, i, tpos, n_task_rows = random.Random(seed), [], 0, 0, 0
    while i < len(lens):
        if bare_frac and rng.random() < bare_frac:  # a bare text window
            if tpos + seq_len > len(text):
                break
            rows.append(text[tpos: tpos + seq_len])
            tpos += seq_len
            continue
        if lens[i] > cap:  # an example too long for any row: skip it
            i += 1
            continue
        # whole examples while the running task total stays <= rows * target: a row that falls
        # short (examples don't divide the budget) is made up by the next ones
        goal = int((n_task_rows + 1) * target)  # an int: a float key would copy cum every call
        j = int(np.searchsorted(cum, goal, side="right")) - 1
        j = max(i, min(j, int(np.searchsorted(cum, int(cum[i]) + cap, side="right")) - 1))
        ex = tasks[cum[i]: cum[j]]
        tf = int(j > i and rng.random() < 0.5)  # text first? then [EOT] separates it
        n_text = seq_len - 1 - len(ex) - tf
        if tpos + n_text > len(text):
            break
        t = text[tpos: tpos + n_text]
        rows.append(np.concatenate([[EOT_ID], t, [EOT_ID], ex] if tf else [[EOT_ID], ex, t]))
        tpos, i, n_task_rows = tpos + n_text, j, n_task_rows + 1
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
