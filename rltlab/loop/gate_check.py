"""A candidate gate judged in real generation before it is pushed.

train_gate_on_traces (stage2.py) judges a candidate on teacher-forced traces: a token's exit
round is scored against the round-R token of the same rollout, with every earlier token fixed.
In generation an early exit also changes what later tokens see (LAST_EXITED K/V; a wrong token
changes the rest of a chain of thought), which the traces cannot show. On model v3 a candidate
that passed every trace check lost 16 pp on the held-out problems once pushed
(docs/workbench.md).

So a candidate that passed the trace checks is also generated with: greedy Q-exit at every
threshold of cfg.thresholds below 1, on the problems of the validation split's rollout prompts
(training-split problems, never the held-out evaluation set; at most cfg.gate_check_problems
of them, the lowest prompt ids), once with the current gate and
once with the candidate. Both run through one private engine over a copy of the model (the
serving engine's weight version and the caller's model are untouched), and the two
quality-vs-depth curves are compared per problem (rltlab.eval.curves.compare_curves, z =
cfg.curve_z): a point lower by more than z paired SE rejects the candidate.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from rltlab.loop.config import LoopConfig


def generation_curve(llm, tokenizer, problems: Sequence[dict], thresholds: Sequence[float],
                     cfg: LoopConfig) -> list[tuple[float, list[float]]]:
    """Q-exit (mean executed rounds, per-problem exact match) per threshold, by generation:
    the requests of every threshold in one batch (nothing is timed here; one batch of
    len(thresholds) x len(problems) requests steps through a word problem's ~40 tokens once,
    not once per threshold). Each request is the one rltlab.eval.policies.evaluate_policies
    sends (q_exit_params, greedy, stop at EOT and the task set's stop strings), scored as the
    task set scores (rltlab.loop.tasks)."""
    import dataclasses
    import math

    from rltlab.engine.outputs import raise_on_errors
    from rltlab.engine.sampling import q_exit_params
    from rltlab.loop import tasks

    prompts = [tasks.prompt_ids(tokenizer, cfg, p) for p in problems]
    params = [dataclasses.replace(q_exit_params(t, cfg.max_tokens, min_loops=cfg.min_loops),
                                  stop=tasks.stop(cfg)) for t in thresholds]
    outs = raise_on_errors(llm.generate([p for _ in thresholds for p in prompts],
                                        [sp for sp in params for _ in prompts]),
                           "the gate's generation check")
    n, R = len(prompts), llm.llm_engine.num_rounds
    curve = []
    for j in range(len(thresholds)):
        part = [o.outputs[0] for o in outs[j * n:(j + 1) * n]]
        res = tasks.score(lambda _prompts, part=part: part, tokenizer, problems, cfg, R,
                          llm.llm_engine.eos_token_id)
        curve.append((res.get("mean_executed", math.nan), res["scores"]))
    return curve


def check_in_generation(model, tokenizer, candidate: dict[str, torch.Tensor],
                        problems: Sequence[dict], cfg: LoopConfig, llm=None,
                        **engine_kwargs) -> dict[str, Any]:
    """Current gate (the model's) vs `candidate` in generation on `problems`. -> compare_curves'
    no_worse / worst_point / points / n / z, plus the thresholds and both curves.

    llm: a private engine over a copy of the same model to reuse (the loop keeps one for the
    run: on a GPU each new engine pays its KV pool and graph captures again); the model's
    current gate is pushed into it first. None: a new one (engine_kwargs: LLM's)."""
    from rltlab.engine import LLM
    from rltlab.eval.curves import compare_curves
    from rltlab.loop.stage2 import gate_state_of, push_weights

    thresholds = [float(t) for t in cfg.thresholds if float(t) < 1.0]
    if not thresholds or not problems:
        raise ValueError("the generation check needs a threshold below 1 and a problem")
    if llm is None:
        llm = LLM(model, tokenizer, **engine_kwargs)   # holds its own copy of the weights
    else:
        push_weights(llm, llm.llm_engine.model, gate_state_of(model.model.early_exit_gate),
                     llm.get_weight_version() + 1)
    before = generation_curve(llm, tokenizer, problems, thresholds, cfg)
    # named after the engine's own model, so the caller's model keeps its gate
    push_weights(llm, llm.llm_engine.model, candidate, llm.get_weight_version() + 1)
    after = generation_curve(llm, tokenizer, problems, thresholds, cfg)
    cmp = compare_curves(before, after, z=cfg.curve_z)
    return {**{k: cmp.get(k) for k in ("no_worse", "worst_point", "points", "n", "z")},
            "thresholds": thresholds,
            "curves": {name: [[x, 100 * sum(s) / len(s)] for x, s in curve]
                       for name, curve in (("current", before), ("candidate", after))}}


def judge_in_generation(trained: dict[str, Any], model, tokenizer, rollout_problems: Sequence[dict],
                        cfg: LoopConfig, llm=None) -> None:
    """train_gate_on_traces' result, updated in place: a candidate that passed the trace checks
    is checked in generation on its validation prompts' problems (`generation_check`); a worse
    curve fails validation, and the current gate is kept unless cfg.gate_keep_worse."""
    from rltlab.loop.stage2 import gate_state_of

    if not (cfg.gate_generation_check and trained["validation_passed"]):
        trained["generation_check"] = None
        return
    ids = trained["val_prompt_ids"][:cfg.gate_check_problems]   # sorted: the kinds alternate
    problems = [rollout_problems[i] for i in ids]
    check = check_in_generation(model, tokenizer, trained["candidate_state"], problems, cfg,
                                llm=llm() if callable(llm) else llm)
    trained["generation_check"] = check
    if check["no_worse"] is False:
        w = check["worst_point"]
        trained["reasons"].append(
            f"validation prompts in generation worse (at {w['mean_rounds']:.3f} rounds "
            f"{w['diff_pp']:+.2f} pp, SE {w['se_pp']:.2f}, {check['n']} problems)")
        trained["validation_passed"] = False
        trained["accepted"] = cfg.gate_keep_worse
        if not trained["accepted"]:
            trained["state"] = gate_state_of(model.model.early_exit_gate)
