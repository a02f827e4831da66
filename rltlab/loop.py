"""The rollout -> gate update -> evaluate loop (notebook 10_rollout_update_evaluate).

Iteration k (weight version k in the engine):
  1. rollout: generate on training-split arithmetic prompts with the stock Q-exit, collecting
     traces in teacher mode (all R rounds per token, so every round has a Stage II label);
  2. update: Stage II gate-only training of the exit gate on those traces (REFERENCE
     section 1): CE_r = -log p_r(round-R token), I_r = max(0, CE_{r-1} - CE_r),
     w_r = sigmoid(slope (I_r - margin)), BCE between 1 - lambda_r and w_r; round 1 takes w_2
     (the convention of rltlab.pretrain.stage2_loss, which trains the embedded model's gate).
     The traces are split by prompt into train / validation; the validation Stage II BCE is
     checked every `gate_eval_every` steps, the best step is kept (early stopping after
     `gate_patience` checks without improvement). The candidate is then validated against the
     current gate on the validation split: its BCE must be lower and its teacher-forced
     quality-vs-depth curve (agreement of the exit round's top-1 with the round-R token vs
     mean exit round, Q-exit sweep) no worse by the rule of rltlab.eval.curves. A candidate
     that fails is reported and, unless `gate_keep_worse`, the current gate is kept (pushed
     again, unchanged, as the next version);
  3. optional add-ons on the same traces, at version k (their checkpoints record version k
     and its model hash, which covers the gate): the N+k lookahead exit predictor
     (rltlab.exit_predictor, evaluated in real generation through
     rltlab.engine_patches.lookahead_exit) and the loop-aware draft head (rltlab.draft_heads,
     distilled on (h_d, p_R) of the traced tokens; tau / acceptance vs the untrained shallow
     drafter through rltlab.engine.speculative);
  4. push: the new gate through the engine's weight-update API as version k + 1
     (start_weight_update / update_weights / finish_weight_update);
  5. evaluate: quality vs mean executed rounds of the Q-exit threshold sweep at version k + 1
     ("after"; "before" is version k: computed for k = 0, carried over after that) on held-out
     problems (disjoint from the training-split rollout prompts; checked), and the paired
     comparison of the two Pareto curves (rltlab.eval.curves.compare_curves).

Checkpoints: everything of iteration k is built in RUN_DIR/.iter_k.tmp-*/ and renamed to
RUN_DIR/iter_k/ once complete (result.json, gate.safetensors, traces/, exit_predictor/,
draft_head/). A finished iteration is never recomputed: a re-run (same RUN_DIR) loads
iter_0..iter_{j} and resumes at j + 1 after pushing the last finished gate into the engine. A
crash leaves only a temporary directory, removed on the next run.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import safetensors.torch
import torch
import torch.nn.functional as F

from rltlab import workbench as W
from rltlab.runs import read_json, write_json_atomic

GATE_WEIGHT, GATE_BIAS = "model.early_exit_gate.weight", "model.early_exit_gate.bias"


@dataclass
class LoopConfig:
    iterations: int = 3
    rollout_prompts: int = 64
    rollout_threshold: float = 0.5
    max_tokens: int = 48
    eval_problems: int = 64
    thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.9, 1.0)
    min_loops: int = 1
    gate_steps: int = 200
    gate_lr: float = 3e-3
    gate_batch: int = 512
    slope: float = 50.0
    margin: float = 0.005
    gate_val_fraction: float = 0.2     # prompts of the rollout held out to validate the gate
    gate_eval_every: int = 20          # validation BCE every this many steps (early stopping)
    gate_patience: int = 5             # stop after this many checks without improvement
    gate_keep_worse: bool = False      # True: push a candidate that fails validation anyway
    curve_z: float = 2.0               # "no worse" = no point lower by more than z paired SE
    reuse_full_depth: bool = True      # copy, not regenerate, what the update cannot change:
    #                                    threshold 1.0 (fixed depth R) and a rejected update
    temperature: float = 0.0
    seed: int = 0
    hidden_dtype: str = "float32"
    # N+k lookahead exit predictor (rltlab.exit_predictor) trained on each iteration's traces
    train_exit_predictor: bool = False
    predictor_kind: str = "mlp"
    predictor_label: str = "argmax"
    predictor_epochs: int = 30
    predictor_decision_round: int = 1
    predictor_k: int = 2
    predictor_target_precision: float = 0.99
    lookahead_thresholds: Sequence[float] = ()   # evaluated besides the calibrated threshold
    # loop-aware draft head (rltlab.draft_heads) distilled on each iteration's traces
    train_draft_head: bool = False
    draft_kind: str = "residual_mlp"   # reuse-exact kinds: residual_mlp | lora_lm_head
    draft_rounds: int = 1
    draft_steps: int = 150
    draft_lr: float = 1e-3
    draft_k: int = 4
    draft_prompts: int = 8             # held-out arithmetic prompts for tau / acceptance
    draft_max_tokens: int = 32
    draft_concurrency: int = 8
    crash_at_iteration: int = -1   # test hook: raise inside iteration k before it is committed
    extra: dict = field(default_factory=dict)


class SimulatedCrash(RuntimeError):
    pass


# ----------------------------------------------------------------------------- Stage II

def stage2_targets(ce: torch.Tensor, slope: float = 50.0, margin: float = 0.005) -> torch.Tensor:
    """Soft "continue" labels w [.., R] from per-round CE [.., R] (as pretrain.stage2_loss)."""
    gain = (ce[..., :-1] - ce[..., 1:]).clamp_min(0)          # I_r for r = 2..R
    w = torch.sigmoid(slope * (gain - margin))
    return torch.cat([w[..., :1], w], dim=-1)                  # round 1 takes w_2


def gate_state_of(gate: torch.nn.Linear) -> dict[str, torch.Tensor]:
    return {GATE_WEIGHT: gate.weight.detach().float().cpu().clone(),
            GATE_BIAS: gate.bias.detach().float().cpu().clone()}


def _stage2_bce(module: torch.nn.Linear, hidden, target, mask) -> torch.Tensor:
    logits = module(hidden).squeeze(-1)
    per = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return (per * mask).sum() / mask.sum().clamp_min(1)


def train_gate(gate: torch.nn.Linear, hidden: torch.Tensor, ce: torch.Tensor,
               mask: torch.Tensor | None = None, *, steps: int = 200, lr: float = 3e-3,
               batch: int = 512, slope: float = 50.0, margin: float = 0.005, seed: int = 0,
               val: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
               eval_every: int = 20, patience: int = 5) -> dict[str, Any]:
    """Stage II on traces: train a COPY of `gate` on hidden [N, R, H] (fp32) with labels from
    ce [N, R]; mask [N, R] marks usable rounds (all rounds in teacher mode).

    val = (hidden, ce, mask) of held-out tokens: the validation BCE is computed before
    training (the current gate) and every `eval_every` steps; the state of the best check is
    returned (early stopping after `patience` checks without improvement). Without `val` the
    last state is returned. Returns the state ({weight, bias}), the train BCE before/after
    (nats, all train tokens), val_before / val_after / best_step / val_curve."""
    new = torch.nn.Linear(gate.in_features, 1, bias=True)
    new.load_state_dict({k: v.detach().float().cpu() for k, v in gate.state_dict().items()})
    hidden, ce = hidden.float(), ce.float()
    mask = torch.ones_like(ce, dtype=torch.bool) if mask is None else mask.bool()
    target = 1.0 - stage2_targets(ce, slope, margin)   # BCE(1 - lambda, w) == BCE(g, 1 - w)
    if val is not None and len(val[0]) == 0:
        val = None
    if val is not None:
        vh, vce = val[0].float(), val[1].float()
        vm = torch.ones_like(vce, dtype=torch.bool) if val[2] is None else val[2].bool()
        vt = 1.0 - stage2_targets(vce, slope, margin)

    def val_loss() -> float:
        with torch.no_grad():
            return float(_stage2_bce(new, vh, vt, vm))

    n = hidden.shape[0]
    with torch.no_grad():
        before = float(_stage2_bce(new, hidden, target, mask)) if n else math.nan
    val_before = val_loss() if val is not None else None
    best, best_val, best_step, bad, curve, done = None, math.inf, 0, 0, [], 0
    opt = torch.optim.Adam(new.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, (steps if n else 0) + 1):
        idx = torch.randint(0, n, (min(batch, n),), generator=gen)
        opt.zero_grad()
        loss = _stage2_bce(new, hidden[idx], target[idx], mask[idx])
        loss.backward()
        opt.step()
        done = step
        if val is not None and (step % eval_every == 0 or step == steps):
            v = val_loss()
            curve.append([step, v])
            if v < best_val:
                best, best_val, best_step, bad = gate_state_of(new), v, step, 0
            else:
                bad += 1
                if bad >= patience:
                    break
    if best is not None:
        new.load_state_dict({"weight": best[GATE_WEIGHT], "bias": best[GATE_BIAS]})
    with torch.no_grad():
        after = float(_stage2_bce(new, hidden, target, mask)) if n else math.nan
    return {"state": gate_state_of(new),
            "loss_before": before, "loss_after": after, "tokens": n, "steps": steps,
            "steps_run": done, "best_step": best_step if val is not None else done,
            "val_tokens": int(len(val[0])) if val is not None else 0,
            "val_before": val_before, "val_after": best_val if best is not None else val_before,
            "val_curve": curve,
            "label_mean": float((1 - target)[mask].mean()) if n else math.nan}


def trace_gate_curve(gate_state: dict[str, torch.Tensor], hidden: torch.Tensor,
                     top1_id: torch.Tensor, ref_token: torch.Tensor, prompt_id: torch.Tensor,
                     thresholds: Sequence[float], min_loops: int = 1
                     ) -> list[tuple[float, list[float]]]:
    """Teacher-forced Q-exit curve of a gate on teacher-mode traces: per threshold, (mean exit
    round per token, per-prompt scores) with score_p = (agreeing tokens of prompt p) * P / N,
    so mean(score) = share of tokens whose exit round's top-1 equals the round-R token and the
    paired SE is clustered by prompt."""
    from rltlab.gates import q_exit_rounds

    logits = (hidden.float() @ gate_state[GATE_WEIGHT].float().T).squeeze(-1) \
        + gate_state[GATE_BIAS].float()
    uniq, which = torch.unique(prompt_id, return_inverse=True)
    n, p = len(prompt_id), len(uniq)
    points = []
    for t in thresholds:
        e = q_exit_rounds(logits, float(t), min_loops)
        agree = (top1_id.gather(1, (e - 1)[:, None]).squeeze(1) == ref_token).double()
        per = torch.zeros(p, dtype=torch.float64).index_add_(0, which, agree) * p / max(n, 1)
        points.append((float(e.float().mean()), per.tolist()))
    return points


def train_gate_on_traces(model, trace_dir: str | os.PathLike, cfg: LoopConfig) -> dict[str, Any]:
    """Stage II on one iteration's traces with a prompt-level validation split; decides
    whether the candidate is accepted (see the module docstring). "state" is the gate to push:
    the candidate if accepted, else the current gate ("candidate_state" is the trained one)."""
    from rltlab.eval.curves import compare_curves
    from rltlab.exit_predictor.train import split_by_prompt
    from rltlab.traces import load_traces, read_manifest

    manifest = read_manifest(trace_dir)
    if manifest["projection"] is not None or manifest["hidden_dim"] != model.config.hidden_size:
        raise ValueError("gate training needs full hidden states (no projection)")
    tr = load_traces(trace_dir, fields=["hidden", "logprob_ref", "round_mask", "prompt_id",
                                        "top1_id", "ref_token"])
    pid = tr["prompt_id"]
    n_prompts = len(torch.unique(pid))
    val_m = torch.zeros(len(pid), dtype=torch.bool)
    if cfg.gate_val_fraction > 0 and n_prompts >= 2:
        val_m = split_by_prompt(pid, (1 - cfg.gate_val_fraction, cfg.gate_val_fraction),
                                seed=cfg.seed)[1]
        if bool(val_m.all()):
            val_m[:] = False
    tr_m = ~val_m
    ce = -tr["logprob_ref"]
    current = gate_state_of(model.model.early_exit_gate)
    res = train_gate(model.model.early_exit_gate, tr["hidden"][tr_m], ce[tr_m],
                     tr["round_mask"][tr_m], steps=cfg.gate_steps, lr=cfg.gate_lr,
                     batch=cfg.gate_batch, slope=cfg.slope, margin=cfg.margin, seed=cfg.seed,
                     val=(tr["hidden"][val_m], ce[val_m], tr["round_mask"][val_m])
                     if bool(val_m.any()) else None,
                     eval_every=cfg.gate_eval_every, patience=cfg.gate_patience)
    res["val_prompts"] = int(len(torch.unique(pid[val_m]))) if bool(val_m.any()) else 0
    res["train_prompts"] = n_prompts - res["val_prompts"]
    reasons = []
    if res["val_tokens"]:
        args = (tr["hidden"][val_m], tr["top1_id"][val_m], tr["ref_token"][val_m], pid[val_m],
                cfg.thresholds, cfg.min_loops)
        cmp = compare_curves(trace_gate_curve(current, *args),
                             trace_gate_curve(res["state"], *args), z=cfg.curve_z)
        res["val_curve_check"] = {k: cmp[k] for k in ("no_worse", "worst_point", "points",
                                                      "n", "z")}
        if not res["val_after"] < res["val_before"]:
            reasons.append(f"validation Stage II BCE not lower ({res['val_after']:.5f} vs "
                           f"{res['val_before']:.5f} for the current gate)")
        if cmp["no_worse"] is False:
            w = cmp["worst_point"]
            reasons.append(f"validation quality-vs-depth curve worse (at {w['mean_rounds']:.3f} "
                           f"rounds {w['diff_pp']:+.2f} pp, SE {w['se_pp']:.2f})")
    else:
        res["val_curve_check"] = None
        reasons.append("no validation split (fewer than 2 rollout prompts or fraction 0): "
                       "not validated")
    res["validation_passed"] = bool(res["val_tokens"]) and not reasons
    res["accepted"] = res["validation_passed"] or cfg.gate_keep_worse or not res["val_tokens"]
    res["reasons"] = reasons
    res["candidate_state"] = res["state"]
    if not res["accepted"]:
        res["state"] = current
    return res


# ----------------------------------------------------------------------------- weights

def push_weights(llm, model, gate_state: dict[str, torch.Tensor], version: int,
                 chunk: int = 64) -> int:
    """Send the model's parameters with the gate replaced through the weight-update API.

    The engine's finish_weight_update requires every parameter, so the unchanged ones are sent
    too (in chunks of `chunk` tensors). Returns the engine's new version.
    """
    named = [(name, gate_state.get(name, p.detach())) for name, p in model.named_parameters()]
    llm.start_weight_update(version)
    for i in range(0, len(named), chunk):
        llm.update_weights(named[i:i + chunk])
    new_version = llm.finish_weight_update()
    engine_model = getattr(getattr(llm, "llm_engine", llm), "model", model)
    if engine_model is not model:   # the engine holds a converted copy: keep ours in step
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in gate_state.items():
                params[name].copy_(tensor)
    return new_version


def save_gate(path: Path, gate_state: dict[str, torch.Tensor], version: int) -> None:
    safetensors.torch.save_file({k: v.contiguous().float() for k, v in gate_state.items()},
                                str(path), metadata={"weight_version": str(version)})


def load_gate(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


# ----------------------------------------------------------------------------- the loop

def iteration_dir(run_dir: str | os.PathLike, k: int) -> Path:
    return Path(run_dir) / f"iter_{k}"


def finished_iterations(run_dir: str | os.PathLike) -> list[int]:
    """Indices k with a complete iter_k/ (result.json present), contiguous from 0."""
    done = []
    k = 0
    while (iteration_dir(run_dir, k) / "result.json").is_file():
        done.append(k)
        k += 1
    return done


@dataclass
class LoopState:
    run_dir: Path
    cfg: LoopConfig
    model: Any
    tokenizer: Any
    llm: Any
    model_dir: Path | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)


def setup(run_dir: str | os.PathLike, model, tokenizer, cfg: LoopConfig,
          model_dir: str | os.PathLike | None = None, **engine_kwargs) -> LoopState:
    """Engine at version 0 over `model`, then resume: load finished iterations and push the
    last finished gate as its version. Stale temporary iteration dirs are removed."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(".iter_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    write_json_atomic(run_dir / "loop_config.json", asdict(cfg))
    llm = W.make_llm(model, tokenizer, **engine_kwargs)
    state = LoopState(run_dir, cfg, model, tokenizer, llm,
                      Path(model_dir) if model_dir else None)
    state.problems = W.eval_problems(state.model_dir, cfg.eval_problems)
    done = finished_iterations(run_dir)
    state.results = [read_json(iteration_dir(run_dir, k) / "result.json") for k in done]
    state.resumed_from = len(done)
    if done:
        last = done[-1]
        gate = load_gate(iteration_dir(run_dir, last) / "gate.safetensors")
        push_weights(llm, model, gate, last + 1)
    return state


