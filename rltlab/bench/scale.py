"""Scale-out acceptance: trace collection and predictor training on 1 vs N processes.

    python -m rltlab.bench.scale --device cuda --num-processes 2          # 2 GPUs
    python -m rltlab.bench.scale --device cpu --num-processes 2 --num-prompts 16 --max-tokens 8

(a) collects teacher-mode traces of the same prompts (greedy, every request decodes exactly
--max-tokens) once as one plain process and once as N ranks under `accelerate launch`
(rltlab.workbench.scale collect), (b) checks that the tokens and the merged manifests (shard names,
sizes, sha256; content digest) are identical, (c) reports collection throughput (output tokens
per second between the barriers around the collection, warm-up excluded) and the N/1 ratio,
(d) trains the N+2 exit predictor (N = 1, exit at 3) on the 1-process traces with 1 and with N
processes and prints the metrics side by side. Both runs get the same --threads per rank (the
CPU default: cores / N), so the comparison holds per-rank resources fixed and CPU numerics
equal. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from rltlab.bench.__main__ import PRESETS
from rltlab.workbench.scale import launch


def _collect(args, out: Path, procs: int) -> dict:
    argv = ["collect", "--out", str(out), "--num-prompts", str(args.num_prompts),
            "--max-tokens", str(args.max_tokens), "--block", str(args.block), "--device",
            args.device, "--dtype", args.dtype, "--threads", str(args.threads), "--ignore-eos",
            "--warmup", "--engine-args", json.dumps({
                "max_num_seqs": args.block, "kv_cache_memory_gib": args.kv_gib,
                "max_num_batched_tokens": max(2048, args.block * 8)})]
    argv += ["--preset", args.preset, "--prompt-len", str(args.prompt_len)] if args.preset \
        else ["--model", args.model] if args.model else []
    start = time.perf_counter()
    result = launch(argv, procs)
    result["launch_s"] = round(time.perf_counter() - start, 2)
    return result


def _train(args, traces: Path, out: Path, procs: int) -> dict:
    argv = ["--traces", str(traces), "--out", str(out), "--rounds", "1", "--k", "2",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--threads", str(args.threads), "--target-precision", "0.9"]
    argv += ["--cpu"] if args.device == "cpu" else []
    start = time.perf_counter()
    launch(argv, procs, module="rltlab.exit_predictor.train", result=False)
    metrics = json.loads((out / "metrics.json").read_text())
    entry = metrics["per_round"][0]
    return {"launch_s": round(time.perf_counter() - start, 2),
            "num_processes": entry["train"]["num_processes"],
            "loss_last": entry["train"]["loss_last"], "temperature": entry["temperature"],
            "threshold": entry["threshold"], **{k: entry["test"][k] for k in (
                "precision", "recall", "auc", "fire_rate", "expected_rounds")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: artifacts/ouro-tiny)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="random weights of these shapes instead (e.g. ouro-1.4b)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompts of --preset")
    ap.add_argument("--block", type=int, default=None,
                    help="prompts per engine batch (default: num_prompts / (2 N), <= 256)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--kv-gib", type=float, default=None, help="KV cache per rank (GiB)")
    ap.add_argument("--epochs", type=int, default=20, help="predictor epochs")
    ap.add_argument("--batch-size", type=int, default=256, help="predictor global batch")
    ap.add_argument("--out", default=None, help="keep the traces/checkpoints here")
    args = ap.parse_args(argv)
    n = args.num_processes
    if n < 2:
        raise ValueError("--num-processes must be >= 2 (it is compared with 1)")
    if args.num_prompts < 2 * n:
        raise ValueError(f"--num-prompts must be >= {2 * n} (two blocks per rank)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.block = args.block or max(1, min(256, args.num_prompts // (2 * n)))
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    args.kv_gib = args.kv_gib or (16.0 if args.device == "cuda" else 1.0)
    if args.batch_size % n:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by {n}")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rltlab-bench-scale-"))
    if args.out and any(root.glob("*")):
        raise ValueError(f"{root} is not empty")
    try:
        one, many = _collect(args, root / "traces-1", 1), _collect(args, root / f"traces-{n}", n)
        t1 = [o["token_ids"] for o in one["outputs"]]
        tn = [o["token_ids"] for o in many["outputs"]]
        m1 = json.loads((root / "traces-1" / "manifest.json").read_text())
        mn = json.loads((root / f"traces-{n}" / "manifest.json").read_text())
        train1 = _train(args, root / "traces-1", root / "predictor-1", 1)
        trainn = _train(args, root / "traces-1", root / f"predictor-{n}", n)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "model": one["model"], "device": args.device, "dtype": args.dtype,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if args.device == "cuda" else [], "num_processes": n, "prompts": args.num_prompts,
        "max_tokens": args.max_tokens, "block": args.block, "threads_per_rank": args.threads,
        "tokens_identical": t1 == tn,
        "prompts_with_other_tokens": sum(a != b for a, b in zip(t1, tn)),
        "manifest_shards_identical": m1["shards"] == mn["shards"],
        "content_sha256_identical": m1["content_sha256"] == mn["content_sha256"],
        "collect": {"1": {k: one[k] for k in ("seconds", "output_tokens", "traced_tokens",
                                               "tokens_per_s", "launch_s")},
                    str(n): {k: many[k] for k in ("seconds", "output_tokens", "traced_tokens",
                                                   "tokens_per_s", "launch_s")}},
        "throughput_ratio": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
        "train": {"1": train1, str(n): trainn}}
    _print_table(result, n)
    print(json.dumps(result))
    return result


def _print_table(r: dict, n: int) -> None:
    print(f"# {r['model']} on {r['device']} ({r['dtype']}), {r['prompts']} prompts x "
          f"{r['max_tokens']} tokens, block {r['block']}, {r['threads_per_rank']} threads/rank")
    print(f"{'collect':<22}{'1 process':>14}{f'{n} processes':>14}")
    for key in ("seconds", "output_tokens", "traced_tokens", "tokens_per_s"):
        print(f"{key:<22}{r['collect']['1'][key]:>14}{r['collect'][str(n)][key]:>14}")
    print(f"throughput ratio {r['throughput_ratio']:.3f}x; tokens identical: "
          f"{r['tokens_identical']}; merged manifest identical: shards "
          f"{r['manifest_shards_identical']}, content {r['content_sha256_identical']}")
    print(f"{'train N+2 predictor':<22}{'1 process':>14}{f'{n} processes':>14}")
    for key in ("loss_last", "temperature", "threshold", "precision", "recall", "auc",
                "fire_rate", "expected_rounds"):
        a, b = r["train"]["1"][key], r["train"][str(n)][key]
        fmt = (lambda v: f"{v:.4f}" if isinstance(v, float) else str(v))
        print(f"{key:<22}{fmt(a):>14}{fmt(b):>14}")


if __name__ == "__main__":
    main()
