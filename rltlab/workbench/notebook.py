"""Library side of the workbench notebooks. Notebooks stay thin: each cell calls one or two
functions of `rltlab.workbench` (this module plus the stage functions it re-exports).

Conventions: the embedded arithmetic task (rltlab.pretrain.data) with prompts [EOT] +
encode(question), or GSM8K (TASKS "gsm8k", rltlab.eval.problems); greedy decoding; the model
and the rollout engine (rltlab.engine.LLM) on the notebook's DEVICE in its DTYPE ("auto": CUDA
in bfloat16 where there is a GPU, else the CPU in float32: load_model), every engine sized for
its workload so that several share a GPU (make_llm, rltlab.eval.engines). Depth figures exclude
the first output token (docs/ouro.md).

Collection and evaluation hand their work to N ranks when `rltlab run --num-processes N` set
$RLTLAB_NUM_PROCESSES (rltlab.workbench.scale); otherwise they run in-process.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from rltlab.common.atomic import _jsonable, default_permissions, read_json, write_json_atomic
from rltlab.common.environment import environment
from rltlab.eval import policies
from rltlab.traces import rollout
from rltlab.workbench import scale
from rltlab.workbench.runs import new_run_dir

# the device and dtype of the model the notebook loaded (save_metrics records them)
_LOADED: dict[str, Any] = {}


def ensure_run_dir(run_dir: str | os.PathLike | None, name: str) -> Path:
    """RUN_DIR as a Path; None (an interactive session, not `rltlab run`) creates a new one."""
    path = Path(run_dir) if run_dir else new_run_dir(name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_model(model_dir: str | os.PathLike | None = None, *, device: str = "auto",
               dtype: str = "auto", threads: int | None = None, hf_tokenizer: bool = False):
    """(model, tokenizer, model_dir): rltlab.model.checkpoint.load_model on `device` in `dtype`
    ("auto": CUDA where there is one, else the CPU; bfloat16 on a GPU, float32 on the CPU). A
    device this machine lacks is a ValueError in one line; a model that does not fit the GPU is
    refused before loading, with the figures. threads: torch CPU threads, set only when the
    model runs on the CPU. A CUDA device becomes the current one, so training steps (accelerate,
    anything that says "cuda") run on the model's GPU."""
    import torch

    from rltlab.common.device import resolve_device
    from rltlab.model import checkpoint

    dev = resolve_device(device)
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    model, tokenizer, path = checkpoint.load_model(
        model_dir, dtype=dtype, device=dev, threads=threads if dev.type == "cpu" else None,
        hf_tokenizer=hf_tokenizer)
    param = next(model.parameters())
    _LOADED.update(device=str(param.device), dtype=str(param.dtype).removeprefix("torch."),
                   model_dir=str(path), peak_bytes=0)
    return model, tokenizer, path


def make_llm(model, tokenizer=None, *, max_num_seqs: int | None = None,
             max_len: int | None = None, **engine_kwargs):
    """An rltlab.engine.LLM over an already loaded model, where the model is (EngineConfig /
    ExecutionConfig keyword arguments; on CUDA the engine's fast path). With max_len (prompt +
    output tokens of the longest sequence) the KV pool holds max_num_seqs such sequences and no
    more (rltlab.eval.engines.sized_llm), so other engines and training steps share the GPU;
    without it the engine sizes its pool itself (on CUDA: most of the free memory)."""
    from rltlab.engine import LLM
    from rltlab.eval.engines import sized_llm

    if max_len is not None:
        return sized_llm(model, tokenizer, max_num_seqs=max_num_seqs or 64, max_len=max_len,
                         **engine_kwargs)
    if max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = max_num_seqs
    return LLM(model, tokenizer, **engine_kwargs)


def engine_batch(llm) -> int:
    """The engine's batch: the sequences it runs at once (EngineConfig.max_num_seqs)."""
    return int(llm.llm_engine.config.max_num_seqs)


def device_of(model_or_llm) -> str:
    """Where a model (or an engine's model) runs: "cpu", "cuda:0", ..."""
    model = getattr(getattr(model_or_llm, "llm_engine", None), "model", model_or_llm)
    return str(next(model.parameters()).device)


