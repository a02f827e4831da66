"""Held-out per-round evaluation of a looped model (the embedded default model's metrics).

The eval set lives as plain files next to the checkpoint, so every machine scores the same data:

    eval/heldout_text.txt         held-out stdlib source (files never trained on), UTF-8
    eval/arithmetic_heldout.jsonl held-out word problems {"question", "answer_text", "answer"}

Every figure is at FIXED depth r (r = 1..R):
  * text loss: nats/token (and nats/byte) of next-token prediction over the whole text file,
    chunked into rows of [EOT] + (seq_len - 1) tokens; round-r logits of forward(all_logits=True)
    (every position at round r, attending over round-r K/V: fixed depth r).
  * arithmetic loss: teacher-forced nats/token over answer_text + EOT given [EOT] + question.
  * arithmetic exact match: greedy `generate_plain(depth=r, eos_token_id=0)` from the prompt
    [EOT] + question, answer by `extract_answer` (gsm8k strict-match). As in the engine, the
    prompt is prefilled at full depth, so the FIRST output token comes from round R and every
    later token from round r.

`python -m rltlab.pretrain.evaluate DIR` loads DIR's saved checkpoint in fp32 on the CPU and writes
DIR/metrics.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

import torch
import torch.nn.functional as F

from rltlab.common.atomic import write_text_atomic
from rltlab.pretrain import data as D
from rltlab.model import gates
from rltlab.pretrain.data import (EOT_ID, extract_answer, load_text_documents,
                         make_arithmetic_problems)
from rltlab.model.generate import generate_plain

TEXT_FILE = "eval/heldout_text.txt"
ARITH_FILE = "eval/arithmetic_heldout.jsonl"
ARITH_SEED = 1234  # the held-out problem set: make_arithmetic_problems(n, ARITH_SEED, "heldout")


def prepare_data(cfg):
    """Tokenizer, train tensor [N, seq_len] and eval files in data_dir; built once, then reused."""
    ddir = Path(cfg.data_dir or Path(cfg.out_dir) / "train_state" / "data")
    ddir.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer
    if not (ddir / "tokenizer.json").is_file():
        D.save_tokenizer(D.train_tokenizer(cfg.vocab_size, cfg.tokenizer_bytes, cfg.seed), ddir)
    tok = Tokenizer.from_file(str(ddir / "tokenizer.json"))
    if not (ddir / ARITH_FILE).is_file():
        write_eval_files(ddir, cfg.eval_text_bytes, cfg.eval_problems)
    path = ddir / "train_tokens.npz"
    if not path.is_file():
        rows = D.build_training_tensors(tok, cfg.text_bytes, None, cfg.seed, cfg.seq_len,
                                        cfg.arith_frac).numpy().astype(np.uint16)
        np.savez_compressed(ddir / "tmp_tokens.npz", tokens=rows)
        os.replace(ddir / "tmp_tokens.npz", path)
    tokens = torch.from_numpy(np.load(path)["tokens"].astype(np.int64))
    if len(tokens) == 0:
        raise ValueError(f"{path} holds no rows: seq_len {cfg.seq_len} is too short for the data")
    if tokens.shape[1] != cfg.seq_len:
        raise ValueError(f"{path} has rows of {tokens.shape[1]} tokens, "
                         f"config seq_len {cfg.seq_len}")
    return tok, tokens, ddir


def save_artifact(model, cfg, ddir: Path, out: Path, steps: int) -> None:
    """config.json + model.safetensors (bf16) + tokenizer + eval files + pretrain_config.json,
    moved file by file into out (train_state/ and other files stay)."""
    from rltlab.model.checkpoint import save_pretrained
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    save_pretrained(model, staging, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", TEXT_FILE, ARITH_FILE):
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ddir / name, staging / name)
    (staging / "pretrain_config.json").write_text(json.dumps(
        {**dataclasses.asdict(cfg), "steps": steps}, indent=2) + "\n")
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        dest = out / path.relative_to(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
    shutil.rmtree(staging, ignore_errors=True)


class BatchOrder:
    """Row indices of step s: a fresh seeded permutation per epoch, so any step is reproducible."""

    def __init__(self, n_rows, batch, seed):
        self.n, self.batch, self.seed, self.perms = n_rows, batch, seed, {}

    def __call__(self, step):
        pos = torch.arange(step * self.batch, (step + 1) * self.batch)
        out = torch.empty_like(pos)
        for epoch in pos.div(self.n, rounding_mode="floor").unique().tolist():
            if epoch not in self.perms:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self.perms = {epoch: torch.randperm(self.n, generator=gen)}
            sel = pos // self.n == epoch
            out[sel] = self.perms[epoch][pos[sel] % self.n]
        return out


def save_state(state_dir: Path, payload: dict, log_path: Path, log: list) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save(payload, state_dir / "state.pt.tmp")
    os.replace(state_dir / "state.pt.tmp", state_dir / "state.pt")  # atomic
    log_path.with_suffix(".tmp").write_text("".join(json.dumps(r) + "\n" for r in log))
    os.replace(log_path.with_suffix(".tmp"), log_path)


def resume_state(state_dir: Path, config: dict, runtime_keys: set, objects: dict, device):
    """(step, steps, log) from state_dir/state.pt, loading `objects` (name -> module/optimizer)
    in place; (0, config["steps"], []) when there is none. Refuses a state of another config."""
    if not (state_dir / "state.pt").is_file():
        return 0, config["steps"], []
    state = torch.load(state_dir / "state.pt", map_location=device, weights_only=False)
    diff = {k for k in config if k not in runtime_keys | {"steps"}
            and config[k] != state["config"].get(k)}
    if diff or (config["steps"] and config["steps"] != state["steps"]):
        raise ValueError(f"{state_dir} was written by another config (differs in "
                         f"{sorted(diff) or ['steps']}); use another out_dir")
    for name, obj in objects.items():
        obj.load_state_dict(state[name])
    print(f"resumed from {state_dir} at step {state['step']}", flush=True)
    return state["step"], state["steps"], state["log"]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens, for a `tokenizers.Tokenizer` or a HF fast tokenizer."""
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)  # HF fast -> tokenizers
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def write_eval_files(out_dir: str | Path, text_bytes: int = 16_000, n_problems: int = 100,
                     seed: int = ARITH_SEED) -> Path:
    """Write the held-out eval files into out_dir/eval/ (whole held-out files, in the split's
    stable order, up to text_bytes; the problems are disjoint from training by construction)."""
    out_dir = Path(out_dir)
    (out_dir / "eval").mkdir(parents=True, exist_ok=True)
    docs, total = [], 0
    held = load_text_documents(None, "heldout")
    for doc in held:  # whole files, in the split's stable order, while they fit
        if total + len(doc.encode("utf-8")) <= text_bytes:
            docs.append(doc)
            total += len(doc.encode("utf-8"))
    if not docs:  # every file is larger than text_bytes: a prefix of the first
        docs = [held[0].encode("utf-8")[:text_bytes].decode("utf-8", "ignore")]
    write_text_atomic(out_dir / TEXT_FILE, "\n\n".join(docs))
    lines = [json.dumps({"question": p.question, "answer_text": p.answer_text, "answer": p.answer})
             for p in make_arithmetic_problems(n_problems, seed, "heldout")]
    write_text_atomic(out_dir / ARITH_FILE, "\n".join(lines) + "\n")
    return out_dir / "eval"


