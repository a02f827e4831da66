"""The workbench: run directories and the `rltlab` CLI (runs, runs_cli, cli), the notebooks'
helpers (notebook) and data-parallel scale-out (scale). Notebooks use this package's face:

    from rltlab import workbench as W
    model, tokenizer, model_dir = W.load_model()

It re-exports the stage functions that notebooks call, so a notebook needs one import.
"""
from rltlab.engine.sampling import fixed_params, q_exit_params
from rltlab.eval.policies import (engine_gsm8k_fn, paired_table, text_perplexity_table)
from rltlab.eval.problems import encode, eval_problems, heldout_text_rows, rollout_prompts
from rltlab.model.checkpoint import load_model
from rltlab.traces.rollout import trace_summary
from rltlab.common.environment import environment
from rltlab.eval.plots import frame
from rltlab.workbench.notebook import (collect_rollout_traces, collect_traces_once,
                                       ensure_run_dir, evaluate_policies, make_llm, save_metrics)

__all__ = [
    "collect_rollout_traces", "collect_traces_once", "encode", "engine_gsm8k_fn",
    "ensure_run_dir", "environment",
    "eval_problems", "evaluate_policies", "fixed_params", "frame", "heldout_text_rows",
    "load_model", "make_llm", "paired_table", "q_exit_params", "rollout_prompts", "save_metrics",
    "text_perplexity_table", "trace_summary",
]