def evaluate(state: LoopState, label: str, reuse: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """Q-exit threshold sweep at the engine's current version on the held-out problems.
    With cfg.reuse_full_depth, the threshold-1.0 row (fixed depth R: the gate is never asked,
    and only the gate changes between versions) is copied from `reuse` (an earlier
    evaluation of the same problems) instead of being generated again."""
    cfg = state.cfg
    full = [t for t in cfg.thresholds if float(t) >= 1.0]
    carried = None
    if cfg.reuse_full_depth and reuse is not None and full:
        carried = next((r for r in reuse["rows"] if r.get("threshold") is not None
                        and r["threshold"] >= 1.0), None)
    thresholds = [t for t in cfg.thresholds if carried is None or float(t) < 1.0]
    rows, scores = W.evaluate_policies(state.llm, state.tokenizer, state.problems,
                                       thresholds=thresholds, max_tokens=cfg.max_tokens,
                                       min_loops=cfg.min_loops, label=label)
    version = state.llm.get_weight_version()
    if carried is not None:
        more = carry_evaluation({"rows": [carried], "scores": reuse["scores"]}, label, version)
        rows += more["rows"]
        scores.update(more["scores"])
    return {"version": version, "rows": rows, "scores": scores}


def carry_evaluation(ev: dict[str, Any], label: str, version: int) -> dict[str, Any]:
    """An evaluation's rows relabeled for `version` without generating: for weights that
    generate exactly the same (greedy, same problems), e.g. a rejected gate update that pushed
    the unchanged gate again. Rows keep `carried_from_version` (the version that generated)."""
    rows, scores = [], {}
    for r in ev["rows"]:
        key = f"{label} q_exit {r['setting']}"
        rows.append({**r, "policy": f"{label} q_exit", "key": key, "weight_version": version,
                     "seconds": 0.0,
                     "carried_from_version": r.get("carried_from_version", r["weight_version"])})
        scores[key] = ev["scores"][r["key"]]
    return {"version": version, "rows": rows, "scores": scores}


def _held_out_overlap(problems: Sequence[dict], rollout_problems: Sequence[dict]) -> int:
    held = {p["question"] for p in problems}
    return sum(p["question"] in held for p in rollout_problems)


def _curve_points(ev: dict[str, Any]) -> list[tuple[float, list[float]]]:
    """(mean executed rounds, per-problem scores) of the Q-exit rows of an evaluation."""
    return [(r["mean_rounds"], ev["scores"][r["key"]]) for r in ev["rows"]
            if r.get("threshold") is not None and r["mean_rounds"] is not None
            and not math.isnan(r["mean_rounds"])]


def compare_evaluations(before: dict[str, Any], after: dict[str, Any], z: float = 2.0
                        ) -> dict[str, Any]:
    """Paired Pareto-curve comparison (rltlab.eval.curves) of two Q-exit sweeps."""
    from rltlab.eval.curves import compare_curves

    res = compare_curves(_curve_points(before), _curve_points(after), z=z)
    return {"before_version": before["version"], "after_version": after["version"], **res}


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
        before = state.results[-1]["after"] if state.results else evaluate(state, f"v{k}")
        prompts, rollout_problems = W.rollout_prompts(state.tokenizer, cfg.rollout_prompts,
                                                      seed=cfg.seed * 1000 + k)
        overlap = _held_out_overlap(state.problems, rollout_problems)
        if overlap:
            raise RuntimeError(f"{overlap} rollout prompts are in the held-out evaluation set")
        outs, manifest = W.collect_rollout_traces(
            llm, prompts, tmp / "traces", threshold=cfg.rollout_threshold,
            max_tokens=cfg.max_tokens, teacher=True, temperature=cfg.temperature,
            seed=cfg.seed + k, min_loops=cfg.min_loops, hidden_dtype=cfg.hidden_dtype,
            info={"iteration": k})
        rollout_versions = sorted({v for o in outs for v in o.outputs[0].weight_versions})
        trained = train_gate_on_traces(state.model, tmp / "traces", cfg)
        if k == cfg.crash_at_iteration:
            raise SimulatedCrash(f"simulated crash in iteration {k} (CRASH_AT_ITERATION)")
        addons: dict[str, Any] = {}
        if cfg.train_exit_predictor:
            addons["exit_predictor"] = exit_predictor_step(state, k, tmp, before)
        if cfg.train_draft_head:
            addons["draft_head"] = draft_head_step(state, k, tmp)
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
        summary = W.trace_summary(tmp / "traces")
        result = {
            "iteration": k, "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(time.perf_counter() - t0, 3),
            "rollout_weight_versions": rollout_versions,
            "trace_weight_versions": sorted({v for s in manifest["shards"]
                                             for v in s["weight_versions"]}),
            "trace_model_hashes": manifest.get("info", {}).get("model_hashes", {}),
            "trace_tokens": manifest["num_tokens"], "new_weight_version": new_version,
            "heldout_overlap_with_rollouts": overlap,
            "gate_training": {k2: v for k2, v in trained.items()
                              if k2 not in ("state", "candidate_state")},
            "trace_mean_selected": summary["mean_selected"],
            "config": asdict(cfg), "before": before, "after": after,
            "gate_curve": compare_evaluations(before, after, cfg.curve_z), **addons}
        write_json_atomic(tmp / "result.json", result)
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

    def f(x):
        return "n/a" if x is None else f"{x:.4f}"
    line = (f"iteration {res['iteration']} ({took}): rollout at v{res['rollout_weight_versions']}, "
            f"{res['trace_tokens']} traced tokens; gate BCE train {f(g['loss_before'])} -> "
            f"{f(g['loss_after'])}, validation {f(g.get('val_before'))} -> "
            f"{f(g.get('val_after'))} (best step {g.get('best_step')}), "
            f"{'accepted' if g.get('accepted', True) else 'REJECTED: ' + '; '.join(g['reasons'])}"
            f"; now v{res['new_weight_version']}; held-out curve no worse: "
            f"{res.get('gate_curve', {}).get('no_worse')}")
    ep, dh = res.get("exit_predictor"), res.get("draft_head")
    if ep:
        cal = next((r for r in ep["rows"] if r.get("calibrated")), ep["rows"][0])
        line += (f"\n  N+{ep['exit_round'] - ep['decision_round']} predictor (v{ep['weight_version']}"
                 f"): {cal['quality']:.1f}% at {cal['mean_rounds']:.3f} rounds "
                 f"(threshold {ep['threshold']:.3f})")
    if dh:
        line += (f"\n  draft head {dh['kind']} (v{dh['weight_version']}): tau {dh['tau']:.2f} vs "
                 f"{dh['tau_shallow']:.2f} untrained d={dh['draft_rounds']}, acceptance "
                 f"{dh['acceptance']:.3f} vs {dh['acceptance_shallow']:.3f}")
    return line


# ----------------------------------------------------------------------------- add-ons

def _engine_params(policy: str, args: dict[str, Any], max_tokens: int, min_loops: int = 1):
    from rltlab.data import EOT_ID
    from rltlab.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, min_loops=min_loops,
                          exit_policy=policy, exit_policy_args=dict(args),
                          stop_token_ids=[EOT_ID])


