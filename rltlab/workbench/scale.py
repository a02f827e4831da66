"""Data-parallel entry points: trace collection, evaluation and draft-head training on N ranks,
one code path.

    python -m rltlab.workbench.scale collect --out DIR [--num-prompts 512 --max-tokens 64 ...]
    accelerate launch --multi_gpu --num_processes 2 -m rltlab.workbench.scale collect --out DIR ...
    python -m rltlab.workbench.scale evaluate --num-problems 200 --thresholds 0.5,0.9 --depths 4
    accelerate launch --multi_gpu --num_processes 2 -m rltlab.exit_predictor.train ...
    accelerate launch --multi_gpu --num_processes 2 -m rltlab.workbench.scale train-draft
        --out DIR ...

Every rank loads the model onto its own device (cuda:LOCAL_RANK, or the CPU with a gloo
group), works on its blocks of prompts (rltlab.common.distributed) and the results are gathered;
rank 0 writes the merged trace manifest and the --result JSON. `launch()` runs a command as N
ranks from Python; notebooks reach it through `rltlab run NOTEBOOK --num-processes N`, which
sets RLTLAB_NUM_PROCESSES for the kernel: the workbench's collection and evaluation calls then
hand their work to `launch()` (delegate_collect / delegate_evaluate) instead of the
in-process engine. See docs/scale_out.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from rltlab.common import distributed as dist
from rltlab.common.device import add_device_argument
from rltlab.common.paths import REPO_ROOT

NUM_PROCESSES_ENV = "RLTLAB_NUM_PROCESSES"
# EngineConfig fields that travel to the workers (device and dtype are set per rank)
_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "block_size",
                  "num_blocks", "kv_cache_memory_gib", "max_model_len", "logprobs_mode",
                  "exit_policy", "exit_policy_args", "default_min_loops")


def num_processes() -> int:
    """Ranks the workbench should use: $RLTLAB_NUM_PROCESSES (set by `rltlab run
    --num-processes N`), default 1 (in-process)."""
    value = os.environ.get(NUM_PROCESSES_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${NUM_PROCESSES_ENV} must be a positive integer, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- worker side

def _load(args, state):
    """(model on this rank's device, tokenizer or None) from --model or --preset."""
    from rltlab.common.paths import embedded_model_dir
    from rltlab.model.checkpoint import from_pretrained
    from rltlab.model.presets import preset_config, random_model

    dtype = getattr(torch, args.dtype)
    if args.preset:
        return random_model(preset_config(args.preset), state.device, dtype), None
    path = Path(args.model or embedded_model_dir())
    model = from_pretrained(path, dtype=dtype, device=state.device)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return model, tokenizer


def _prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    if args.prompts_file:
        return json.loads(Path(args.prompts_file).read_text())
    if tokenizer is not None:
        from rltlab.eval.problems import rollout_prompts
        return rollout_prompts(tokenizer, args.num_prompts, seed=args.seed)[0]
    from rltlab.model.presets import random_prompts
    return random_prompts(args.num_prompts, args.prompt_len, vocab, seed=args.seed)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def _write_result(args, state, result: dict[str, Any]) -> None:
    if state.is_main_process and args.result:
        from rltlab.common.atomic import write_json_atomic
        write_json_atomic(args.result, result)


def run_collect(args) -> dict[str, Any]:
    from rltlab.engine import LLM
    from rltlab.traces.sharded import collect_sharded
    from rltlab.engine.sampling import q_exit_params

    # epoch timestamps (rank 0's), so a caller can split its launch into start-up, model load,
    # engine build and warm-up, apart from the timed collection
    stamps = {"entered": time.time()}
    state = dist.get_state(args.device)
    threads = dist.configure_threads(args.threads, args.device)
    model, tokenizer = _load(args, state)
    stamps["model_loaded"] = time.time()
    prompts = _prompts(args, tokenizer, model.config.vocab_size)
    engine_args = {"max_num_seqs": args.block, **json.loads(args.engine_args)}
    llm = LLM(model, tokenizer, **engine_args)
    stamps["engine_built"] = time.time()
    params = q_exit_params(args.threshold, args.max_tokens, min_loops=args.min_loops,
                           seed=args.seed, temperature=args.temperature,
                           eos_token_id=None if args.ignore_eos else 0)
    params = dataclasses.replace(params, ignore_eos=args.ignore_eos)
    if args.warmup:   # CUDA context, Triton compilation, allocator: outside the timed region
        llm.generate([p[:8] for p in prompts[:2]], dataclasses.replace(params, max_tokens=4))
    stamps["warmed_up"] = time.time()
    state.wait_for_everyone()
    stamps["collect_start"] = time.time()
    start = time.perf_counter()
    outputs, manifest = collect_sharded(
        llm, prompts, params, args.out, block=args.block, state=state, progress=args.progress,
        teacher=not args.no_teacher, hidden_dtype=args.hidden_dtype,
        projection_dim=args.projection_dim, shard_tokens=args.shard_tokens)
    seconds = time.perf_counter() - start
    stamps["collect_end"] = time.time()
    tokens = [o.outputs[0].token_ids for o in outputs]
    out_tokens = sum(len(t) for t in tokens)
    result = {"command": "collect", "num_processes": state.num_processes,
              "device": str(state.device), "threads_per_rank": threads,
              "model": f"random:{args.preset}" if args.preset else str(args.model or "embedded"),
              "prompts": len(prompts), "block": args.block, "seconds": round(seconds, 4),
              "output_tokens": out_tokens, "traced_tokens": manifest["num_tokens"],
              "tokens_per_s": round(out_tokens / seconds, 2), "trace_dir": str(args.out),
              "content_sha256": manifest["content_sha256"], "tokens_sha256": _digest(tokens),
              "timestamps": stamps,
              "outputs": [{"token_ids": o.outputs[0].token_ids,
                           "exit_depths": o.outputs[0].exit_depths,
                           "executed_depths": o.outputs[0].executed_depths} for o in outputs]}
    _write_result(args, state, result)
    return result


def run_evaluate(args) -> dict[str, Any]:
    from rltlab.engine import LLM
    from rltlab.common.paths import embedded_model_dir
    from rltlab.eval.problems import eval_problems
    from rltlab.eval.policies import evaluate_policies
    from rltlab.eval.tasks import as_gen_output

    state = dist.get_state(args.device)
    dist.configure_threads(args.threads, args.device)
    model, tokenizer = _load(args, state)
    if tokenizer is None:
        raise ValueError("evaluate needs a model directory with tokenizer.json (arithmetic "
                         "problems are text)")
    problems = (json.loads(Path(args.problems_file).read_text()) if args.problems_file
                else eval_problems(args.model or embedded_model_dir(), args.num_problems))
    llm = LLM(model, tokenizer, **{"max_num_seqs": args.block, **json.loads(args.engine_args)})
    floats = [float(t) for t in args.thresholds.split(",") if t]
    depths = [int(d) for d in args.depths.split(",") if d]
    rows, scores = evaluate_policies(
        llm, tokenizer, problems, thresholds=floats, depths=depths, max_tokens=args.max_tokens,
        min_loops=args.min_loops, label=args.label or None,
        wrap_generate=lambda fn: dist.sharded_generate_fn(fn, state, args.block, as_gen_output),
        progress=args.progress and state.is_main_process)
    result = {"command": "evaluate", "num_processes": state.num_processes,
              "device": str(state.device), "rows": rows, "scores": scores}
    _write_result(args, state, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    from rltlab.model.presets import PRESETS

    ap = argparse.ArgumentParser(prog="python -m rltlab.workbench.scale", description=__doc__.split(
        "\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    helps = {"collect": "teacher-mode traces of the prompts, sharded by block over the ranks",
             "evaluate": "exact match vs mean rounds for fixed depths and Q-exit thresholds"}
    for name in ("collect", "evaluate"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--model", default=None, help="checkpoint dir (default: embedded model)")
        p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="random-weight model of these shapes instead of --model")
        add_device_argument(p, choices=["cuda", "cpu"],
                            help="cuda: each rank uses cuda:LOCAL_RANK")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads per rank (CPU default: cores / local ranks)")
        p.add_argument("--engine-args", default="{}", help="EngineConfig fields as JSON")
        p.add_argument("--block", type=int, default=64,
                       help="prompts per engine batch and sharding unit (rank = block %% N)")
        p.add_argument("--max-tokens", type=int, default=48)
        p.add_argument("--min-loops", type=int, default=1)
        p.add_argument("--result", default=None, help="rank 0 writes the result JSON here")
        p.add_argument("--progress", action="store_true", help="tqdm bar on rank 0")
    col = sub.choices["collect"]
    col.add_argument("--out", required=True, help="new trace directory")
    col.add_argument("--num-prompts", type=int, default=64)
    col.add_argument("--prompts-file", default=None, help="JSON list of token-id prompts")
    col.add_argument("--prompt-len", type=int, default=32, help="random prompts (no tokenizer)")
    col.add_argument("--threshold", type=float, default=0.5)
    col.add_argument("--temperature", type=float, default=0.0)
    col.add_argument("--seed", type=int, default=0)
    col.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-tokens")
    col.add_argument("--no-teacher", action="store_true")
    col.add_argument("--hidden-dtype", default="float32")
    col.add_argument("--projection-dim", type=int, default=None)
    col.add_argument("--shard-tokens", type=int, default=4096)
    col.add_argument("--warmup", action="store_true", help="untimed warm-up generation")
    ev = sub.choices["evaluate"]
    ev.add_argument("--num-problems", type=int, default=100)
    ev.add_argument("--problems-file", default=None, help="JSON list of problems")
    ev.add_argument("--thresholds", default="0.5,0.9")
    ev.add_argument("--depths", default="4")
    ev.add_argument("--label", default="")
    from rltlab.draft_heads.run import add_train_args
    add_train_args(sub.add_parser(
        "train-draft", help="distil a draft component (DDP over the ranks; rank 0 writes)"))
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.command == "train-draft":
        from rltlab.draft_heads.run import run_train
        return run_train(args)      # prints its own summary on rank 0
    result = (run_collect if args.command == "collect" else run_evaluate)(args)
    if dist.get_state(args.device).is_main_process:
        print(json.dumps({k: v for k, v in result.items() if k not in ("outputs", "scores")}))
    return result


# ----------------------------------------------------------------------------- caller side

def launch(module_args: Sequence[str], num_procs: int, *, module: str = "rltlab.workbench.scale",
           result: bool = True, timeout: float | None = None) -> dict[str, Any] | None:
    """Run `python -m module ARGS [--result R]` as num_procs ranks (accelerate launch when
    > 1) with this checkout first on PYTHONPATH; returns rank 0's result JSON (result=True)."""
    with tempfile.TemporaryDirectory(prefix="rltlab-scale-") as tmp:
        path = Path(tmp) / "result.json"
        extra = ["--result", str(path)] if result else []
        argv = dist.launch_argv(module, [*module_args, *extra], num_procs)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               NUM_PROCESSES_ENV: "1"}   # the ranks do their share in-process, never relaunch
        subprocess.run(argv, check=True, cwd=REPO_ROOT, env=env, timeout=timeout)
        return json.loads(path.read_text()) if result else None


def _block(llm, num_items: int) -> list[str]:
    """Blocks small enough that every rank gets work, no larger than the engine's batch."""
    per_rank = -(-num_items // num_processes())
    return ["--block", str(max(1, min(llm.llm_engine.config.max_num_seqs, per_rank)))]


def _engine_args(llm) -> list[str]:
    """The in-process engine's settings for the ranks; refuses an engine whose weights were
    updated in memory (the ranks would load other weights from model_dir)."""
    engine = llm.llm_engine
    if engine.get_weight_version() != 0:
        raise ValueError(f"the engine runs weight version {engine.get_weight_version()}, not the "
                         "checkpoint's: several processes cannot reproduce in-memory updates")
    cfg = {f: getattr(engine.config, f) for f in _ENGINE_FIELDS}
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    return ["--engine-args", json.dumps(cfg), "--dtype", dtype,
            "--device", engine.runner.device.type, "--threads", str(torch.get_num_threads())]


def delegate_collect(llm, prompts, out_dir, *, model_dir, threshold: float, max_tokens: int,
                     teacher: bool, temperature: float, seed: int, min_loops: int,
                     hidden_dtype: str = "float32", projection_dim: int | None = None,
                     shard_tokens: int = 4096) -> tuple[list, dict[str, Any]]:
    """workbench.collect_rollout_traces on num_processes() ranks: (GenOutputs, manifest)."""
    from rltlab.eval.tasks import GenOutput
    from rltlab.traces import read_manifest

    if model_dir is None:
        raise ValueError("collection on several processes needs model_dir: every rank loads the "
                         "weights from it")
    with tempfile.TemporaryDirectory(prefix="rltlab-prompts-") as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps([list(map(int, p)) for p in prompts]))
        args = ["collect", "--model", str(model_dir), "--prompts-file", str(path), "--out",
                str(out_dir), "--threshold", str(threshold), "--max-tokens", str(max_tokens),
                "--temperature", str(temperature), "--seed", str(seed), "--min-loops",
                str(min_loops), "--hidden-dtype", hidden_dtype, "--shard-tokens",
                str(shard_tokens), *_engine_args(llm), *_block(llm, len(prompts)),
                *([] if teacher else ["--no-teacher"]),
                *(["--projection-dim", str(projection_dim)] if projection_dim else [])]
        result = launch(args, num_processes())
    return [GenOutput(**o) for o in result["outputs"]], read_manifest(out_dir)


def delegate_evaluate(llm, problems, *, model_dir, thresholds, depths, max_tokens: int,
                      min_loops: int, label: str | None) -> tuple[list, dict]:
    """workbench.evaluate_policies on num_processes() ranks: (rows, scores)."""
    if model_dir is None:
        raise ValueError("evaluation on several processes needs model_dir: every rank loads the "
                         "weights from it")
    with tempfile.TemporaryDirectory(prefix="rltlab-problems-") as tmp:
        path = Path(tmp) / "problems.json"
        path.write_text(json.dumps(list(problems)))
        result = launch(["evaluate", "--model", str(model_dir), "--problems-file", str(path),
                         "--thresholds", ",".join(map(str, thresholds)), "--depths",
                         ",".join(map(str, depths)), "--max-tokens", str(max_tokens),
                         "--min-loops", str(min_loops), "--label", label or "",
                         *_engine_args(llm), *_block(llm, len(problems))], num_processes())
    return result["rows"], result["scores"]


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
    dist.shutdown()   # every rank tears its process group down before exit
