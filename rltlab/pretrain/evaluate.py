"""Held-out per-round evaluation of a looped model (the embedded default model's metrics).

The eval set lives as plain files next to the checkpoint (rltlab.pretrain.prepare), so every
machine scores the same data. Every figure is at FIXED depth r (r = 1..R):

  * text loss: nats/token (and nats/byte) of next-token prediction over the held-out stdlib text,
    and over Python written for this project (eval/unseen_code.txt, outside every training
    source), chunked into rows of [EOT] + (seq_len - 1) tokens; round-r logits of
    forward(all_logits=True) (every position at round r, attending over round-r K/V).
  * word problems: teacher-forced nats/token over answer_text + EOT given [EOT] + question, and
    exact match of greedy `generate_plain(depth=r, eos_token_id=0)` (the "#### N" answer).
  * k-hop binding (depth-graded): exact match of the greedy answer digit, overall and per k. As
    in the engine, the prompt is prefilled at full depth, so the FIRST output token (" ") comes
    from round R and the answer digit from round r.
  * oracle exit depth: the shallowest round whose greedy token equals round R's (teacher forced);
    the share of tokens per oracle round, over every text and code token, and over the answer
    tokens of the mixed held-out problem set (answer_text + EOT of the word problems and k-hop
    problems) except the first: in generation that one comes from the prompt's prefill at full
    depth, and docs/ouro.md leaves it out of every depth statistic. "answers" pools the
    two tasks, "mixed" pools everything.

Each batch of a task's prompts is prefilled once, at full depth: that prefill serves the answer
loss and the generation at every depth r (`_task_scores_and_generations`; the same figures as
scoring and generating separately, about 4x less work).

`python -m rltlab.pretrain.evaluate DIR` loads DIR's saved checkpoint in fp32 on the CPU and
writes DIR/metrics.json; `rltlab rounds` prints the same table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rltlab.common.atomic import write_text_atomic
from rltlab.common.device import add_device_argument
from rltlab.model import gates
from rltlab.model.architecture import LoopedKVCache
from rltlab.model.generate import left_pad, make_exit_fn
from rltlab.pretrain.data import EOT_ID, extract_answer, extract_hop_answer
from rltlab.pretrain.prepare import ARITH_FILE, CODE_FILE, HOPS_FILE, TEXT_FILE


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens, for a `tokenizers.Tokenizer` or a HF fast tokenizer."""
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)  # HF fast -> tokenizers
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Right-padded ids (right padding leaves causal rows intact)."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids


def _new_scores(num_rounds: int) -> dict:
    return {"nll": torch.zeros(num_rounds, dtype=torch.float64), "count": 0,
            "exit_mass": torch.zeros(num_rounds, dtype=torch.float64),
            "oracle": torch.zeros(num_rounds, dtype=torch.long), "oracle_count": 0}


def _accumulate(acc: dict, logits: list[torch.Tensor], gate_logits: torch.Tensor,
                target: torch.Tensor, score: torch.Tensor, oracle_score: torch.Tensor) -> None:
    """Add to `acc` the scores of one batch: logits[r] [B, T, V] and gate_logits [B, T, R] at
    the positions that predict target [B, T]; score / oracle_score [B, T] select the targets."""
    R = len(logits)
    top = []
    for r, round_logits in enumerate(logits):
        ce = F.cross_entropy(round_logits.float().transpose(1, 2), target, reduction="none")
        acc["nll"][r] += ce[score].double().sum().cpu()
        top.append(round_logits.argmax(-1)[oracle_score])
    agree = torch.stack([t == top[-1] for t in top], dim=-1)      # [tokens, R]
    acc["oracle"] += torch.bincount(agree.int().argmax(-1).cpu(), minlength=R)
    acc["exit_mass"] += gates.exit_distribution(gate_logits)[score].double().sum(0).cpu()
    acc["count"] += int(score.sum())
    acc["oracle_count"] += int(oracle_score.sum())


