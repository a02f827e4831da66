"""One loop iteration: rollout, update, add-ons, push, evaluate; resume from finished ones."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence


from rltlab import workbench as W
from rltlab.loop import memory, tasks
from rltlab.common.atomic import default_permissions, write_json_atomic
from rltlab.loop.addons import draft_head_step, exit_predictor_step
from rltlab.loop.config import LoopConfig, LoopState, SimulatedCrash
from rltlab.loop.deploy import deploy_step, deployed_from, install_predictor, on_policy_rollout
from rltlab.loop.gate_check import judge_in_generation
from rltlab.loop.metrics import compare_evaluations, gate_verdict, quality_by_kind
from rltlab.loop.resume import RESULT_FILE, check_resume, read_result
from rltlab.loop.stage2 import load_gate, push_weights, save_gate, train_gate_on_traces


def iteration_dir(run_dir: str | os.PathLike, k: int) -> Path:
    return Path(run_dir) / f"iter_{k}"


def finished_iterations(run_dir: str | os.PathLike) -> list[int]:
    """Indices k with a complete iter_k/ (result.json present), contiguous from 0."""
    done = []
    k = 0
    while (iteration_dir(run_dir, k) / RESULT_FILE).is_file():
        done.append(k)
        k += 1
    return done


def setup(run_dir: str | os.PathLike, model, tokenizer, cfg: LoopConfig,
          model_dir: str | os.PathLike | None = None, **engine_kwargs) -> LoopState:
    """Engine at version 0 over `model`, then resume: load finished iterations and push the
    last finished gate as its version. Stale temporary iteration dirs are removed.

    Before anything is written: every finished iteration's result.json is checked (a damaged
    one raises JSONFileError naming the file and the field) and `cfg` and `model` must match
    the ones they were made with (ResumeMismatch names each differing parameter; only
    RESUMABLE_FIELDS may change). loop_config.json records the settings of the run's first
    iteration and is kept on resume."""
    run_dir = Path(run_dir)
    tasks.check(cfg)
    done = finished_iterations(run_dir)
    results = [read_result(run_dir, k) for k in done]
    check_resume(run_dir, cfg, results, model)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".iter_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if not results or not (run_dir / "loop_config.json").is_file():
        write_json_atomic(run_dir / "loop_config.json", asdict(cfg))
    # the embedded tasks' prompts are short (k-hop and word problems): a KV pool sized for
    # sequences of MAX_MODEL_LEN tokens, not the model's length (Ouro-1.4B: 65,536), leaves a
    # GPU's memory to the gate check's engine and the update steps; GSM8K's few-shot prompts
    # (~1K tokens at 8 exemplars) and chain-of-thought answers get GSM8K_MAX_MODEL_LEN
    longest = GSM8K_MAX_MODEL_LEN if cfg.tasks == "gsm8k" else MAX_MODEL_LEN
    engine_kwargs.setdefault("max_model_len", min(longest, model.config.max_position_embeddings))
    check_kwargs = dict(engine_kwargs)
    shares = memory.engine_memory(model, engine_kwargs)   # on CUDA: both engines' pools
    if shares is not None:
        engine_kwargs["kv_cache_memory_gib"], check_kwargs["kv_cache_memory_gib"] = shares
    llm = W.make_llm(model, tokenizer, **engine_kwargs)
    state = LoopState(run_dir, cfg, model, tokenizer, llm,
                      Path(model_dir) if model_dir else None, check_engine_kwargs=check_kwargs)
    state.problems = tasks.heldout_problems(cfg, state.model_dir)
    state.load_average_start = list(os.getloadavg())
    state.speed_device = speed_device(llm)
    warm_up(state)
    state.results = results
    state.resumed_from = len(done)
    if done:
        last = done[-1]
        gate = load_gate(iteration_dir(run_dir, last) / "gate.safetensors")
        push_weights(llm, model, gate, last + 1)
    return state


MAX_MODEL_LEN = 1024    # the loop's engines: prompt + new tokens of one sequence
GSM8K_MAX_MODEL_LEN = 4096


def speed_device(llm) -> str:
    """Where the engine runs (what every tok/s of the run measures): "cpu (N threads)" or
    the GPU's name."""
    import torch

    device = llm.llm_engine.runner.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({torch.get_num_threads()} threads)"


