"""A random-weight stand-in checkpoint at a real model's shape, for pipeline runs where the real
weights are absent:

    python -m rltlab.model.standin path/to/Ouro-1.4B/config.json runs/ouro-1.4b-standin

writes config.json (the given one, marked `"rltlab_standin": {"random_weights": true, ...}`),
seeded random weights in safetensors (sharded above 2 GB), a tokenizer and a README that says
what it is. Its speed, memory and trace-size figures are those of the real shape; its quality
figures mean nothing.

The tokenizer: `--tokenizer DIR` copies a real one (tokenizer.json and tokenizer_config.json);
by default the embedded model's byte-level BPE (artifacts/ouro-tiny), its vocabulary padded to
the config's vocab_size with byte-level filler tokens, so every id the random model emits
decodes to text.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rltlab.common.atomic import write_json_atomic
from rltlab.common.device import add_device_argument
from rltlab.common.paths import embedded_model_dir
from rltlab.model.checkpoint import save_pretrained
from rltlab.model.config import OuroConfig
from rltlab.model.presets import random_model

MARKER = "rltlab_standin"
SHARD_BYTES = 2 * 10 ** 9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def padded_tokenizer(source: dict, vocab_size: int) -> dict:
    """A byte-level BPE tokenizer.json (as a dict) whose vocabulary is padded with filler
    tokens to vocab_size ids: the fillers are never produced by encoding (no merge makes them)
    and decode to " x<id>" (ByteLevel's 'Ġ' is a space)."""
    model = source["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"the tokenizer to pad is {model.get('type')!r}, not a BPE")
    vocab = dict(model["vocab"])
    taken = set(vocab.values()) | {t["id"] for t in source.get("added_tokens", [])}
    if max(taken) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(taken)}, past vocab_size "
                         f"{vocab_size}")
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[f"\u0120x{token_id}"] = token_id
    return {**source, "model": {**model, "vocab": vocab}}


def write_standin(config_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                  tokenizer_dir: str | os.PathLike | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                  force: bool = False) -> Path:
    """Write the stand-in checkpoint (module docstring) to out_dir, atomically: it appears
    whole or not at all. An existing non-empty out_dir is refused unless force."""
    config_path, out_dir = Path(config_path), Path(out_dir)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    raw = json.loads(config_path.read_text())   # FileNotFoundError names the file
    config = OuroConfig.from_dict(raw)           # a config rltlab cannot run is refused here
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --force to replace it")
    tok_src = Path(tokenizer_dir) if tokenizer_dir else embedded_model_dir()
    missing = [n for n in TOKENIZER_FILES if not (tok_src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{tok_src} lacks {', '.join(missing)}")
    tokenizer = json.loads((tok_src / "tokenizer.json").read_text())
    if tokenizer_dir is None:
        tokenizer = padded_tokenizer(tokenizer, config.vocab_size)

    model = random_model(config, device, torch.float32, seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.standin-", dir=out_dir.parent))
    try:
        checkpoint = save_pretrained(model, staging / "checkpoint", max_shard_bytes=SHARD_BYTES,
                                     dtype=dtype)
        del model
        written = json.loads((checkpoint / "config.json").read_text())
        written[MARKER] = {"random_weights": True, "seed": seed,
                           "source_config": str(config_path.resolve()),
                           "tokenizer": str(tok_src.resolve()) + (
                               "" if tokenizer_dir else " (vocabulary padded)")}
        write_json_atomic(checkpoint / "config.json", written)
        write_json_atomic(checkpoint / "tokenizer.json", tokenizer)
        shutil.copyfile(tok_src / "tokenizer_config.json", checkpoint / "tokenizer_config.json")
        (checkpoint / "README.md").write_text(
            "# Random-weight stand-in checkpoint\n\n"
            f"Written by `python -m rltlab.model.standin` from `{config_path}` (seed {seed}). "
            "Its weights are random: speed, memory and trace sizes are those of the real shape, "
            "quality figures mean nothing.\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(checkpoint, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def is_standin(model_dir: str | os.PathLike) -> bool:
    """Whether model_dir holds a stand-in written by this module (random weights)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and MARKER in json.loads(path.read_text())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.model.standin",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a config.json (or the directory holding it), e.g. the "
                                   "real Ouro-1.4B one")
    ap.add_argument("out", help="the checkpoint directory to write")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="copy this directory's tokenizer (default: the embedded model's, "
                         "padded to the vocabulary)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    add_device_argument(ap, help="where the random weights are drawn (cuda is faster for "
                                 "large shapes; the files are the same kind either way)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    args = ap.parse_args(argv)
    try:
        out = write_standin(args.config, args.out, tokenizer_dir=args.tokenizer, seed=args.seed,
                            dtype=getattr(torch, args.dtype), device=args.device,
                            force=args.force)
    except (FileExistsError, ValueError) as err:
        ap.error(str(err))
    size = sum(p.stat().st_size for p in out.iterdir())
    result = {"out": str(out), "bytes": size, "random_weights": True}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