class Measured:
    """Wall time and peak device memory of a block, for the notebooks' cost figures:

        with W.Measured(device) as cost:
            train(...)
        cost.summary()   # {"seconds", "peak_mem_gib" (None off CUDA), "peak_extra_gib", ...}

    peak_mem_gib: torch.cuda.max_memory_allocated during the block (its peak is reset at the
    start), everything the process holds included (model weights, engines' KV pools);
    peak_extra_gib: that peak less what was allocated when the block started (what the block
    itself needed at most)."""

    def __init__(self, device):
        import torch
        self.device = torch.device(device)
        self.seconds = 0.0
        self.peak_bytes = self.start_bytes = None

    def __enter__(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            _keep_peak(self.device)   # the notebook's peak survives this block's reset
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        self.seconds = time.perf_counter() - self._t0
        return False

    def summary(self) -> dict[str, Any]:
        gib = 2 ** 30
        return {"seconds": round(self.seconds, 3), "device": str(self.device),
                "peak_mem_gib": None if self.peak_bytes is None else self.peak_bytes / gib,
                "peak_extra_gib": None if self.peak_bytes is None
                else (self.peak_bytes - self.start_bytes) / gib}


def parameter_count(module_or_params) -> int:
    """Parameters of a module (or an iterable of tensors), counted once each."""
    params = module_or_params.parameters() if hasattr(module_or_params, "parameters") \
        else module_or_params
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def release_memory() -> None:
    """rltlab.eval.engines.release_memory: free what dropped engines held (call after `del`)."""
    from rltlab.eval.engines import release_memory as release
    release()


def evaluate_policies(llm, tokenizer, problems: Sequence[dict], *, thresholds: Sequence[float] = (),
                      depths: Sequence[int] = (), max_tokens: int = 48, min_loops: int = 1,
                      batch_size: int | None = None, label: str | None = None,
                      model_dir: str | os.PathLike | None = None, tasks: str = "embedded",
                      num_fewshot: int = 3, warmup: bool = False):
    """rltlab.eval.policies.evaluate_policies, on N ranks loading `model_dir` when
    scale.num_processes() > 1 (rltlab.workbench.scale.delegate_evaluate; the embedded task set
    only). tasks "gsm8k": the problems are GSM8K records, prompted and scored by lm-eval's
    gsm8k_cot protocol, stopped at its stop strings."""
    if scale.num_processes() > 1:
        if tasks != "embedded":
            raise ValueError(f"TASKS {tasks!r} runs in one process: drop --num-processes")
        return scale.delegate_evaluate(llm, problems, model_dir=model_dir, thresholds=thresholds,
                                       depths=depths, max_tokens=max_tokens,
                                       min_loops=min_loops, label=label)
    return policies.evaluate_policies(llm, tokenizer, problems, thresholds=thresholds,
                                      depths=depths, max_tokens=max_tokens, min_loops=min_loops,
                                      batch_size=batch_size, label=label, tasks=tasks,
                                      num_fewshot=num_fewshot, warmup=warmup)


def collect_rollout_traces(llm, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike, *,
                           threshold: float, max_tokens: int, teacher: bool = True,
                           temperature: float = 0.0, seed: int = 0, min_loops: int = 1,
                           model_dir: str | os.PathLike | None = None,
                           **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """rltlab.traces.rollout.collect_rollout_traces, on N ranks loading `model_dir` when
    scale.num_processes() > 1 (rltlab.workbench.scale.delegate_collect; per-prompt seeds,
    merged manifest; no stop strings there). A request that ended in an error stops the
    collection (rltlab.engine.outputs.raise_on_errors)."""
    kwargs = dict(threshold=threshold, max_tokens=max_tokens, teacher=teacher,
                  temperature=temperature, seed=seed, min_loops=min_loops, **collector_kwargs)
    if not kwargs.get("stop"):
        kwargs.pop("stop", None)
    if scale.num_processes() > 1:
        if kwargs.get("stop"):
            raise ValueError("stop strings (TASKS gsm8k) run in one process: drop "
                             "--num-processes")
        return scale.delegate_collect(llm, prompts, out_dir, model_dir=model_dir, **kwargs)
    from rltlab.engine.outputs import raise_on_errors

    outs, manifest = rollout.collect_rollout_traces(llm, prompts, out_dir, **kwargs)
    return raise_on_errors(outs, "trace collection"), manifest


COLLECTION_FILE = "collection.json"


def collect_traces_once(llm, prompts: Sequence[Sequence[int]], trace_dir: str | os.PathLike,
                        *, model_dir: str | os.PathLike | None = None,
                        **collect_kwargs) -> tuple[dict[str, Any], bool]:
    """The traces of a rollout of `prompts` in trace_dir, collected once: (manifest, reused).

    Before collecting, the expected size (rltlab.traces.size: up to max_tokens - 1 traced
    tokens per prompt) is printed and checked against the free disk space: a collection that
    would fill the disk raises NotEnoughDiskSpace with the figures, before anything is written.
    collection.json records the plan (`expected`) and the bytes written.

    Re-running a notebook into its run directory must not append a second copy of every
    trace. A finished collection (trace_dir/collection.json) made with the same prompts,
    settings (collect_rollout_traces' keyword arguments) and model weights, whose checksums
    verify, is reused as it is. Otherwise the traces are collected into a temporary sibling
    (.NAME.tmp-*) that replaces trace_dir only once complete: until then the old traces stay,
    and a killed collection leaves only the temporary directory (removed by the next call).
    """
    from rltlab.model.checkpoint import model_hash
    from rltlab.traces import TraceCorruptError, read_manifest, verify_traces

    trace_dir = Path(trace_dir)
    key = {"prompts_sha256": hashlib.sha256(json.dumps(
               [list(map(int, p)) for p in prompts]).encode()).hexdigest(),
           "settings": json.loads(json.dumps(_jsonable(collect_kwargs))),
           "model_hash": model_hash(getattr(llm, "llm_engine", llm).model),
           "weight_version": llm.get_weight_version()}
    try:
        if read_json(trace_dir / COLLECTION_FILE, {}).get("key") == key:
            verify_traces(trace_dir)
            return read_manifest(trace_dir), True
    except (ValueError, AttributeError, OSError, TraceCorruptError):
        pass    # damaged or partial: collect again
    trace_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in trace_dir.parent.glob(f".{trace_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    plan = plan_traces(llm, len(prompts), trace_dir.parent, **collect_kwargs)
    print(f"traces: expected up to {describe_plan(plan)}; {plan['free_bytes'] / 2 ** 30:.2f} "
          f"GiB free in {trace_dir.parent}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{trace_dir.name}.tmp-", dir=trace_dir.parent))
    try:
        _, manifest = collect_rollout_traces(llm, prompts, tmp, model_dir=model_dir,
                                             **collect_kwargs)
        from rltlab.traces.size import written_bytes
        write_json_atomic(tmp / COLLECTION_FILE, {"key": key, "finished": time.strftime(
            "%Y-%m-%dT%H:%M:%S"), "num_tokens": manifest["num_tokens"], "expected": plan,
            "written_bytes": written_bytes(tmp)})
        default_permissions(tmp)
        _replace_dir(tmp, trace_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_manifest(trace_dir), False


def collection_record(trace_dir: str | os.PathLike) -> dict[str, Any]:
    """trace_dir/collection.json ({} when absent): the collection's key, its expected size
    (`expected`, rltlab.traces.size.trace_bytes) and the bytes it wrote."""
    return read_json(Path(trace_dir) / COLLECTION_FILE, {})


def plan_traces(llm, num_prompts: int, directory: str | os.PathLike, *, max_tokens: int,
                hidden_dtype: str = "float32", projection_dim: int | None = None,
                shard_tokens: int = 4096, **_ignored) -> dict[str, Any]:
    """The expected size of a traced rollout of num_prompts prompts (up to max_tokens - 1
    traced decode tokens each: the first output token comes from the prefill) at the engine's
    shape, checked against `directory`'s free disk space (rltlab.traces.size.check_disk:
    NotEnoughDiskSpace with the figures when it would not fit)."""
    from rltlab.traces.size import check_disk, trace_bytes

    engine = getattr(llm, "llm_engine", llm)
    hidden = engine.model_config.hidden_size
    plan = trace_bytes(num_prompts * max(1, max_tokens - 1), num_rounds=engine.num_rounds,
                       hidden_dim=projection_dim or hidden, hidden_dtype=hidden_dtype,
                       shard_tokens=shard_tokens,
                       projection=(hidden, projection_dim) if projection_dim else None)
    return check_disk(directory, plan)


def describe_plan(plan: dict[str, Any]) -> str:
    from rltlab.traces.size import describe
    return describe(plan)


def _replace_dir(new: Path, target: Path) -> None:
    """Put directory `new` in `target`'s place (two renames; the old one is deleted after)."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
        os.rename(target, old)
    os.rename(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_metrics(run_dir: str | os.PathLike, metrics: dict[str, Any]) -> Path:
    """Write RUN_DIR/metrics.json atomically; adds the environment (with the loaded model's
    device and dtype, and peak_gpu_mem_gib: torch.cuda.max_memory_allocated since the model was
    loaded, None off CUDA) and a timestamp."""
    metrics = {**metrics, "environment": {**environment(), **_model_facts()},
               "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return write_json_atomic(Path(run_dir) / "metrics.json", metrics)


def _model_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"model_device": _LOADED.get("device"),
                             "model_dtype": _LOADED.get("dtype"), "peak_gpu_mem_gib": None}
    device = _LOADED.get("device")
    if device and device.startswith("cuda"):
        facts["peak_gpu_mem_gib"] = _keep_peak(torch.device(device)) / 2 ** 30
    return facts


def _keep_peak(device) -> int:
    """The largest torch.cuda.max_memory_allocated of `device` seen since the model was loaded
    (Measured resets the counter for its own figure)."""
    import torch

    peak = max(_LOADED.get("peak_bytes", 0), torch.cuda.max_memory_allocated(device))
    _LOADED["peak_bytes"] = peak
    return peak
