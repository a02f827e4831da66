"""Rollout vs training-recompute log-prob gap, fp32 and bf16 engines (docs/engine.md).

    python -m rltlab.bench.gap [--model DIR | --preset small] [--requests 16] [--max-tokens 32]

For each engine dtype, sampled rollouts (T=1, random trace-replay exit patterns) are recomputed
teacher-forced (LAST_EXITED, model.forward(ids, exit_rounds=...)) by an fp32 model and by a
bf16 model; reported: max / mean / p99 |logprob difference| per token and the mean |sum of
differences| per sequence (the log importance ratio an RL trainer would see). Last line: JSON.
"""
from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

from rltlab.model.presets import PRESETS, random_prompts
from rltlab.bench.models import build_model
from rltlab.common.device import add_device_argument
from rltlab.engine import LLM, SamplingParams


def recompute(model, prompt, out) -> torch.Tensor:
    ids = torch.tensor([prompt + out.token_ids[:-1]], device=model.lm_head.weight.device)
    rounds = model.config.num_rounds
    exits = torch.tensor([[rounds] * len(prompt) + out.exit_depths[1:]], device=ids.device)
    with torch.no_grad():
        logits = model(ids, exit_rounds=exits).final_logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:]
    return logp.gather(-1, torch.tensor(out.token_ids, device=ids.device)[:, None])[:, 0].cpu()


def gap_stats(diffs: list[torch.Tensor]) -> dict:
    flat = torch.cat(diffs).abs().double()
    return {"max": float(flat.max()), "mean": float(flat.mean()),
            "p99": float(flat.quantile(0.99)),
            "seq_mean_abs_sum": float(torch.stack([d.double().sum().abs()
                                                   for d in diffs]).mean())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.gap", description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    add_device_argument(ap)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    args.dtype = "float32"
    fp32 = build_model(args)
    bf16 = build_model(argparse.Namespace(**{**vars(args), "dtype": "bfloat16"}))
    rounds = fp32.config.num_rounds
    prompts = random_prompts(args.requests, args.prompt_len, fp32.config.vocab_size, seed=0)
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, logprobs=0,
                             ignore_eos=True, exit_policy="trace", exit_policy_args={
                                 "depths": [rounds] + torch.randint(
                                     1, rounds + 1, (args.max_tokens,), generator=gen).tolist()})
              for i in range(args.requests)]
    report = {"model": args.model or f"random:{args.preset}", "device": args.device,
              "tokens_per_run": args.requests * args.max_tokens, "gaps": {}}
    for engine_dtype in ("float32", "bfloat16"):
        outs = LLM(fp32, dtype=engine_dtype).generate(prompts, params, use_tqdm=True)
        for name, trainer in (("fp32", fp32), ("bf16", bf16)):
            diffs = [recompute(trainer, p, o) - torch.tensor(o.logprobs)
                     for p, o in tqdm(list(zip(prompts, outs)), unit="request",
                                      desc=f"{name} recompute of the {engine_dtype} rollouts")]
            key = f"engine_{engine_dtype}_vs_recompute_{name}"
            report["gaps"][key] = gap_stats(diffs)
            g = report["gaps"][key]
            print(f"{key:<44} max {g['max']:.3e}  mean {g['mean']:.3e}  p99 {g['p99']:.3e}  "
                  f"|seq sum| {g['seq_mean_abs_sum']:.3e}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
