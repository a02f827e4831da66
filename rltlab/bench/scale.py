"""Scale-out acceptance: trace collection and predictor training on 1 vs N processes.

    python -m rltlab.bench.scale --device cuda --num-processes 2 --repeats 3 --total-threads 16
    python -m rltlab.bench.scale --device cpu --num-processes 2 --num-prompts 16 --max-tokens 8

(a) collects teacher-mode traces of the same prompts (greedy, every request decodes exactly
--max-tokens) as one plain process and as N ranks under `accelerate launch`
(rltlab.workbench.scale collect), --repeats times each, interleaved (1, N, 1, N, ...) so that
drift of the host hits both alike; (b) checks in every repeat that the tokens and the merged
manifests (shard names, sizes, sha256; content digest) of both runs equal those of the first
1-process run; (c) reports per run and as median / min / max: collection throughput (output
tokens per second between the barriers around the collection, warm-up excluded), the launch
(from starting the job to the start of the collection: interpreter and launcher start, imports,
model load, engine build, warm-up, barrier; split by phase from rank 0's timestamps) and the
whole job; the N/1 ratios are paired by repeat. (d) unless --skip-train, trains the N+2 exit
predictor (N = 1, exit at 3) on the first 1-process traces with 1 and with N processes.

Threads: with --total-threads T the 1-process run gets T torch threads and each of the N ranks
T // N, so both runs use the same host CPU (the default on CUDA, T = all cores: the engine on
the embedded model is bound by host work, and CUDA numerics do not depend on CPU threads). With
--threads K both runs get K threads per rank (the default on the CPU, K = cores / N: CPU matmul
results may depend on the thread count, and the identity check needs equal numerics). Both runs
use the same --block and engine settings. Last line: JSON; exit status 1 if any repeat differs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rltlab.model.presets import PRESETS
from rltlab.common.device import add_device_argument
from rltlab.workbench.scale import launch

_PHASES = (("startup_s", "entered"), ("load_s", "model_loaded"), ("engine_s", "engine_built"),
           ("warmup_s", "warmed_up"), ("barrier_s", "collect_start"))


def summarize(values: list[float]) -> dict[str, float]:
    """median / min / max of one quantity over the repeats."""
    if not values:
        raise ValueError("summarize needs at least one value")
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def paired_ratios(numerator: list[float], denominator: list[float]) -> dict:
    """numerator[r] / denominator[r] per repeat r (paired: same repeat, adjacent in time) and
    the median / min / max of those ratios (not the ratio of the medians)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"paired_ratios needs two equally long non-empty lists, got "
                         f"{len(numerator)} and {len(denominator)} values")
    if any(d <= 0 for d in denominator):
        raise ValueError(f"paired_ratios: denominators must be > 0, got {denominator}")
    ratios = [round(a / b, 4) for a, b in zip(numerator, denominator)]
    return {"per_repeat": ratios, **summarize(ratios)}