def load_eval_set(eval_root: str | Path) -> tuple[str, list[dict]]:
    root = Path(eval_root)
    text = (root / TEXT_FILE).read_text(encoding="utf-8")
    problems = [json.loads(line) for line in (root / ARITH_FILE).read_text().splitlines() if line]
    return text, problems


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and a mask of real positions (right padding leaves causal rows intact)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = True
    return ids, mask


@torch.no_grad()
def _round_losses(model, rows: list[list[int]], scored: list[list[bool]], batch_size: int):
    """Summed next-token NLL per round over the scored target positions, token count, and the
    summed exit distribution p(r) over those positions."""
    device = next(model.parameters()).device
    num_rounds = model.config.num_rounds
    nll = torch.zeros(num_rounds, dtype=torch.float64)
    exit_mass = torch.zeros(num_rounds, dtype=torch.float64)
    count = 0
    for start in range(0, len(rows), batch_size):
        ids, _ = _padded(rows[start:start + batch_size])
        score, _ = _padded([[int(s) for s in x] for x in scored[start:start + batch_size]])
        ids, score = ids.to(device), score[:, 1:].bool().to(device)
        out = model(ids, all_logits=True)
        target = ids[:, 1:]
        for r, logits in enumerate(out.logits):
            ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, reduction="none")
            nll[r] += ce[score].double().sum().cpu()
        p = gates.exit_distribution(out.gate_logits[:, :-1])
        exit_mass += p[score].double().sum(0).cpu()
        count += int(score.sum())
    return nll, count, exit_mass