@torch.no_grad()
def _round_scores(model, rows: list[list[int]], scored: list[list[bool]], batch_size: int,
                  oracle_scored: list[list[bool]] | None = None) -> dict:
    """Over the scored target positions: summed next-token NLL per round, token count, summed
    exit distribution p(r); and over the `oracle_scored` positions (default: the scored ones),
    the count of tokens per oracle round (the shallowest round whose argmax equals round R's)."""
    oracle_scored = scored if oracle_scored is None else oracle_scored
    device = next(model.parameters()).device
    acc = _new_scores(model.config.num_rounds)

    def target_mask(masks: list[list[bool]]) -> torch.Tensor:   # row masks -> next-token targets
        return _padded([[int(s) for s in x] for x in masks])[:, 1:].bool().to(device)

    for start in range(0, len(rows), batch_size):
        ids = _padded(rows[start:start + batch_size]).to(device)
        out = model(ids, all_logits=True)
        _accumulate(acc, [logits[:, :-1] for logits in out.logits], out.gate_logits[:, :-1],
                    ids[:, 1:], target_mask(scored[start:start + batch_size]),
                    target_mask(oracle_scored[start:start + batch_size]))
    return acc


def _text_rows(tokenizer, text: str, seq_len: int) -> list[list[int]]:
    """One token stream cut into rows of [EOT] + (seq_len - 1) tokens: every token scored once."""
    stream, body = encode(tokenizer, text), seq_len - 1
    return [[EOT_ID] + stream[i:i + body] for i in range(0, len(stream), body)]


def _answer_rows(tokenizer, problems: list[dict]) -> tuple[list, list, list, list]:
    """(prompts [EOT] + question, rows prompt + answer_text + EOT, scored masks: the answers,
    oracle masks: the answers but their first token, which generation takes from the prefill)."""
    prompts = [[EOT_ID] + encode(tokenizer, p["question"]) for p in problems]
    answers = [encode(tokenizer, p["answer_text"]) + [EOT_ID] for p in problems]
    rows = [q + a for q, a in zip(prompts, answers)]
    scored = [[False] * len(q) + [True] * len(a) for q, a in zip(prompts, answers)]
    generated = [[False] * (len(q) + 1) + [True] * (len(a) - 1) for q, a in zip(prompts, answers)]
    return prompts, rows, scored, generated


