"""Teacher-mode training traces for the exit predictor on the embedded task mix.

    python -m rltlab.exit_predictor.data --out DIR [--model-dir DIR] [--arith 256] [--text 48]

Greedy rollouts with the rollout engine in teacher mode (every decode token runs all R rounds,
rltlab.traces): training-split problem prompts (the mixed set of rltlab.eval.problems.
rollout_prompts: [EOT] + question, up to --max-tokens new tokens, stop at EOT) and, optionally,
training-split text prompts ([EOT] + 48 tokens of stdlib text, --text-tokens new tokens).
Prompt ids: problems 0.., text 1_000_000.. (the predictor's splits are by prompt id). Hidden
states are stored in fp32, unprojected.

The traces hold decode tokens only (output index >= 1). Beside them, PREFILL_FILE holds each
prompt's prefill state: the round-R state h_R of its last position (model.norm applied), the
top-1 prob / margin / entropy of lm_head(h_R) and the greedy first output token. That is the
"previous position" of output index 1, which round-0 (N = 0) predictors need (features.
trace_round0_features); `--prefill-only` adds the file to an existing trace directory.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import torch

from rltlab.common.atomic import write_bytes_atomic

TEXT_ID_BASE = 1_000_000
PREFILL_FILE = "prefill_states.safetensors"


def text_prompts(tokenizer, n: int, prompt_tokens: int = 48, split: str = "train",
                 seed: int = 0) -> list[list[int]]:
    from rltlab.pretrain.data import EOT_ID, load_text_corpus
    from rltlab.eval.problems import encode

    ids = encode(tokenizer, load_text_corpus(max_bytes=max(50_000, n * prompt_tokens * 12),
                                             split=split))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max(1, len(ids) - prompt_tokens), (n,), generator=gen).tolist()
    return [[EOT_ID] + ids[s:s + prompt_tokens] for s in starts]


def training_prompts(tokenizer, *, arith: int, text: int, seed: int
                     ) -> tuple[list[list[int]], list[int]]:
    """The traced prompts and their prompt ids (problems 0.., text TEXT_ID_BASE..)."""
    from rltlab.eval.problems import rollout_prompts

    prompts = rollout_prompts(tokenizer, arith, seed)[0] if arith else []
    ids = list(range(len(prompts)))
    if text:
        prompts += text_prompts(tokenizer, text, seed=seed)
        ids += [TEXT_ID_BASE + i for i in range(text)]
    return prompts, ids


@torch.no_grad()
def write_prefill_states(model, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int],
                         out_dir: str | Path, batch_size: int = 32) -> Path:
    """OUT/PREFILL_FILE: per prompt id the full-depth prefill's last-position state h_R
    [P, H] fp32, its prob stats [P, 3] (features.prob_stats of lm_head(h_R)) and the greedy
    first output token [P] (what output index 1 takes as input)."""
    from safetensors.torch import save

    from rltlab.exit_predictor.features import prob_stats
    from rltlab.model.generate import left_pad

    device = next(model.parameters()).device
    hidden, stats, first = [], [], []
    for s in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[s:s + batch_size]]
        ids, key_mask, positions = left_pad(batch, 0, device)
        out = model(ids, positions=positions, key_mask=key_mask)
        h = out.final_hidden[:, -1].float()          # left padding: last = prompt end
        logits = h @ model.lm_head.weight.detach().float().T   # fp32, on the model's device
        hidden.append(h.cpu())
        stats.append(prob_stats(logits).cpu())
        first.append(logits.argmax(-1).cpu())
    path = Path(out_dir) / PREFILL_FILE
    write_bytes_atomic(path, save({
        "prompt_id": torch.tensor(list(prompt_ids), dtype=torch.int64),
        "hidden": torch.cat(hidden).contiguous(), "stats": torch.cat(stats).contiguous(),
        "first_token": torch.cat(first).to(torch.int64)}))
    return path


def read_prefill_states(trace_dir: str | Path) -> dict[str, torch.Tensor] | None:
    """The PREFILL_FILE tensors of a trace directory, or None when it has none."""
    from safetensors.torch import load_file

    path = Path(trace_dir) / PREFILL_FILE
    if not path.is_file():
        return None
    states = load_file(str(path))
    missing = {"prompt_id", "hidden", "stats", "first_token"} - set(states)
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    return states


def collect_training_traces(model, tokenizer, out_dir: str | Path, *, arith: int = 256,
                            text: int = 48, max_tokens: int = 48, text_tokens: int = 32,
                            seed: int = 0, batch_size: int = 64,
                            hidden_dtype: str = "float32") -> dict[str, Any]:
    """Teacher-mode traces of `arith` training-split problems and `text` text prompts, through
    an engine on the model's device sized for this batch (rltlab.eval.engines), hidden states
    stored in `hidden_dtype`; the expected size is printed and checked against the free disk
    space first (rltlab.traces.size: NotEnoughDiskSpace with the figures). The engine's memory
    is released before the prefill states are computed."""
    from rltlab.engine import SamplingParams
    from rltlab.eval.engines import release_memory, sized_llm
    from rltlab.traces import TraceCollector
    from rltlab.traces.size import check_disk, describe, trace_bytes
    from rltlab.eval.problems import rollout_prompts

    plan = check_disk(out_dir, trace_bytes(
        arith * max(1, max_tokens - 1) + text * max(1, text_tokens - 1),
        num_rounds=model.config.num_rounds, hidden_dim=model.config.hidden_size,
        hidden_dtype=hidden_dtype))
    print(f"traces: expected up to {describe(plan)}; {plan['free_bytes'] / 2 ** 30:.2f} GiB "
          f"free", flush=True)
    longest = max(len(p) for p in training_prompts(tokenizer, arith=arith, text=text,
                                                   seed=seed)[0])
    llm = sized_llm(model, tokenizer, max_num_seqs=batch_size,
                    max_len=longest + max(max_tokens, text_tokens))
    collector = TraceCollector(llm, out_dir, teacher=True, hidden_dtype=hidden_dtype,
                               info={"source": "rltlab.exit_predictor.data", "seed": seed})
    try:
        if arith:
            prompts, _ = rollout_prompts(tokenizer, arith, seed)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed,
                                    min_loops=1, exit_threshold=0.5)
            for s in range(0, len(prompts), batch_size):
                collector.generate(prompts[s:s + batch_size], params,
                                   list(range(s, min(s + batch_size, len(prompts)))))
        if text:
            prompts = text_prompts(tokenizer, text, seed=seed)
            params = SamplingParams(temperature=0.0, max_tokens=text_tokens, seed=seed,
                                    min_loops=1, exit_threshold=0.5, ignore_eos=True)
            for s in range(0, len(prompts), batch_size):
                collector.generate(prompts[s:s + batch_size], params,
                                   [TEXT_ID_BASE + i for i in range(s, min(s + batch_size,
                                                                           len(prompts)))])
    finally:
        manifest = collector.close()
    del collector, llm
    release_memory()
    write_prefill_states(model, *training_prompts(tokenizer, arith=arith, text=text, seed=seed),
                         out_dir, batch_size=batch_size)
    return manifest


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default=None, help="default: the embedded model")
    ap.add_argument("--arith", type=int, default=256)
    ap.add_argument("--text", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--text-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden-dtype", default="float32",
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prefill-only", action="store_true",
                    help=f"only (re)write OUT/{PREFILL_FILE} for traces collected before with "
                    "the same --arith/--text/--seed")
    args = ap.parse_args(argv)
    from rltlab.model.checkpoint import load_model

    model, tokenizer, _ = load_model(args.model_dir, threads=args.threads)
    if args.prefill_only:
        path = write_prefill_states(model, *training_prompts(
            tokenizer, arith=args.arith, text=args.text, seed=args.seed), args.out)
        print(f"wrote {path}")
        return {"prefill_states": str(path)}
    manifest = collect_training_traces(model, tokenizer, args.out, arith=args.arith,
                                       text=args.text, max_tokens=args.max_tokens,
                                       text_tokens=args.text_tokens, seed=args.seed,
                                       hidden_dtype=args.hidden_dtype)
    print(f"{manifest['num_tokens']} traced tokens in {len(manifest['shards'])} shard(s) -> "
          f"{args.out}")
    return manifest


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
