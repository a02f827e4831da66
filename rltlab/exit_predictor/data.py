"""Teacher-mode training traces for the exit predictor on the embedded task mix.

    python -m rltlab.exit_predictor.data --out DIR [--model-dir DIR] [--arith 256] [--text 48]

Greedy rollouts with the rollout engine in teacher mode (every decode token runs all R rounds,
rltlab.traces): training-split arithmetic prompts ([EOT] + question, up to --max-tokens new
tokens, stop at EOT) and, optionally, training-split text prompts ([EOT] + 48 tokens of
stdlib text, --text-tokens new tokens). Prompt ids: arithmetic 0.., text 1_000_000.. (the
predictor's splits are by prompt id). Hidden states are stored in fp32, unprojected.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import torch

TEXT_ID_BASE = 1_000_000


def text_prompts(tokenizer, n: int, prompt_tokens: int = 48, split: str = "train",
                 seed: int = 0) -> list[list[int]]:
    from rltlab.pretrain.data import EOT_ID, load_text_corpus
    from rltlab.eval.problems import encode

    ids = encode(tokenizer, load_text_corpus(max_bytes=max(50_000, n * prompt_tokens * 12),
                                             split=split))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max(1, len(ids) - prompt_tokens), (n,), generator=gen).tolist()
    return [[EOT_ID] + ids[s:s + prompt_tokens] for s in starts]


def collect_training_traces(model, tokenizer, out_dir: str | Path, *, arith: int = 256,
                            text: int = 48, max_tokens: int = 48, text_tokens: int = 32,
                            seed: int = 0, batch_size: int = 64) -> dict[str, Any]:
    from rltlab.pretrain.data import EOT_ID
    from rltlab.engine import LLM, SamplingParams
    from rltlab.traces import TraceCollector
    from rltlab.eval.problems import rollout_prompts

    llm = LLM(model, tokenizer, max_num_seqs=batch_size)
    collector = TraceCollector(llm, out_dir, teacher=True, hidden_dtype="float32",
                               info={"source": "rltlab.exit_predictor.data", "seed": seed})
    try:
        if arith:
            prompts, _ = rollout_prompts(tokenizer, arith, seed)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed,
                                    min_loops=1, exit_threshold=0.5,
                                    stop_token_ids=[EOT_ID])
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
    args = ap.parse_args(argv)
    from rltlab.model.checkpoint import load_model

    model, tokenizer, _ = load_model(args.model_dir, threads=args.threads)
    manifest = collect_training_traces(model, tokenizer, args.out, arith=args.arith,
                                       text=args.text, max_tokens=args.max_tokens,
                                       text_tokens=args.text_tokens, seed=args.seed)
    print(f"{manifest['num_tokens']} traced tokens in {len(manifest['shards'])} shard(s) -> "
          f"{args.out}")
    return manifest


if __name__ == "__main__":
    main()