def exit_predictor_step(state: LoopState, k: int, tmp: Path, before: dict[str, Any]
                        ) -> dict[str, Any]:
    """Train the N+k lookahead predictor on iteration k's teacher-mode traces (prompt split
    70/15/15, calibration, threshold for the target precision: rltlab.exit_predictor.train),
    install it in the engine (checked against the model at version k) and evaluate it in real
    generation on the held-out problems at version k: quality, mean executed rounds, paired
    difference vs full depth and vs the version-k Q-exit Pareto curve at the same rounds."""
    from rltlab.checkpoint import model_hash
    from rltlab.engine_patches.lookahead_exit import install
    from rltlab.eval.curves import curve_scores_at, pareto_curve
    from rltlab.eval.metrics import paired_difference
    from rltlab.eval.tasks import engine_generate_fn, evaluate_arithmetic
    from rltlab.exit_predictor.train import train_from_traces

    cfg, llm = state.cfg, state.llm
    t0 = time.perf_counter()
    mhash = model_hash(state.model)
    trained = train_from_traces(
        tmp / "traces", tmp / "exit_predictor", rounds=[cfg.predictor_decision_round],
        k=cfg.predictor_k, label=cfg.predictor_label, kind=cfg.predictor_kind,
        epochs=cfg.predictor_epochs, target_precision=cfg.predictor_target_precision,
        seed=cfg.seed, weight_version=k, cpu=True)
    entry = trained["per_round"][0]
    ckpt = Path(entry["checkpoint"])
    name = f"loop_n_plus_{cfg.predictor_k}_v{k}"
    install(state.model, ckpt, name=name, model_hash=mhash)     # refuses another model/gate
    label = f"v{k} n_plus_{cfg.predictor_k}"
    thr = round(float(entry["threshold"]), 4)
    full = next((r for r in before["rows"] if r.get("threshold") is not None
                 and r["threshold"] >= 1.0), None)
    bx, bs, _ = pareto_curve(_curve_points(before))
    rows = []
    R = state.model.config.num_rounds
    for t in sorted({thr} | {float(x) for x in cfg.lookahead_thresholds}):
        start = time.perf_counter()
        res = evaluate_arithmetic(engine_generate_fn(llm, _engine_params(
            name, {"threshold": t}, cfg.max_tokens)), state.tokenizer, state.problems,
            num_rounds=R)
        row = {"policy": label, "setting": f"p>={t:g}", "threshold": None, "depth": None,
               "lookahead_threshold": t, "calibrated": t == thr,
               "quality": 100 * res["exact_match"], "quality_se": 100 * res["exact_match_se"],
               "mean_rounds": res.get("mean_executed", math.nan),
               "mean_selected": res.get("mean_selected", math.nan),
               "decode_tokens": res.get("decode_tokens", 0),
               "weight_version": llm.get_weight_version(),
               "executed_hist": res.get("executed_hist", {}),
               "seconds": round(time.perf_counter() - start, 3), "key": f"{label} p>={t:g}"}
        if full is not None:
            d = paired_difference(res["scores"], before["scores"][full["key"]])
            row.update(diff_vs_full_pp=100 * d.diff, diff_vs_full_se_pp=100 * d.se)
        x = row["mean_rounds"]
        if x is not None and not math.isnan(x) and x >= bx[0]:
            d = paired_difference(res["scores"], curve_scores_at(bx, bs, x))
            row.update(q_exit_quality_at_same_rounds=100 * d.mean_b,
                       diff_vs_q_exit_pp=100 * d.diff, diff_vs_q_exit_se_pp=100 * d.se)
        row["scores"] = res["scores"]
        rows.append(row)
    test = entry["test"]
    return {"checkpoint": str(ckpt.relative_to(tmp)), "policy_name": name,
            "weight_version": k, "model_hash": mhash,
            "decision_round": entry["decision_round"], "exit_round": entry["exit_round"],
            "label": cfg.predictor_label, "kind": cfg.predictor_kind,
            "temperature": entry["temperature"], "threshold": entry["threshold"],
            "target_reached": entry["target_reached"], "split_tokens": trained["split_tokens"],
            "test": {k2: test.get(k2) for k2 in ("tokens", "label_rate", "precision", "recall",
                                                 "auc", "fire_rate", "expected_rounds",
                                                 "oracle_rounds")},
            "rows": rows, "seconds": round(time.perf_counter() - t0, 3)}