def evaluate_rounds(model, tokenizer, eval_root: str | Path, *, seq_len: int = 512,
                    batch_size: int = 32, gen_batch_size: int = 200,
                    max_new_tokens: int | None = None, max_problems: int | None = None,
                    progress: bool = False) -> dict:
    """Per-round held-out metrics at fixed depth (see the module docstring). Returns a dict with
    `settings` and `rounds` (one entry per round r = 1..R)."""
    t0 = time.time()
    model.eval()
    num_rounds = model.config.num_rounds
    text, problems = load_eval_set(eval_root)
    problems = problems[:max_problems] if max_problems else problems
    # Text: one token stream, chunks of seq_len - 1 each behind an EOT; every token scored once.
    stream = encode(tokenizer, text)
    body = seq_len - 1
    rows = [[EOT_ID] + stream[i:i + body] for i in range(0, len(stream), body)]
    text_nll, text_tokens, text_exit = _round_losses(
        model, rows, [[True] * len(r) for r in rows], batch_size)
    text_bytes = len(text.encode("utf-8"))
    # Arithmetic, teacher forced: score answer_text + EOT only.
    prompts = [[EOT_ID] + encode(tokenizer, p["question"]) for p in problems]
    answers = [encode(tokenizer, p["answer_text"]) + [EOT_ID] for p in problems]
    arows = [q + a for q, a in zip(prompts, answers)]
    ascored = [[False] * len(q) + [True] * len(a) for q, a in zip(prompts, answers)]
    arith_nll, arith_tokens, arith_exit = _round_losses(model, arows, ascored, batch_size)
    # Arithmetic, greedy generation at fixed depth.
    if max_new_tokens is None:
        max_new_tokens = max(len(a) for a in answers) + 4
    correct = []
    for r in range(1, num_rounds + 1):
        hits = 0
        for start in range(0, len(prompts), gen_batch_size):
            gen = generate_plain(model, prompts[start:start + gen_batch_size], max_new_tokens,
                                 depth=r, eos_token_id=EOT_ID)
            for ids, p in zip(gen.token_ids, problems[start:start + gen_batch_size]):
                hits += int(extract_answer(decode(tokenizer, ids)) == p["answer"])
        correct.append(hits)
        if progress:
            print(f"  round {r}: exact match {hits}/{len(problems)}", flush=True)
    rounds = [{
        "round": r + 1,
        "text_loss": float(text_nll[r] / text_tokens),
        "text_nats_per_byte": float(text_nll[r] / text_bytes),
        "arith_loss": float(arith_nll[r] / arith_tokens),
        "arith_correct": correct[r],
        "arith_exact_match": correct[r] / len(problems),
    } for r in range(num_rounds)]
    settings = {
        "text_file": TEXT_FILE, "text_bytes": text_bytes, "text_tokens": text_tokens,
        "text_rows": len(rows), "seq_len": seq_len,
        "arith_file": ARITH_FILE, "n_problems": len(problems), "arith_answer_tokens": arith_tokens,
        "max_new_tokens": max_new_tokens, "gen_batch_size": gen_batch_size,
        "generation": "generate_plain greedy, depth=r (prefill at full depth: the first output "
                      "token comes from round R), eos_token_id=0, prompt [0]+encode(question)",
        "answer": "extract_answer (number after the first '#### ') == answer",
        "loss": "fixed depth r: round-r logits of forward(all_logits=True), nats/token",
    }
    gate = {"text_exit_distribution": (text_exit / text_tokens).tolist(),
            "arith_exit_distribution": (arith_exit / arith_tokens).tolist()}
    return {"settings": settings, "rounds": rounds, "gate_exit_distribution": gate,
            "eval_seconds": round(time.time() - t0, 2)}


def format_table(metrics: dict) -> str:
    lines = ["| round | text loss (nats/token) | text nats/byte | arith loss (nats/token) "
             "| arith exact match |", "|---|---|---|---|---|"]
    n = metrics["settings"]["n_problems"]
    for m in metrics["rounds"]:
        lines.append(f"| {m['round']} | {m['text_loss']:.4f} | {m['text_nats_per_byte']:.4f} | "
                     f"{m['arith_loss']:.4f} | {m['arith_correct']}/{n} "
                     f"({100 * m['arith_exact_match']:.1f}%) |")
    return "\n".join(lines)


def evaluate_checkpoint(path: str | Path, device: str = "cpu", **kwargs) -> dict:
    """Load the SAVED checkpoint at `path` in fp32 and evaluate it on its own eval files."""
    from rltlab.model.checkpoint import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(path, dtype=torch.float32, device=device)
    metrics = evaluate_rounds(model, tokenizer, path, **kwargs)
    metrics["computed_with"] = {"device": device, "dtype": "float32", "torch": torch.__version__,
                                "threads": torch.get_num_threads(),
                                "checkpoint": "model.safetensors loaded via "
                                              "rltlab.model.checkpoint.load_model_and_tokenizer"}
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="per-round held-out metrics of a checkpoint")
    parser.add_argument("path", help="checkpoint directory holding eval/ files")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", action="store_true", help="write PATH/metrics.json")
    args = parser.parse_args(argv)
    metrics = evaluate_checkpoint(args.path, device=args.device, progress=True)
    print(format_table(metrics))
    print(f"eval took {metrics['eval_seconds']} s")
    if args.write:
        write_text_atomic(Path(args.path) / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
