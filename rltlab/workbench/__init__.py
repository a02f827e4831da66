"""The workbench: run directories and the `rltlab` CLI (runs, runs_cli, cli), the notebooks'
helpers (notebook) and data-parallel scale-out (scale). Notebooks use this package's face:

    from rltlab import workbench as W
    model, tokenizer, model_dir = W.load_model()

It re-exports the stage functions that notebooks call, so a notebook needs one import. The
names resolve on first use (PEP 562), so `rltlab runs` and `rltlab run` start without
importing torch and the engine.
"""
import warnings
from importlib import import_module

# tqdm.auto in a notebook kernel without ipywidgets (papermill's, or a plain Jupyter install)
# falls back to text bars, and warns into every cell that shows one.
warnings.filterwarnings("ignore", message="IProgress not found")

_HOMES = {
    "fixed_params": "rltlab.engine.sampling", "q_exit_params": "rltlab.engine.sampling",
    "engine_gsm8k_fn": "rltlab.eval.policies", "paired_table": "rltlab.eval.policies",
    "check_policy_sweep": "rltlab.eval.policies",
    "text_perplexity_table": "rltlab.eval.policies",
    "encode": "rltlab.eval.problems", "eval_problems": "rltlab.eval.problems",
    "heldout_text_rows": "rltlab.eval.problems", "rollout_prompts": "rltlab.eval.problems",
    **{name: "rltlab.eval.problems" for name in (
        "check_task_set", "max_prompt_len", "task_eval_problems", "task_rollout_prompts",
        "task_stop")},
    "trace_summary": "rltlab.traces.rollout", "rollout_params": "rltlab.traces.rollout",
    "environment": "rltlab.common.environment", "frame": "rltlab.eval.plots",
    **{name: "rltlab.workbench.notebook" for name in (
        "Measured", "collect_rollout_traces", "collection_record", "collect_traces_once", "describe_plan",
        "device_of", "engine_batch", "ensure_run_dir", "evaluate_policies", "load_model",
        "make_llm", "parameter_count", "plan_traces", "release_memory", "save_metrics")},
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'rltlab.workbench' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