def draft_head_step(state: LoopState, k: int, tmp: Path) -> dict[str, Any]:
    """Distil the loop-aware draft head on iteration k's traces: inputs h_d, targets
    p_R = softmax(lm_head(h_R)) of every traced decode token (prompt split 80/20 for the
    held-out agreement); save it (draft_component.json records version k and its model hash),
    reload it through rltlab.engine_patches.loop_draft (compatibility check) and measure greedy
    speculative decoding on held-out arithmetic prompts against target-only decoding and the
    untrained shallow drafter at the same d: tau, acceptance, identical output, speed."""
    from rltlab.checkpoint import model_hash
    from rltlab.data import EOT_ID
    from rltlab.draft_heads import build_component, save_component
    from rltlab.draft_heads.evaluate import measure
    from rltlab.draft_heads.heads import component_kwargs
    from rltlab.draft_heads.train import distill_features, token_agreement
    from rltlab.engine_patches.loop_draft import load_draft_component
    from rltlab.exit_predictor.train import split_by_prompt
    from rltlab.traces import load_traces, read_manifest

    cfg, model = state.cfg, state.model
    t0 = time.perf_counter()
    R, d = model.config.num_rounds, cfg.draft_rounds
    tr = load_traces(tmp / "traces", fields=["hidden", "prompt_id"])
    with torch.no_grad():
        target = torch.log_softmax(model.lm_head(tr["hidden"][:, R - 1].float()).float(), -1)
    h = tr["hidden"][:, d - 1].float()
    val_m = torch.zeros(len(h), dtype=torch.bool)
    if len(torch.unique(tr["prompt_id"])) >= 2:
        val_m = split_by_prompt(tr["prompt_id"], (0.8, 0.2), seed=cfg.seed)[1]
    tr_m = ~val_m
    torch.manual_seed(cfg.seed)
    comp = build_component(cfg.draft_kind, model, draft_rounds=d)
    with torch.no_grad():
        shallow = token_agreement(model.lm_head(h[val_m]), target[val_m])
    log = distill_features(comp, h[tr_m], target[tr_m], steps=cfg.draft_steps, lr=cfg.draft_lr,
                           seed=cfg.seed, val=(h[val_m], target[val_m]),
                           log_every=max(1, cfg.draft_steps // 10), model=model)
    with torch.no_grad():
        trained_agree = token_agreement(comp(h[val_m]), target[val_m])
    mhash = model_hash(model)
    manifest = read_manifest(tmp / "traces")
    path = save_component(comp, model, tmp / "draft_head", {
        "weight_version": k, "iteration": k, "train_log": log,
        "trained_on": {"traces": "traces", "tokens": int(tr_m.sum()),
                       "trace_weight_versions": sorted({v for s in manifest["shards"]
                                                        for v in s["weight_versions"]}),
                       "trace_model_hashes": manifest.get("info", {}).get("model_hashes")}})
    comp = load_draft_component(path, model, draft_rounds=d)    # checks hash, sizes, d
    prompts = [[EOT_ID] + W.encode(state.tokenizer, p["question"])
               for p in state.problems[:cfg.draft_prompts]]
    trained_name, shallow_name = f"{cfg.draft_kind} d={d}", f"shallow d={d}"
    speed = measure(model, prompts, {shallow_name: {"draft_rounds": d},
                                     trained_name: component_kwargs(comp)},
                    temperature=0.0, concurrency=cfg.draft_concurrency, k=cfg.draft_k,
                    max_tokens=cfg.draft_max_tokens, repeats=1)
    by = {r["config"]: r for r in speed}
    return {"component": str(path.relative_to(tmp)), "kind": cfg.draft_kind, "draft_rounds": d,
            "weight_version": k, "model_hash": mhash, "train_tokens": int(tr_m.sum()),
            "heldout_agreement": {"shallow": shallow, "trained": trained_agree},
            "train_log": log, "best_step": log[-1].get("best_step", cfg.draft_steps),
            "speed": speed, "k": cfg.draft_k, "prompts": len(prompts),
            "tau": by[trained_name]["tau"], "acceptance": by[trained_name]["acceptance"],
            "tau_shallow": by[shallow_name]["tau"],
            "acceptance_shallow": by[shallow_name]["acceptance"],
            "tau_gain": by[trained_name]["tau"] - by[shallow_name]["tau"],
            "identical_at_t0": all(r["identical"] for r in speed),
            "speedup_vs_target": by[trained_name]["speedup_vs_target"],
            "speedup_vs_shallow": by[trained_name]["tok_s"] / by[shallow_name]["tok_s"],
            "seconds": round(time.perf_counter() - t0, 3)}


# ----------------------------------------------------------------------------- metrics

def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("executed_hist", "scores")}


def curves(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quality-vs-depth rows of version 0 ("before" of iteration 0), every "after", and the
    lookahead predictor of every iteration that trained one (at the iteration's version)."""
    rows = []
    if results:
        rows += results[0]["before"]["rows"]
    for res in results:
        rows += (res.get("exit_predictor") or {}).get("rows", [])
        rows += res["after"]["rows"]
    return [_strip(r) for r in rows]


def depth_histograms(results: Sequence[dict[str, Any]], threshold: float
                     ) -> dict[str, dict[int, int]]:
    """Executed-depth histograms (first output token excluded) of the Q-exit at the swept
    threshold nearest to `threshold`, per weight version (version 0 and every "after")."""
    evals = ([results[0]["before"]] if results else []) + [r["after"] for r in results]
    swept = sorted({row["threshold"] for ev in evals for row in ev["rows"]
                    if row.get("threshold") is not None})
    if not swept:
        return {}
    t = min(swept, key=lambda x: abs(x - threshold))
    out = {}
    for ev in evals:
        for row in ev["rows"]:
            if row.get("threshold") == t:
                out[f"v{row['weight_version']} t={t:g}"] = {
                    int(k): v for k, v in row["executed_hist"].items()}
    return out


def gate_curve_report(results: Sequence[dict[str, Any]], z: float = 2.0) -> dict[str, Any]:
    """The issue-#5 check: the final gate's Q-exit Pareto curve on the held-out problems vs
    version 0's, and every iteration's after vs before (rltlab.eval.curves rule)."""
    if not results:
        return {"no_worse": None, "why": "no iterations"}
    final = compare_evaluations(results[0]["before"], results[-1]["after"], z)
    per = [compare_evaluations(r["before"], r["after"], z) for r in results]
    return {"rule": final["rule"], "z": z, "eval_problems": final["n"],
            "heldout_overlap_with_rollouts": sum(r.get("heldout_overlap_with_rollouts", 0)
                                                 for r in results),
            "final_vs_v0": final, "per_iteration": per,
            "no_worse": final["no_worse"],
            "no_worse_every_iteration": all(p["no_worse"] is True for p in per),
            "gates_accepted": [r["gate_training"].get("accepted", True) for r in results]}


def _predictor_summary(r: dict[str, Any]) -> dict[str, Any] | None:
    ep = r.get("exit_predictor")
    if not ep:
        return None
    cal = next((x for x in ep["rows"] if x.get("calibrated")), ep["rows"][0])
    return {"weight_version": ep["weight_version"], "model_hash": ep["model_hash"],
            "checkpoint": ep["checkpoint"], "threshold": ep["threshold"],
            "temperature": ep["temperature"], "test": ep["test"],
            "quality": cal["quality"], "mean_rounds": cal["mean_rounds"],
            "diff_vs_full_pp": cal.get("diff_vs_full_pp"),
            "diff_vs_full_se_pp": cal.get("diff_vs_full_se_pp"),
            "q_exit_quality_at_same_rounds": cal.get("q_exit_quality_at_same_rounds"),
            "diff_vs_q_exit_pp": cal.get("diff_vs_q_exit_pp"),
            "diff_vs_q_exit_se_pp": cal.get("diff_vs_q_exit_se_pp"), "seconds": ep["seconds"]}


def _draft_summary(r: dict[str, Any]) -> dict[str, Any] | None:
    dh = r.get("draft_head")
    if not dh:
        return None
    keys = ("weight_version", "model_hash", "component", "kind", "draft_rounds", "k", "prompts",
            "train_tokens", "best_step", "tau", "acceptance", "tau_shallow", "acceptance_shallow",
            "tau_gain", "identical_at_t0", "speedup_vs_target", "speedup_vs_shallow", "seconds")
    return {**{k: dh.get(k) for k in keys},
            "heldout_agree": dh["heldout_agreement"]["trained"]["agree"],
            "heldout_agree_shallow": dh["heldout_agreement"]["shallow"]["agree"]}


def loop_metrics(state: LoopState) -> dict[str, Any]:
    res = state.results
    per_iter = []
    for r in res:
        g = r["gate_training"]
        per_iter.append({
            "iteration": r["iteration"], "rollout_weight_versions": r["rollout_weight_versions"],
            "trace_weight_versions": r["trace_weight_versions"],
            "new_weight_version": r["new_weight_version"], "trace_tokens": r["trace_tokens"],
            "gate_loss_before": g["loss_before"], "gate_loss_after": g["loss_after"],
            "gate_val_loss_before": g.get("val_before"), "gate_val_loss_after": g.get("val_after"),
            "gate_best_step": g.get("best_step"), "gate_accepted": g.get("accepted", True),
            "gate_validation_passed": g.get("validation_passed"),
            "gate_reasons": g.get("reasons", []),
            "exit_predictor": _predictor_summary(r), "draft_head": _draft_summary(r),
            "started": r["started"], "seconds": r["seconds"]})
    headline = {"iterations": len(res), "final_weight_version": state.llm.get_weight_version()}
    gate_curve = gate_curve_report(res, state.cfg.curve_z)
    if res:
        def best(rows):  # quality at the lowest threshold's mean depth
            first = min((x for x in rows if x.get("threshold") is not None),
                        key=lambda x: x["threshold"])
            return first["quality"], first["mean_rounds"]
        q0, d0 = best(res[0]["before"]["rows"])
        q1, d1 = best(res[-1]["after"]["rows"])
        headline.update({"quality_v0_lowest_t": q0, "mean_rounds_v0_lowest_t": d0,
                         "quality_final_lowest_t": q1, "mean_rounds_final_lowest_t": d1,
                         "gate_curve_no_worse": gate_curve["no_worse"]})
        worst = gate_curve["final_vs_v0"].get("worst_point")
        if worst:
            headline.update(gate_curve_worst_diff_pp=worst["diff_pp"],
                            gate_curve_worst_se_pp=worst["se_pp"],
                            gate_curve_worst_at_rounds=worst["mean_rounds"])
        last_p = _predictor_summary(res[-1])
        if last_p:
            headline.update(lookahead_quality=last_p["quality"],
                            lookahead_mean_rounds=last_p["mean_rounds"])
        last_d = _draft_summary(res[-1])
        if last_d:
            headline.update(draft_tau=last_d["tau"], draft_tau_shallow=last_d["tau_shallow"])
    return {"headline": headline, "iterations": per_iter, "curves": curves(res),
            "gate_curve": gate_curve, "resumed_from": state.resumed_from,
            "eval_problems": len(state.problems), "config": asdict(state.cfg)}