def thread_plan(total_threads: int | None, threads: int | None, n: int, device: str,
                cores: int) -> tuple[str, int, int]:
    """(mode, torch threads of the 1-process run, threads of each of the N ranks)."""
    if total_threads is not None and threads is not None:
        raise ValueError("give --total-threads or --threads, not both")
    if total_threads is None and threads is None:
        if device == "cuda":
            total_threads = cores
        else:
            threads = max(1, cores // n)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        return "per_rank", threads, threads
    if total_threads < n:
        raise ValueError(f"--total-threads {total_threads} must be >= --num-processes {n}")
    return "equal_total", total_threads, total_threads // n


def _collect(args, out: Path, procs: int, threads: int) -> dict:
    """One launched collection: its timings (a JSON row) and, under "_check", the tokens and
    manifest for the identity check."""
    argv = ["collect", "--out", str(out), "--num-prompts", str(args.num_prompts),
            "--max-tokens", str(args.max_tokens), "--block", str(args.block), "--device",
            args.device, "--dtype", args.dtype, "--threads", str(threads), "--ignore-eos",
            "--warmup", "--engine-args", json.dumps({
                "max_num_seqs": args.block, "kv_cache_memory_gib": args.kv_gib,
                "max_num_batched_tokens": max(2048, args.block * 8)})]
    argv += ["--preset", args.preset, "--prompt-len", str(args.prompt_len)] if args.preset \
        else ["--model", args.model] if args.model else []
    job_start = time.time()
    result = launch(argv, procs)
    job_end = time.time()
    stamps = result["timestamps"]
    phases, previous = {}, job_start
    for name, key in _PHASES:
        phases[name] = round(stamps[key] - previous, 3)
        previous = stamps[key]
    return {"processes": procs, "threads_per_rank": result["threads_per_rank"],
            "model": result["model"], **{k: result[k] for k in (
                "seconds", "output_tokens", "traced_tokens", "tokens_per_s")},
            "launch_s": round(stamps["collect_start"] - job_start, 3), "launch_phases": phases,
            "exit_s": round(job_end - stamps["collect_end"], 3),
            "job_s": round(job_end - job_start, 3),
            "_check": ([o["token_ids"] for o in result["outputs"]],
                       json.loads((out / "manifest.json").read_text()))}


def _identity(run: dict, reference: dict) -> dict:
    (tokens, manifest), (ref_tokens, ref_manifest) = run["_check"], reference["_check"]
    return {"tokens_identical": tokens == ref_tokens,
            "prompts_with_other_tokens": sum(a != b for a, b in zip(tokens, ref_tokens))
            + abs(len(tokens) - len(ref_tokens)),
            "manifest_shards_identical": manifest["shards"] == ref_manifest["shards"],
            "content_sha256_identical":
                manifest["content_sha256"] == ref_manifest["content_sha256"]}


def _train(args, traces: Path, out: Path, procs: int) -> dict:
    threads = args.threads_one if procs == 1 else args.threads_many   # as in the collection
    argv = ["--traces", str(traces), "--out", str(out), "--rounds", "1", "--k", "2",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--threads", str(threads), "--target-precision", "0.9"]
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


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: artifacts/ouro-tiny)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="random weights of these shapes instead (e.g. ouro-1.4b)")
    add_device_argument(ap, choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="collections of each process count")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32, help="random prompts of --preset")
    ap.add_argument("--block", type=int, default=None, help="prompts per engine batch, the same "
                    "in both runs (default: num_prompts / (2 N), <= 256)")
    ap.add_argument("--total-threads", type=int, default=None, help="1 process: T torch "
                    "threads, each of N ranks T // N (default on cuda: all cores)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank in both "
                    "runs instead (default on cpu: cores / N)")
    ap.add_argument("--kv-gib", type=float, default=None, help="KV cache per rank (GiB)")
    ap.add_argument("--skip-train", action="store_true", help="skip (d), predictor training")
    ap.add_argument("--epochs", type=int, default=20, help="predictor epochs")
    ap.add_argument("--batch-size", type=int, default=256, help="predictor global batch")
    ap.add_argument("--out", default=None, help="keep the traces/checkpoints here")
    args = ap.parse_args(argv)
    n = args.num_processes
    if n < 2:
        ap.error("--num-processes must be >= 2 (it is compared with 1)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_prompts < 2 * n:
        ap.error(f"--num-prompts must be >= {2 * n} (two blocks per rank)")
    if args.batch_size % n:
        ap.error(f"--batch-size {args.batch_size} must be divisible by {n}")
    if args.model and not Path(args.model).is_dir():   # before the ranks are launched
        ap.error(f"--model: checkpoint directory {args.model} does not exist")
    if args.out and Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        ap.error(f"--out {args.out} is not empty")
    args.thread_mode, args.threads_one, args.threads_many = thread_plan(
        args.total_threads, args.threads, n, args.device, os.cpu_count() or 1)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.block = args.block or max(1, min(256, args.num_prompts // (2 * n)))
    args.kv_gib = args.kv_gib or (16.0 if args.device == "cuda" else 1.0)
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    n, key = args.num_processes, str(args.num_processes)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rltlab-bench-scale-"))
    runs = {"1": [], key: []}
    try:
        for r in range(args.repeats):
            runs["1"].append(_collect(args, root / f"traces-1-r{r}", 1, args.threads_one))
            runs[key].append(_collect(args, root / f"traces-{n}-r{r}", n, args.threads_many))
        train = None if args.skip_train else {
            "1": _train(args, root / "traces-1-r0", root / "predictor-1", 1),
            key: _train(args, root / "traces-1-r0", root / f"predictor-{n}", n)}
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    reference = runs["1"][0]
    identity = [{p: _identity(runs[p][r], reference) for p in runs} for r in range(args.repeats)]
    every = [check for repeat in identity for check in repeat.values()]
    for row in runs["1"] + runs[key]:
        del row["_check"]
    result = {
        "model": reference["model"], "device": args.device, "dtype": args.dtype,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if args.device == "cuda" else [], "num_processes": n, "repeats": args.repeats,
        "prompts": args.num_prompts, "max_tokens": args.max_tokens, "block": args.block,
        "thread_mode": args.thread_mode,
        "threads_per_rank": {"1": args.threads_one, key: args.threads_many},
        "identical_every_repeat": all(all(v for k, v in c.items()
                                          if k != "prompts_with_other_tokens") for c in every),
        **{k: all(c[k] for c in every) for k in (
            "tokens_identical", "manifest_shards_identical", "content_sha256_identical")},
        "identity_per_repeat": identity,
        "runs": runs,
        "summary": {p: {q: summarize([row[q] for row in runs[p]]) for q in (
            "tokens_per_s", "seconds", "launch_s", "job_s")} for p in runs},
        "throughput_ratio": paired_ratios([row["tokens_per_s"] for row in runs[key]],
                                          [row["tokens_per_s"] for row in runs["1"]]),
        "job_ratio": paired_ratios([row["job_s"] for row in runs["1"]],
                                   [row["job_s"] for row in runs[key]]),
        "train": train}
    _print_table(result, key)
    print(json.dumps(result))
    return result


def _print_table(r: dict, key: str) -> None:
    print(f"# {r['model']} on {r['device']} ({r['dtype']}), {r['prompts']} prompts x "
          f"{r['max_tokens']} tokens, block {r['block']}, threads ({r['thread_mode']}): "
          f"1 process {r['threads_per_rank']['1']}, {key} x {r['threads_per_rank'][key]}")
    print(f"{'repeat':<8}{'procs':>6}{'tok/s':>10}{'collect s':>11}{'launch s':>10}"
          f"{'load s':>8}{'job s':>8}{'identical':>11}")
    for i in range(r["repeats"]):
        for p in ("1", key):
            row, ok = r["runs"][p][i], r["identity_per_repeat"][i][p]
            print(f"{i:<8}{p:>6}{row['tokens_per_s']:>10.1f}{row['seconds']:>11.2f}"
                  f"{row['launch_s']:>10.2f}{row['launch_phases']['load_s']:>8.2f}"
                  f"{row['job_s']:>8.2f}{str(ok['tokens_identical']):>11}")
    for name in ("throughput_ratio", "job_ratio"):
        t = r[name]
        print(f"{name} ({key}/1, paired): per repeat {t['per_repeat']}, median {t['median']:.3f}"
              f" [min {t['min']:.3f}, max {t['max']:.3f}]")
    print(f"identical in every repeat (tokens, shards, content): {r['identical_every_repeat']}")
    if r["train"] is None:
        return
    print(f"{'train N+2 predictor':<22}{'1 process':>14}{f'{key} processes':>14}")
    for k in ("loss_last", "temperature", "threshold", "precision", "recall", "auc",
              "fire_rate", "expected_rounds"):
        a, b = r["train"]["1"][k], r["train"][key][k]
        fmt = (lambda v: f"{v:.4f}" if isinstance(v, float) else str(v))
        print(f"{k:<22}{fmt(a):>14}{fmt(b):>14}")


if __name__ == "__main__":
    from rltlab.common.command import run_command

    sys.exit(0 if run_command(main)["identical_every_repeat"] else 1)