@torch.no_grad()
def _task_scores_and_generations(model, prompts: list[list[int]], answers: list[list[int]],
                                 max_new_tokens: int, batch_size: int) -> tuple[dict, list]:
    """One task's teacher-forced answer scores and its greedy generations at every depth, from
    ONE full-depth prefill of each batch of prompts (the old way prefilled R + 1 times).

    answers[i]: the tokens scored after prompts[i] (answer_text + EOT). Returns (the scores of
    `_round_scores` over `_answer_rows`: every answer token scored, the oracle over all but the
    first; tokens[r - 1][i]: `generate_plain(depth=r, eos_token_id=EOT_ID)`'s output for
    prompts[i], up to and including its first EOT).

    The prompts are batched in order of length (batch_size each, little padding). Per batch
    the prompts are prefilled as `generate_plain` prefills them (left-padded, same cache, same
    call), which gives each round's logits for the first answer token; the rest of each
    answer is teacher-forced at full depth through the same cache, right-padded after the
    prompts (causal: the padding never reaches a real position). Then, for each depth r, the
    cache is cut back to the prompts and `generate_plain`'s greedy loop at depth r runs from
    the prefill's first token: each step writes all R planes of its position before any step
    reads them, so the tokens are those of `generate_plain(depth=r)` on the same batch (the
    prefill does not depend on r). On the embedded model every exact-match hit, hops_by_k
    share and oracle share equals the old separate scoring and generation, the losses to
    2e-7 (relative): tests/test_pretrain.py checks the same on a small model."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    R = model.config.num_rounds
    pad_id = next(iter(model.config.eos_token_ids), 0)   # generate_plain's padding
    acc = _new_scores(R)
    tokens: list[list[list[int] | None]] = [[None] * len(prompts) for _ in range(R)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        batch, ans = [prompts[i] for i in index], [answers[i] for i in index]
        bsz = len(batch)
        ids, key_mask, positions = left_pad(batch, pad_id, device)
        width = ids.shape[1]
        next_pos = positions[:, -1] + 1
        cache = LoopedKVCache(model.config, bsz, width + max_new_tokens, dtype, device)
        out = model(ids, positions=positions, key_mask=key_mask, cache=cache)
        # the first answer token: predicted by the last prompt position, at every round
        first = torch.tensor([a[0] for a in ans], device=device)[:, None]
        every = torch.ones(bsz, 1, dtype=torch.bool, device=device)
        _accumulate(acc, [model.lm_head(h[:, -1:]) for h in out.hidden_states],
                    out.gate_logits[:, -1:], first, every, ~every)
        # the rest of each answer, teacher-forced at full depth after its prompt
        rest = max(len(a) - 1 for a in ans)
        if rest > max_new_tokens:
            raise ValueError(f"an answer of {rest + 1} tokens does not fit max_new_tokens "
                             f"{max_new_tokens} + 1")
        if rest > 0:
            inputs = _padded([a[:-1] for a in ans])[:, :rest].to(device)
            target = _padded([a[1:] for a in ans])[:, :rest].to(device)
            real = torch.tensor([[i < len(a) - 1 for i in range(rest)] for a in ans],
                                device=device)
            tf = model(inputs, positions=next_pos[:, None] + torch.arange(rest, device=device),
                       key_mask=real, cache=cache, all_logits=True)
            _accumulate(acc, tf.logits, tf.gate_logits, target, real, real)
        first_token = out.final_logits[:, -1].argmax(-1)
        for r in range(1, R + 1):
            cache.length = width               # back to the prompts: decode from the prefill
            rows = _greedy_decode(model, cache, first_token, next_pos, max_new_tokens,
                                  make_exit_fn(R, depth=r))
            for i, row in zip(index, rows):
                tokens[r - 1][i] = row
    return acc, tokens


def _greedy_decode(model, cache: LoopedKVCache, token: torch.Tensor, next_pos: torch.Tensor,
                   max_new_tokens: int, exit_fn) -> list[list[int]]:
    """generate_plain's greedy loop after its prefill (eos_token_id EOT_ID): the tokens of
    each row up to and including its first EOT."""
    tokens = []
    done = torch.zeros(token.shape[0], dtype=torch.bool, device=token.device)
    for step in range(max_new_tokens):
        tokens.append(token)
        done = done | (token == EOT_ID)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        out = model(token[:, None], positions=(next_pos + step)[:, None], cache=cache,
                    exit_fn=exit_fn)
        token = out.final_logits[:, -1].argmax(-1)
    rows = torch.stack(tokens, 1).tolist()
    return [row[:row.index(EOT_ID) + 1] if EOT_ID in row else row for row in rows]


def evaluate_rounds(model, tokenizer, eval_root: str | Path, *, seq_len: int = 512,
                    batch_size: int = 32, gen_batch_size: int = 64,
                    max_problems: int | None = None, progress: bool = False) -> dict:
    """Per-round held-out metrics at fixed depth (see the module docstring). Returns a dict with
    `settings`, `rounds` (one entry per round r = 1..R), `hops_by_k`, `oracle_depth` and
    `gate_exit_distribution`."""
    t0, root = time.time(), Path(eval_root)
    model.eval()
    R = model.config.num_rounds
    texts = {"text": (root / TEXT_FILE).read_text(encoding="utf-8")}
    if (root / CODE_FILE).is_file():
        texts["code"] = (root / CODE_FILE).read_text(encoding="utf-8")
    tasks = {"arith": _jsonl(root / ARITH_FILE)[:max_problems]}
    if (root / HOPS_FILE).is_file():
        tasks["hops"] = _jsonl(root / HOPS_FILE)[:max_problems]
    scores = {}
    for name, text in texts.items():
        rows = _text_rows(tokenizer, text, seq_len)
        scores[name] = _round_scores(model, rows, [[True] * len(r) for r in rows], batch_size)
    extract = {"arith": extract_answer, "hops": extract_hop_answer}
    hits = {}
    for name, problems in tasks.items():
        prompts, rows, _, _ = _answer_rows(tokenizer, problems)
        answers = [row[len(q):] for q, row in zip(prompts, rows)]
        longest = max(len(a) for a in answers) - 1          # the answer_text's tokens
        scores[name], tokens = _task_scores_and_generations(model, prompts, answers,
                                                            longest + 4, gen_batch_size)
        hits[name] = [[int(extract[name](decode(tokenizer, t)) == p["answer"])
                       for t, p in zip(by_depth, problems)] for by_depth in tokens]
        if progress:
            print(f"  {name}: exact match by round " +
                  ", ".join(f"{sum(h)}/{len(h)}" for h in hits[name]), flush=True)
    rounds = []
    for r in range(R):
        entry = {"round": r + 1}
        for name, s in scores.items():
            entry[f"{name}_loss"] = float(s["nll"][r] / s["count"])
        entry["text_nats_per_byte"] = float(scores["text"]["nll"][r] /
                                            len(texts["text"].encode("utf-8")))
        for name, h in hits.items():
            entry[f"{name}_correct"] = sum(h[r])
            entry[f"{name}_exact_match"] = sum(h[r]) / len(h[r])
        rounds.append(entry)
    metrics = {"rounds": rounds, "eval_seconds": None}
    if "hops" in tasks:
        by_k: dict[int, list[int]] = {}
        for i, p in enumerate(tasks["hops"]):
            by_k.setdefault(int(p["hops"]), []).append(i)
        metrics["hops_by_k"] = {k: {"n": len(idx), "exact_match": [
            sum(hits["hops"][r][i] for i in idx) / len(idx) for r in range(R)]}
            for k, idx in sorted(by_k.items())}
    oracle = {name: (s["oracle"].double() / s["oracle_count"]).tolist()
              for name, s in scores.items()}
    for pool, names in (("answers", list(tasks)), ("mixed", list(scores))):
        pooled = sum(scores[n]["oracle"] for n in names)
        oracle[pool] = (pooled.double() / pooled.sum()).tolist()
    metrics["oracle_depth"] = {"share_by_round": oracle,
                               "tokens": {n: s["oracle_count"] for n, s in scores.items()}}
    metrics["gate_exit_distribution"] = {
        name: (s["exit_mass"] / s["count"]).tolist() for name, s in scores.items()}
    metrics["settings"] = {
        "files": {"text": TEXT_FILE, "code": CODE_FILE if "code" in texts else None,
                  "arith": ARITH_FILE, "hops": HOPS_FILE if "hops" in tasks else None},
        "text_bytes": {n: len(t.encode("utf-8")) for n, t in texts.items()},
        "n_problems": {n: len(p) for n, p in tasks.items()}, "seq_len": seq_len,
        "generation": "generate_plain greedy, depth=r (prefill at full depth: the first output "
                      "token comes from round R), eos_token_id=0, prompt [0]+encode(question)",
        "answer": "word problems: extract_answer (number after the first '#### '); k-hop: the "
                  "first digit of the continuation (extract_hop_answer)",
        "loss": "fixed depth r: round-r logits of forward(all_logits=True), nats/token",
        "oracle": "shallowest round whose argmax equals round R's, teacher forced, over every "
                  "text token and every answer token (answer_text + EOT) of the tasks but the "
                  "first (generation takes it from the prefill at full depth); 'answers' pools "
                  "the tasks (the mixed held-out problem set), 'mixed' pools all of them"}
    metrics["eval_seconds"] = round(time.time() - t0, 2)
    return metrics


def format_table(metrics: dict) -> str:
    """Markdown table: one row per round, then the per-k k-hop table and the oracle shares."""
    rounds = metrics["rounds"]
    cols = [("text_loss", "held-out text loss"), ("code_loss", "unseen code loss"),
            ("arith_loss", "word-problem answer loss")]
    cols = [(k, h) for k, h in cols if k in rounds[0]]
    ems = [(n, h) for n, h in (("arith", "word problems EM"), ("hops", "k-hop EM"))
           if f"{n}_correct" in rounds[0]]
    n = metrics["settings"]["n_problems"]
    lines = ["| round | " + " | ".join(h for _, h in cols + ems) + " |",
             "|---" * (1 + len(cols) + len(ems)) + "|"]
    for m in rounds:
        cells = [f"{m[k]:.4f}" for k, _ in cols]
        cells += [f"{m[f'{e}_correct']}/{n[e]} ({100 * m[f'{e}_exact_match']:.1f}%)"
                  for e, _ in ems]
        lines.append(f"| {m['round']} | " + " | ".join(cells) + " |")
    if "hops_by_k" in metrics:
        lines += ["", "| k (hops) | n | " + " | ".join(f"round {m['round']}" for m in rounds)
                  + " |", "|---" * (2 + len(rounds)) + "|"]
        for k, v in metrics["hops_by_k"].items():
            lines.append(f"| {k} | {v['n']} | " + " | ".join(f"{100 * x:.0f}%"
                                                            for x in v["exact_match"]) + " |")
    share = metrics["oracle_depth"]["share_by_round"]
    lines += ["", "| oracle round share | " + " | ".join(f"round {m['round']}" for m in rounds)
              + " |", "|---" * (1 + len(rounds)) + "|"]
    for name, values in share.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.1f}%" for x in values) + " |")
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
    add_device_argument(parser, default="cpu")
    parser.add_argument("--write", action="store_true", help="write PATH/metrics.json")
    args = parser.parse_args(argv)
    metrics = evaluate_checkpoint(args.path, device=args.device, progress=True)
    print(format_table(metrics))
    print(f"eval took {metrics['eval_seconds']} s")
    if args.write:
        write_text_atomic(Path(args.path) / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from rltlab.common.command import run_command

    raise SystemExit(run_command(main))
