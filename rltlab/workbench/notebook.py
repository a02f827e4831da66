"""Library side of the workbench notebooks. Notebooks stay thin: each cell calls one or two
functions of `rltlab.workbench` (this module plus the stage functions it re-exports).

Conventions: the embedded arithmetic task (rltlab.pretrain.data) with prompts [EOT] +
encode(question), greedy decoding, the rollout engine (rltlab.engine.LLM) in fp32 on the CPU
unless told otherwise. Depth figures exclude the first output token (docs/ouro.md).

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


def ensure_run_dir(run_dir: str | os.PathLike | None, name: str) -> Path:
    """RUN_DIR as a Path; None (an interactive session, not `rltlab run`) creates a new one."""
    path = Path(run_dir) if run_dir else new_run_dir(name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_llm(model, tokenizer=None, **engine_kwargs):
    """An rltlab.engine.LLM over an already loaded model (EngineConfig keyword arguments)."""
    from rltlab.engine import LLM

    return LLM(model, tokenizer, **engine_kwargs)


def evaluate_policies(llm, tokenizer, problems: Sequence[dict], *, thresholds: Sequence[float] = (),
                      depths: Sequence[int] = (), max_tokens: int = 48, min_loops: int = 1,
                      batch_size: int | None = None, label: str | None = None,
                      model_dir: str | os.PathLike | None = None):
    """rltlab.eval.policies.evaluate_policies, on N ranks loading `model_dir` when
    scale.num_processes() > 1 (rltlab.workbench.scale.delegate_evaluate)."""
    if scale.num_processes() > 1:
        return scale.delegate_evaluate(llm, problems, model_dir=model_dir, thresholds=thresholds,
                                       depths=depths, max_tokens=max_tokens,
                                       min_loops=min_loops, label=label)
    return policies.evaluate_policies(llm, tokenizer, problems, thresholds=thresholds,
                                      depths=depths, max_tokens=max_tokens, min_loops=min_loops,
                                      batch_size=batch_size, label=label)


def collect_rollout_traces(llm, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike, *,
                           threshold: float, max_tokens: int, teacher: bool = True,
                           temperature: float = 0.0, seed: int = 0, min_loops: int = 1,
                           model_dir: str | os.PathLike | None = None,
                           **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """rltlab.traces.rollout.collect_rollout_traces, on N ranks loading `model_dir` when
    scale.num_processes() > 1 (rltlab.workbench.scale.delegate_collect; per-prompt seeds,
    merged manifest)."""
    kwargs = dict(threshold=threshold, max_tokens=max_tokens, teacher=teacher,
                  temperature=temperature, seed=seed, min_loops=min_loops, **collector_kwargs)
    if scale.num_processes() > 1:
        return scale.delegate_collect(llm, prompts, out_dir, model_dir=model_dir, **kwargs)
    return rollout.collect_rollout_traces(llm, prompts, out_dir, **kwargs)


COLLECTION_FILE = "collection.json"


def collect_traces_once(llm, prompts: Sequence[Sequence[int]], trace_dir: str | os.PathLike,
                        *, model_dir: str | os.PathLike | None = None,
                        **collect_kwargs) -> tuple[dict[str, Any], bool]:
    """The traces of a rollout of `prompts` in trace_dir, collected once: (manifest, reused).

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
    tmp = Path(tempfile.mkdtemp(prefix=f".{trace_dir.name}.tmp-", dir=trace_dir.parent))
    try:
        _, manifest = collect_rollout_traces(llm, prompts, tmp, model_dir=model_dir,
                                             **collect_kwargs)
        write_json_atomic(tmp / COLLECTION_FILE, {"key": key, "finished": time.strftime(
            "%Y-%m-%dT%H:%M:%S"), "num_tokens": manifest["num_tokens"]})
        default_permissions(tmp)
        _replace_dir(tmp, trace_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_manifest(trace_dir), False


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
    """Write RUN_DIR/metrics.json atomically; adds the environment and a timestamp."""
    metrics = {**metrics, "environment": environment(),
               "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return write_json_atomic(Path(run_dir) / "metrics.json", metrics)
