"""The loop's task set (LoopConfig.tasks): where its rollout and held-out problems come from,
how a problem becomes a prompt, where generation stops and how it is scored.

"embedded": the embedded model's k-hop binding and word problems (rltlab.eval.problems), [EOT] +
question, scored by exact match (rltlab.eval.tasks.evaluate_arithmetic).
"gsm8k": GSM8K-format problems from a local JSONL (cfg.gsm8k_path), prompted with lm-eval's
gsm8k_cot few-shot exemplars (cfg.gsm8k_fewshot), stopped at its stop strings and scored by its
strict match (rltlab.eval.gsm8k). The held-out set is the file's held-out split; iteration k
rolls out the k-th window of rollout_prompts problems of its training split (cycling), so the
splits never overlap and each iteration sees fresh problems while the file lasts.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from rltlab.loop.config import LoopConfig


def check(cfg: LoopConfig) -> None:
    """One-line ValueError for gsm8k without a readable GSM8K_PATH (before anything runs)."""
    from rltlab.eval.problems import check_task_set
    check_task_set(cfg.tasks, cfg.gsm8k_path)


def heldout_problems(cfg: LoopConfig, model_dir: str | os.PathLike | None) -> list[dict]:
    from rltlab.eval.problems import task_eval_problems
    return task_eval_problems(model_dir, cfg.tasks, cfg.eval_problems,
                              gsm8k_path=cfg.gsm8k_path)


def rollout_problems(tokenizer, cfg: LoopConfig, k: int) -> tuple[list[list[int]], list[dict]]:
    """Iteration k's rollout prompts and problems. embedded: n - floor(n (1 - hops_share))
    k-hop problems and the rest word problems (training split, seeded by seed * 1000 + k), one
    of each kind in turn while both last (share 0.5 = the mixed set of
    rltlab.eval.problems.rollout_prompts; a k-hop answer is 2 traced decode tokens and a word
    problem's ~25: a share of ~0.93 gives both kinds the same number of traced tokens).
    gsm8k: the k-th window of n training-split problems (module docstring)."""
    n = cfg.rollout_prompts
    if cfg.tasks == "gsm8k":
        from rltlab.eval.gsm8k import gsm8k_problems
        train = gsm8k_problems(cfg.gsm8k_path, "train")
        if len(train) < n:
            raise ValueError(f"{cfg.gsm8k_path} holds {len(train)} training-split GSM8K "
                             f"problems, ROLLOUT_PROMPTS asks for {n}")
        problems = [train[(k * n + i) % len(train)] for i in range(n)]
        return [prompt_ids(tokenizer, cfg, p) for p in problems], problems
    from rltlab.eval.problems import rollout_prompts
    n_arith = int(n * (1.0 - cfg.rollout_hops_share) + 1e-9)
    counts = {"hops": n - n_arith, "arith": n_arith}
    seed = cfg.seed * 1000 + k
    groups = [rollout_prompts(tokenizer, count, seed=seed, kinds=(kind,))
              for kind, count in counts.items() if count]
    prompts, problems = [], []
    for i in range(max(len(g[0]) for g in groups)):
        for g_prompts, g_problems in groups:
            if i < len(g_prompts):
                prompts.append(g_prompts[i])
                problems.append(g_problems[i])
    return prompts, problems


def prompt_ids(tokenizer, cfg: LoopConfig, problem: dict[str, Any]) -> list[int]:
    """The prompt a problem is generated from, as its scorer builds it."""
    if cfg.tasks == "gsm8k":
        from rltlab.eval.gsm8k import gsm8k_prompt_ids
        return gsm8k_prompt_ids(tokenizer, problem["question"], cfg.gsm8k_fewshot)
    from rltlab.eval.tasks import arithmetic_prompt
    return arithmetic_prompt(tokenizer, problem["question"])


def stop(cfg: LoopConfig) -> list[str]:
    """The stop strings of the task set's generations."""
    from rltlab.eval.problems import task_stop
    return task_stop(cfg.tasks)


def draft_problems(cfg: LoopConfig, model_dir: str | os.PathLike | None) -> list[dict]:
    """Held-out problems for the draft head's tau: embedded word problems (chain-of-thought
    answers of ~25 tokens, so K drafts can all be used; a k-hop answer has 2 decode tokens and
    would cap tau by its length), or the first GSM8K held-out problems."""
    from rltlab.eval.problems import eval_problems, task_eval_problems
    if cfg.tasks == "gsm8k":
        return task_eval_problems(model_dir, "gsm8k", cfg.draft_prompts,
                                  gsm8k_path=cfg.gsm8k_path)
    return eval_problems(model_dir, cfg.draft_prompts, kinds=("arith",))


def score(generate_fn: Callable, tokenizer, problems: Sequence[dict], cfg: LoopConfig,
          num_rounds: int, eos_token_id: int | None) -> dict[str, Any]:
    """Exact match of generate_fn on `problems` (one call over all of them), with the depth
    statistics of rltlab.eval.tasks (mean_executed, executed_hist, output_tokens, ...)."""
    from rltlab.eval.policies import score_problems
    return score_problems(generate_fn, tokenizer, problems, tasks=cfg.tasks,
                          num_fewshot=cfg.gsm8k_fewshot, num_rounds=num_rounds,
                          eos_token_id=eos_token_id)