def warm_up(state: LoopState, problems: int = 4) -> None:
    """One short generation before anything is timed: the first call of a process pays for
    allocations and lazy initialisation, which would slow the first measured setting's tok/s.
    On a GPU also the engine's warm-up (LLM.warm_up: the graph captures and kernel
    specialisations of every batch bucket up to the held-out set's batch), so no timed row
    pays them."""
    from rltlab.eval.policies import evaluate_policies    # in-process, also under scale-out

    if state.llm.llm_engine.runner.device.type == "cuda":
        engine = state.llm.llm_engine
        longest = max(len(tasks.prompt_ids(state.tokenizer, state.cfg, p))
                      for p in state.problems)
        state.warm_up = state.llm.warm_up(
            concurrency=min(engine.config.max_num_seqs,
                            max(len(state.problems), state.cfg.rollout_prompts)),
            prompt_len=longest, max_tokens=8, progress=False)
    evaluate_policies(state.llm, state.tokenizer, state.problems[:problems], thresholds=[0.5],
                      max_tokens=4, min_loops=state.cfg.min_loops, tasks=state.cfg.tasks,
                      num_fewshot=state.cfg.gsm8k_fewshot)


def evaluate(state: LoopState, label: str, reuse: dict[str, Any] | None = None,
             depths: Sequence[int] = ()) -> dict[str, Any]:
    """Q-exit threshold sweep at the engine's current version on the held-out problems (and
    the fixed `depths`, for version 0). With cfg.reuse_full_depth, the threshold-1.0 row (fixed
    depth R: the gate is never asked, and only the gate changes between versions) is copied
    from `reuse` (an earlier evaluation of the same problems) instead of being generated
    again. Every generated row carries its tokens_per_s, measured here."""
    cfg = state.cfg
    full = [t for t in cfg.thresholds if float(t) >= 1.0]
    carried = None
    if cfg.reuse_full_depth and reuse is not None and full:
        carried = next((r for r in reuse["rows"] if r.get("threshold") is not None
                        and r["threshold"] >= 1.0), None)
    thresholds = [t for t in cfg.thresholds if carried is None or float(t) < 1.0]
    rows, scores = W.evaluate_policies(state.llm, state.tokenizer, state.problems,
                                       thresholds=thresholds, depths=depths,
                                       max_tokens=cfg.max_tokens, min_loops=cfg.min_loops,
                                       label=label, tasks=cfg.tasks,
                                       num_fewshot=cfg.gsm8k_fewshot)
    for row in rows:
        row["quality_by_kind"] = quality_by_kind(scores[row["key"]], state.problems)
    version = state.llm.get_weight_version()
    if carried is not None:
        more = carry_evaluation({"rows": [carried], "scores": reuse["scores"]}, label, version)
        rows += more["rows"]
        scores.update(more["scores"])
    return {"version": version, "rows": rows, "scores": scores}


def carry_evaluation(ev: dict[str, Any], label: str, version: int) -> dict[str, Any]:
    """An evaluation's Q-exit rows relabeled for `version` without generating: for weights
    that generate exactly the same (greedy, same problems), e.g. a rejected gate update that
    pushed the unchanged gate again. Rows keep `carried_from_version` (the version that
    generated) and their measured tokens_per_s. Fixed-depth rows (version 0) are not copied."""
    rows, scores = [], {}
    for r in ev["rows"]:
        if r.get("threshold") is None:
            continue
        key = f"{label} q_exit {r['setting']}"
        rows.append({**r, "policy": f"{label} q_exit", "key": key, "weight_version": version,
                     "seconds": 0.0,
                     "carried_from_version": r.get("carried_from_version", r["weight_version"])})
        scores[key] = ev["scores"][r["key"]]
    return {"version": version, "rows": rows, "scores": scores}


def _held_out_overlap(problems: Sequence[dict], rolled: Sequence[dict]) -> int:
    held = {p["question"] for p in problems}
    return sum(p["question"] in held for p in rolled)


def _retarget(root: Path, old: Path, new: Path) -> None:
    """Rewrite absolute paths old/... -> new/... inside the JSON files under root (add-on
    manifests written inside the temporary iteration directory)."""
    for path in root.rglob("*.json"):
        text = path.read_text()
        if str(old) in text:
            data = json.loads(text.replace(json.dumps(str(old))[1:-1], json.dumps(str(new))[1:-1]))
            write_json_atomic(path, data)


