"""Deployment: iteration k >= 1 runs what iteration k - 1 trained (LoopConfig.deploy_components).

- The N+2 predictor of iteration k - 1 is installed as an exit policy
  (rltlab.engine_patches.lookahead_exit) and IS the rollout policy of iteration k: the engine
  generates with it (LAST_EXITED, its own exits), and the traces every update step of
  iteration k trains on are that rollout recomputed with every round (rltlab.loop.relabel):
  on-policy tokens and K/V, labels for every round.
- On the held-out problems it is then measured against the stock Q-exit at the rollout
  threshold (the policy it replaced: version 0's gate, generated on the same engine and
  problems in iteration 0 of this run): quality, mean executed rounds, tok/s, and the paired
  difference against the stock gate's Q-exit Pareto curve (and this version's) at the same
  mean rounds.
- The draft head of iteration k - 1 becomes the engine's proposer (DraftProposer through
  rltlab.engine_patches.loop_draft.load_proposer) for a dedicated same-run speed row: the engine
  speculates only for requests that run every token at full depth
  (rltlab.engine.spec.decoder.SpecDecoder.eligible), which the N+2 rollout and the teacher-mode
  rollout never are, so it serves the full-depth requests: held-out word problems at threshold
  1.0 (greedy), DRAFT_CONCURRENCY at a time, with and without the proposer on the same engine,
  tokens compared (speculation is lossless at T = 0), tau / acceptance from the engine's own
  spec_stats. The proposer is removed again afterwards, so no other row is timed with it.

The predictor is bound to the model hash of version k - 1. A gate update accepted at k - 1
changes the hash (and the gate logits the predictor reads as features): it is deployed anyway,
deliberately, and recorded as `across_gate_change`; its held-out row shows what that costs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from rltlab.loop.config import LoopState


def deployed_from(state: LoopState, k: int) -> dict[str, Any] | None:
    """What iteration k deploys: the predictor / draft head that iteration k - 1 trained
    (paths inside RUN_DIR/iter_{k-1}/), or None (iteration 0, deployment off, nothing trained)."""
    if not state.cfg.deploy_components or k < 1 or len(state.results) < k:
        return None
    prev, prev_dir = state.results[k - 1], Path(state.run_dir) / f"iter_{k - 1}"
    ep, dh = prev.get("exit_predictor"), prev.get("draft_head")
    if not ep and not dh:
        return None
    return {"from_iteration": k - 1,
            "predictor": str(prev_dir / ep["checkpoint"]) if ep else None,
            "predictor_model_hash": ep["model_hash"] if ep else None,
            "predictor_threshold": ep["threshold"] if ep else None,
            "draft_head": str(prev_dir / dh["component"]) if dh else None}


def install_predictor(state: LoopState, k: int, deployed: dict[str, Any]) -> dict[str, Any]:
    """Install iteration k - 1's predictor under its own policy name -> {policy, across_gate_change}.
    It is checked against the model hash it was trained for (version k - 1), which differs from
    the current one only where the gate update of k - 1 was accepted (only the gate is pushed)."""
    from rltlab.engine_patches.lookahead_exit import install

    name = f"loop_deployed_n_plus_2_iter{deployed['from_iteration']}"
    install(state.model, deployed["predictor"], name=name,
            model_hash=deployed["predictor_model_hash"])
    return {"policy": name,
            "across_gate_change": state.model_hash() != deployed["predictor_model_hash"]}


def _params(state: LoopState, policy: str | None, max_tokens: int, seed: int,
            threshold: float | None = None):
    from rltlab.engine import SamplingParams

    from rltlab.loop import tasks

    cfg = state.cfg
    if policy is None:
        return SamplingParams(temperature=cfg.temperature, max_tokens=max_tokens, seed=seed,
                              min_loops=cfg.min_loops, exit_policy="q_exit",
                              exit_threshold=float(threshold), stop=tasks.stop(cfg))
    return SamplingParams(temperature=cfg.temperature, max_tokens=max_tokens, seed=seed,
                          min_loops=cfg.min_loops, exit_policy=policy, stop=tasks.stop(cfg))


def on_policy_rollout(state: LoopState, k: int, prompts: Sequence[Sequence[int]],
                      out_dir: Path, policy: str) -> tuple[list, dict[str, Any], dict[str, Any]]:
    """Iteration k's rollout with the deployed policy acting (LAST_EXITED), then its on-policy
    traces in out_dir (rltlab.loop.relabel) -> (outputs, manifest, rollout figures: tok/s of
    the generation alone, mean executed rounds of its decode tokens, relabel seconds)."""
    from rltlab.engine.outputs import raise_on_errors
    from rltlab.loop.relabel import write_on_policy_traces

    cfg, llm = state.cfg, state.llm
    started = time.perf_counter()
    outs = raise_on_errors(llm.generate([list(p) for p in prompts],
                                        _params(state, policy, cfg.max_tokens, cfg.seed + k)),
                           f"iteration {k}'s rollout with {policy}")
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    depths = [d for o in outs for d in o.outputs[0].executed_depths[1:]]
    started = time.perf_counter()
    manifest = write_on_policy_traces(state.model, outs, list(range(len(prompts))), out_dir,
                                      policy=policy, hidden_dtype=cfg.hidden_dtype,
                                      seed=cfg.seed + k, info={"iteration": k},
                                      model_hash=state.model_hash())
    return outs, manifest, {
        "policy": policy, "prompts": len(prompts), "output_tokens": tokens,
        "seconds": round(seconds, 4), "tokens_per_s": tokens / max(seconds, 1e-9),
        "mean_rounds": sum(depths) / len(depths) if depths else None,
        "relabel_seconds": round(time.perf_counter() - started, 4)}


def heldout_rows(state: LoopState, k: int, policy: str, threshold: float,
                 before: dict[str, Any]) -> dict[str, Any]:
    """The deployed N+2 on the held-out problems at version k, and the stock Q-exit it
    replaced: the stock gate's (version 0's) Q-exit at the rollout threshold, generated on the
    same engine and problems earlier in this run (iteration 0's sweep), so nothing is
    generated twice -> {"n_plus_2": row (as the predictor step's rows: quality, mean rounds,
    tok/s, fire rate, paired differences vs this version's and vs the stock gate's Q-exit
    Pareto curve at the same mean rounds), "stock_q_exit": that row, "speedup_vs_stock_q_exit":
    the tok/s ratio}. Where the sweep has no row at the rollout threshold it is generated here."""
    from rltlab.loop.addons import lookahead_row
    from rltlab.loop.metrics import quality_by_kind
    from rltlab.eval.policies import evaluate_policies

    cfg = state.cfg
    label = f"v{k} deployed n_plus_2 (iter {k - 1})"
    row = lookahead_row(state, policy, threshold, label, before, exit_round=3,
                        calibrated=True)
    stock = state.results[0]["before"]
    q_row = next((r for r in stock["rows"] if r.get("threshold") is not None
                  and abs(r["threshold"] - cfg.rollout_threshold) < 1e-9), None)
    if q_row is None or not q_row.get("tokens_per_s"):
        rows, scores = evaluate_policies(state.llm, state.tokenizer, state.problems,
                                         thresholds=[cfg.rollout_threshold],
                                         max_tokens=cfg.max_tokens, min_loops=cfg.min_loops,
                                         label=f"v{k} q_exit (beside deployed)",
                                         tasks=cfg.tasks, num_fewshot=cfg.gsm8k_fewshot)
        q_row, q_scores = rows[0], scores[rows[0]["key"]]
    else:
        q_scores = stock["scores"][q_row["key"]]
    q_row = {**q_row, "scores": q_scores, "quality_by_kind": quality_by_kind(q_scores,
                                                                             state.problems)}
    return {"n_plus_2": row, "stock_q_exit": q_row,
            "speedup_vs_stock_q_exit": row["tokens_per_s"] / q_row["tokens_per_s"]}


def draft_engine_row(state: LoopState, k: int, component: str) -> dict[str, Any]:
    """The deployed draft head as the engine's proposer (module docstring): held-out word
    problems at full depth (threshold 1.0, greedy), cfg.draft_concurrency at a time, with and
    without the proposer on the same engine -> tok/s of both, speedup, identical tokens, and the
    engine's spec_stats (steps, drafted, accepted, tau, acceptance)."""
    from rltlab.engine.outputs import raise_on_errors
    from rltlab.engine_patches.loop_draft import load_proposer
    from rltlab.loop import tasks

    cfg, llm = state.cfg, state.llm
    engine = llm.llm_engine
    prompts = [tasks.prompt_ids(state.tokenizer, cfg, p)
               for p in tasks.draft_problems(cfg, state.model_dir)]
    params = _params(state, None, cfg.draft_max_tokens, cfg.seed, threshold=1.0)
    groups = [prompts[i:i + cfg.draft_concurrency]
              for i in range(0, len(prompts), cfg.draft_concurrency)]

    def run():
        started, outs = time.perf_counter(), []
        for group in groups:
            outs += raise_on_errors(llm.generate(group, params), "the draft-head speed row")
        return outs, time.perf_counter() - started
    # the gate does not enter drafting: a head trained at version k - 1 fits version k's model
    proposer = load_proposer(component, state.model, num_draft_tokens=cfg.draft_k,
                             check_hash=False)
    previous = engine.proposer
    try:
        engine.set_proposer(proposer)
        if engine.runner.device.type == "cuda":
            run()                              # warm-up: the GPU captures the draft program
        spec, spec_s = run()
        engine.set_proposer(None)
        target, target_s = run()
    finally:
        engine.set_proposer(previous)
    n_spec = sum(len(o.outputs[0].token_ids) for o in spec)
    n_target = sum(len(o.outputs[0].token_ids) for o in target)
    stats = [o.spec_stats for o in spec if o.spec_stats]
    total = {key: sum(s.get(key, 0) for s in stats) for key in ("steps", "drafted",
                                                                  "accepted", "emitted")}
    return {"component": component, "k": cfg.draft_k, "prompts": len(prompts),
            "concurrency": cfg.draft_concurrency, "max_tokens": cfg.draft_max_tokens,
            "tokens_per_s": n_spec / max(spec_s, 1e-9),
            "target_tokens_per_s": n_target / max(target_s, 1e-9),
            "speedup_vs_target": (n_spec / max(spec_s, 1e-9)) / (n_target / max(target_s, 1e-9)),
            "identical": [o.outputs[0].token_ids for o in spec]
            == [o.outputs[0].token_ids for o in target],
            "spec_steps": total["steps"], "drafted": total["drafted"],
            "accepted": total["accepted"], "emitted": total["emitted"],
            "tau": total["emitted"] / total["steps"] if total["steps"] else None,
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else None,
            "speculated_share": total["emitted"] / max(1, n_spec),
            "weight_version": llm.get_weight_version()}


def deploy_step(state: LoopState, k: int, deployed: dict[str, Any], installed: dict[str, Any] | None,
                rollout: dict[str, Any] | None, before: dict[str, Any]) -> dict[str, Any]:
    """Iteration k's `deployed` record: what was deployed and its same-run measurements."""
    out: dict[str, Any] = {"from_iteration": deployed["from_iteration"],
                           "predictor": deployed["predictor"],
                           "draft_head": deployed["draft_head"], "rollout": rollout}
    t0 = time.perf_counter()
    if installed is not None:
        out.update(policy=installed["policy"], across_gate_change=installed["across_gate_change"],
                   **heldout_rows(state, k, installed["policy"],
                                  float(deployed["predictor_threshold"]), before))
    if deployed["draft_head"]:
        out["draft"] = draft_engine_row(state, k, deployed["draft_head"])
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out

