"""Data preparation of a pretraining run and the saved artifact.

`prepare_data(cfg)` builds, once, into data_dir: the tokenizer, the packed train tensor
(train_tokens.npz, uint16), the held-out eval files (below) and data_manifest.json, which
records every text source by content digest (rltlab.pretrain.corpus) so runs can be compared.
`save_artifact` assembles the model directory: bf16 weights, tokenizer, eval files, manifests.

Eval files (next to the checkpoint, so every machine scores the same data):

    eval/heldout_text.txt          held-out stdlib source (files never trained on), UTF-8
    eval/unseen_code.txt           Python written for this project, outside every training
                                   source (tests/data/unseen_code/*.py, concatenated)
    eval/arithmetic_heldout.jsonl  held-out word problems {"question", "answer_text", "answer"}
    eval/hops_heldout.jsonl        held-out k-hop problems, the same plus "hops"
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

import numpy as np
import torch

from rltlab.common.atomic import write_json_atomic, write_text_atomic
from rltlab.pretrain import data as D

TEXT_FILE = "eval/heldout_text.txt"
CODE_FILE = "eval/unseen_code.txt"
ARITH_FILE = "eval/arithmetic_heldout.jsonl"
HOPS_FILE = "eval/hops_heldout.jsonl"
MANIFEST_FILE = "data_manifest.json"
ARITH_SEED = 1234  # the held-out problem set: make_arithmetic_problems(n, ARITH_SEED, "heldout")
HOPS_SEED = 4321   # make_hop_problems(n, HOPS_SEED, "heldout")


def unseen_code_files(directory: str | os.PathLike) -> list[Path]:
    """The .py files of `directory`, sorted by name (none where it does not exist)."""
    return sorted(Path(directory).glob("*.py"))


def unseen_code_text(directory: str | os.PathLike) -> str:
    """The .py files of `directory`, sorted by name, joined by blank lines."""
    files = unseen_code_files(directory)
    if not files:
        raise FileNotFoundError(f"no .py files in {directory}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def write_eval_files(out_dir: str | Path, text_bytes: int = 16_000, n_problems: int = 100,
                     n_hops: int = 400, unseen_code_dir: str | None = None,
                     hops: tuple[int, int] = (1, 10)) -> Path:
    """Write the held-out eval files into out_dir/eval/ (whole held-out files, in the split's
    stable order, up to text_bytes; the problems are disjoint from training by construction)."""
    out_dir = Path(out_dir)
    (out_dir / "eval").mkdir(parents=True, exist_ok=True)
    docs, total = [], 0
    held = D.load_text_documents(None, "heldout")
    for doc in held:  # whole files, in the split's stable order, while they fit
        if total + len(doc.encode("utf-8")) <= text_bytes:
            docs.append(doc)
            total += len(doc.encode("utf-8"))
    if not docs:  # every file is larger than text_bytes: a prefix of the first
        docs = [held[0].encode("utf-8")[:text_bytes].decode("utf-8", "ignore")]
    write_text_atomic(out_dir / TEXT_FILE, "\n\n".join(docs))
    if unseen_code_dir:
        write_text_atomic(out_dir / CODE_FILE, unseen_code_text(unseen_code_dir))
    lines = [json.dumps({"question": p.question, "answer_text": p.answer_text, "answer": p.answer})
             for p in D.make_arithmetic_problems(n_problems, ARITH_SEED, "heldout")]
    write_text_atomic(out_dir / ARITH_FILE, "\n".join(lines) + "\n")
    lines = [json.dumps({"question": p.question, "answer_text": p.answer_text, "answer": p.answer,
                         "hops": p.hops})
             for p in D.make_hop_problems(n_hops, HOPS_SEED, "heldout", hops)]
    write_text_atomic(out_dir / HOPS_FILE, "\n".join(lines) + "\n")
    return out_dir / "eval"


def prepare_data(cfg):
    """Tokenizer, train tensor [N, seq_len] and eval files in data_dir; built once, then reused."""
    from tokenizers import Tokenizer

    ddir = Path(cfg.data_dir or Path(cfg.out_dir) / "train_state" / "data")
    ddir.mkdir(parents=True, exist_ok=True)
    path = ddir / "train_tokens.npz"
    packages = ([], {})
    if cfg.package_bytes and not path.is_file():
        packages = D.load_package_documents(cfg.package_bytes)
    if not (ddir / "tokenizer.json").is_file():
        sample, total = [], 0  # the package sample is interleaved across packages already
        for doc in packages[0]:
            if total >= cfg.tokenizer_bytes // 2:
                break
            sample.append(doc)
            total += len(doc)
        D.save_tokenizer(D.train_tokenizer(cfg.vocab_size, cfg.tokenizer_bytes - total,
                                           cfg.seed, sample), ddir)
    tok = Tokenizer.from_file(str(ddir / "tokenizer.json"))
    if not (ddir / HOPS_FILE).is_file():
        write_eval_files(ddir, cfg.eval_text_bytes, cfg.eval_problems, cfg.eval_hops,
                         cfg.unseen_code_dir, (cfg.hops_min, cfg.hops_max))
    if not path.is_file():
        rows = D.build_training_tensors(
            tok, cfg.text_bytes, None, cfg.seed, cfg.seq_len, cfg.arith_frac,
            hop_frac=cfg.hop_frac, package_docs=packages[0], bare_frac=cfg.bare_frac,
            workers=cfg.data_workers).numpy().astype(np.uint16)
        write_json_atomic(ddir / MANIFEST_FILE, {
            "python": platform.python_version(), "stdlib_train": D.stdlib_manifest("train"),
            "packages": packages[1], "rows": list(rows.shape),
            "tokenizer_sha256": _sha256(ddir / "tokenizer.json")})
        np.savez(ddir / "tmp_tokens.npz", tokens=rows)  # uncompressed: GBs compress slowly
        os.replace(ddir / "tmp_tokens.npz", path)
    tokens = torch.from_numpy(np.load(path)["tokens"].astype(np.int64))
    if len(tokens) == 0:
        raise ValueError(f"{path} holds no rows: seq_len {cfg.seq_len} is too short for the data")
    if tokens.shape[1] != cfg.seq_len:
        raise ValueError(f"{path} has rows of {tokens.shape[1]} tokens, "
                         f"config seq_len {cfg.seq_len}")
    return tok, tokens, ddir


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_artifact(model, cfg, ddir: Path, out: Path, steps: int) -> None:
    """config.json + model.safetensors (bf16) + tokenizer + eval files + pretrain_config.json +
    data_manifest.json, moved file by file into out (train_state/ and other files stay)."""
    from rltlab.model.checkpoint import save_pretrained
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    save_pretrained(model, staging, dtype=torch.bfloat16)
    names = ["tokenizer.json", "tokenizer_config.json", TEXT_FILE, ARITH_FILE, HOPS_FILE,
             CODE_FILE, MANIFEST_FILE]
    for name in (n for n in names if (ddir / n).is_file()):
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ddir / name, staging / name)
    (staging / "pretrain_config.json").write_text(json.dumps(
        {**dataclasses.asdict(cfg), "steps": steps}, indent=2) + "\n")
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        dest = out / path.relative_to(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
    shutil.rmtree(staging, ignore_errors=True)