def run_iteration(state: LoopState, k: int) -> dict[str, Any]:
    """Run (or load, if finished) iteration k; returns its result dict."""
    if k < len(state.results):
        return {**state.results[k], "skipped": True}
    if k != len(state.results):
        raise ValueError(f"iteration {k} requested but only {len(state.results)} are finished")
    cfg, llm, run_dir = state.cfg, state.llm, state.run_dir
    version = llm.get_weight_version()
    if version != k:
        raise RuntimeError(f"engine is at weight version {version}, iteration {k} expects {k}")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".iter_{k}.tmp-", dir=run_dir))
    final = iteration_dir(run_dir, k)
    try:
        timings: dict[str, float] = {}     # seconds of each step, in order
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            timings[name] = round(now - mark, 3)
            mark = now
        before = state.results[-1]["after"] if state.results else \
            evaluate(state, f"v{k}", depths=cfg.depths)
        if not state.results:
            lap("evaluate_v0")
        prompts, rolled = tasks.rollout_problems(state.tokenizer, cfg, k)
        overlap = _held_out_overlap(state.problems, rolled)
        if overlap:
            raise RuntimeError(f"{overlap} rollout prompts are in the held-out evaluation set")
        deployed = deployed_from(state, k)
        installed = install_predictor(state, k, deployed) \
            if deployed and deployed["predictor"] else None
        if installed is not None:    # on-policy: the deployed N+2 rolls out (rltlab.loop.deploy)
            outs, manifest, rollout = on_policy_rollout(state, k, prompts, tmp / "traces",
                                                        installed["policy"])
        else:
            started_rollout = time.perf_counter()
            outs, manifest = W.collect_rollout_traces(
                llm, prompts, tmp / "traces", threshold=cfg.rollout_threshold,
                max_tokens=cfg.max_tokens, teacher=True, temperature=cfg.temperature,
                seed=cfg.seed + k, min_loops=cfg.min_loops, hidden_dtype=cfg.hidden_dtype,
                stop=tasks.stop(cfg), info={"iteration": k})
            rollout = {"policy": f"q_exit t={cfg.rollout_threshold:g} (teacher mode)",
                       "prompts": len(prompts),
                       "seconds": round(time.perf_counter() - started_rollout, 4)}
        rollout_versions = sorted({v for o in outs for v in o.outputs[0].weight_versions})
        lap("rollout")
        trained = train_gate_on_traces(state.model, tmp / "traces", cfg)
        lap("gate_training")
        judge_in_generation(trained, state.model, state.tokenizer, rolled, cfg,
                            llm=state.gate_check_llm)
        lap("gate_generation_check")
        if k == cfg.crash_at_iteration:
            raise SimulatedCrash(f"simulated crash in iteration {k} (CRASH_AT_ITERATION)")
        addons: dict[str, Any] = {}
        if deployed is not None:
            addons["deployed"] = deploy_step(state, k, deployed, installed, rollout, before)
            lap("deployed")
        if cfg.train_exit_predictor:
            addons["exit_predictor"] = exit_predictor_step(state, k, tmp, before)
            lap("exit_predictor")
        if cfg.train_draft_head:
            addons["draft_head"] = draft_head_step(state, k, tmp)
            lap("draft_head")
        if (tmp / "exit_predictor").is_dir():   # its manifests name the (temporary) traces
            _retarget(tmp / "exit_predictor", tmp, final)
        save_gate(tmp / "gate.safetensors", trained["state"], k + 1)
        if not trained["accepted"]:
            save_gate(tmp / "gate_rejected.safetensors", trained["candidate_state"], k + 1)
        new_version = push_weights(llm, state.model, trained["state"], k + 1)
        if trained["accepted"] or not cfg.reuse_full_depth:
            after = evaluate(state, f"v{new_version}", reuse=before)
        else:   # the same gate pushed again: generation is identical, copy "before"
            after = carry_evaluation(before, f"v{new_version}", new_version)
        lap("push_and_evaluate")
        summary = W.trace_summary(tmp / "traces")
        cmp = compare_evaluations(before, after, cfg.curve_z)
        result = {
            "iteration": k, "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(time.perf_counter() - t0, 3), "timings": timings,
            "rollout_weight_versions": rollout_versions,
            "trace_weight_versions": sorted({v for s in manifest["shards"]
                                             for v in s["weight_versions"]}),
            "trace_model_hashes": manifest.get("info", {}).get("model_hashes", {}),
            "trace_tokens": manifest["num_tokens"], "new_weight_version": new_version,
            "heldout_overlap_with_rollouts": overlap, "rollout": rollout,
            "rollout_kinds": {kind: sum(p["kind"] == kind for p in rolled)
                              for kind in (("gsm8k",) if cfg.tasks == "gsm8k"
                                           else ("hops", "arith"))},
            "gate_training": {k2: v for k2, v in trained.items()
                              if k2 not in ("state", "candidate_state")},
            "trace_mean_selected": summary["mean_selected"],
            "config": asdict(cfg), "before": before, "after": after,
            "gate_curve": cmp, "gate_verdict": gate_verdict(
                cmp, [trained["accepted"]], cfg.noninferiority_margin_pp, cfg.curve_z)["verdict"],
            **addons}
        write_json_atomic(tmp / RESULT_FILE, result)
        default_permissions(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    state.results.append(result)
    return result


def describe_iteration(res: dict[str, Any]) -> str:
    """One line per iteration for the notebook's log."""
    g = res["gate_training"]
    took = "loaded" if res.get("skipped") else f"{res['seconds']:.1f} s"

    def f(x, digits=4):
        return "n/a" if x is None else f"{x:.{digits}f}"
    line = (f"iteration {res['iteration']} ({took}): rollout at v{res['rollout_weight_versions']}, "
            f"{res['trace_tokens']} traced tokens; gate BCE train {f(g['loss_before'])} -> "
            f"{f(g['loss_after'])}, validation {f(g.get('val_before'))} -> "
            f"{f(g.get('val_after'))} (best step {g.get('best_step')}), "
            f"{'accepted' if g.get('accepted', True) else 'REJECTED: ' + '; '.join(g['reasons'])}"
            f"; now v{res['new_weight_version']}"
            f"{'' if g.get('accepted', True) else ' (the kept gate, pushed again)'}"
            f"; held-out verdict: {res.get('gate_verdict')}")
    dep = res.get("deployed")
    if dep and dep.get("n_plus_2"):
        n2, q, ro = dep["n_plus_2"], dep["stock_q_exit"], dep.get("rollout") or {}
        line += (f"\n  deployed N+2 of iteration {dep['from_iteration']} (the rollout policy: "
                 f"{f(ro.get('mean_rounds'), 3)} rounds, {f(ro.get('tokens_per_s'), 1)} tok/s"
                 f"{', across a gate change' if dep.get('across_gate_change') else ''}): "
                 f"held-out {n2['quality']:.1f}% at {n2['mean_rounds']:.3f} rounds, "
                 f"{n2['tokens_per_s']:.1f} tok/s vs stock Q-exit t={q['threshold']:g} "
                 f"{q['quality']:.1f}% at {q['mean_rounds']:.3f} rounds, "
                 f"{q['tokens_per_s']:.1f} tok/s ({dep['speedup_vs_stock_q_exit']:.2f}x); vs "
                 f"the stock Q-exit at equal rounds {f(n2.get('diff_vs_stock_q_exit_pp'), 1)} pp "
                 f"(SE {f(n2.get('diff_vs_stock_q_exit_se_pp'), 1)})")
    if dep and dep.get("draft"):
        d = dep["draft"]
        line += (f"\n  deployed draft head of iteration {dep['from_iteration']} (engine "
                 f"proposer, full depth, {d['prompts']} word problems at {d['concurrency']}): "
                 f"{d['tokens_per_s']:.1f} vs {d['target_tokens_per_s']:.1f} tok/s target-only "
                 f"({d['speedup_vs_target']:.2f}x), tau {f(d['tau'], 2)}, identical "
                 f"{d['identical']}")
    ep, dh = res.get("exit_predictor"), res.get("draft_head")
    if ep:
        cal = next((r for r in ep["rows"] if r.get("calibrated")), ep["rows"][0])
        line += (f"\n  N+{ep['exit_round'] - ep['decision_round']} predictor "
                 f"(v{ep['weight_version']}"
                 f"): {cal['quality']:.1f}% at {cal['mean_rounds']:.3f} rounds "
                 f"(threshold {ep['threshold']:.3f}; test split: label rate "
                 f"{f(ep['test']['label_rate'], 3)}, fire rate {f(ep['test']['fire_rate'], 3)}"
                 f"); vs Q-exit at equal rounds {f(cal.get('diff_vs_q_exit_pp'), 1)} pp (SE "
                 f"{f(cal.get('diff_vs_q_exit_se_pp'), 1)})")
    if dh:
        line += (f"\n  draft head {dh['kind']} (v{dh['weight_version']}): tau {dh['tau']:.2f} vs "
                 f"{dh['tau_shallow']:.2f} untrained d={dh['draft_rounds']} (K = {dh['k']}), "
                 f"acceptance {dh['acceptance']:.3f} vs {dh['acceptance_shallow']:.3f}")
    return line


