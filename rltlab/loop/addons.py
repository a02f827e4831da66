"""Optional update steps of an iteration: the N+k lookahead predictor and the draft head."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from rltlab.loop import tasks
from rltlab.loop.config import LoopState
from rltlab.loop.metrics import curve_points, quality_by_kind


def _engine_params(policy: str, args: dict[str, Any], max_tokens: int, min_loops: int = 1,
                   stop: list[str] | None = None):
    from rltlab.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, min_loops=min_loops,
                          exit_policy=policy, exit_policy_args=dict(args), stop=stop or [])


def exit_predictor_step(state: LoopState, k: int, tmp: Path, before: dict[str, Any]
                        ) -> dict[str, Any]:
    """Train the N+k lookahead predictor on iteration k's teacher-mode traces (prompt split
    70/15/15, calibration, threshold for the target precision: rltlab.exit_predictor.train),
    install it in the engine (checked against the model at version k) and evaluate it in real
    generation on the held-out problems at version k: quality, mean executed rounds, paired
    difference vs full depth and vs the version-k Q-exit Pareto curve at the same mean rounds
    (interpolated along it: linear between neighbouring Pareto-front points, flat right of the
    last; rltlab.eval.curves.curve_scores_at). Each row records its tok/s and the share of
    decode tokens the predictor fired on (they ran exactly N + k rounds)."""
    from rltlab.engine_patches.lookahead_exit import install
    from rltlab.exit_predictor.train import train_from_traces

    cfg = state.cfg
    t0 = time.perf_counter()
    mhash = state.model_hash()
    trained = train_from_traces(
        tmp / "traces", tmp / "exit_predictor", rounds=[cfg.predictor_decision_round],
        k=cfg.predictor_k, label=cfg.predictor_label, kind=cfg.predictor_kind,
        epochs=cfg.predictor_epochs, target_precision=cfg.predictor_target_precision,
        seed=cfg.seed, weight_version=k, cpu=_device(state.model).type != "cuda")
    entry = trained["per_round"][0]
    ckpt = Path(entry["checkpoint"])
    name = f"loop_n_plus_{cfg.predictor_k}_v{k}"
    install(state.model, ckpt, name=name, model_hash=mhash)     # refuses another model/gate
    label = f"v{k} n_plus_{cfg.predictor_k}"
    thr = round(float(entry["threshold"]), 4)
    rows = [lookahead_row(state, name, t, label, before, entry["exit_round"], t == thr)
            for t in sorted({thr} | {float(x) for x in cfg.lookahead_thresholds})]
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
            "train_label_rate": entry["train"]["label_rate"],
            "q_exit_comparison": "interpolated along the version's Q-exit Pareto curve at the "
                                 "predictor's mean executed rounds",
            "rows": rows, "seconds": round(time.perf_counter() - t0, 3)}


def lookahead_row(state: LoopState, name: str, threshold: float, label: str,
                  before: dict[str, Any], exit_round: int, calibrated: bool) -> dict[str, Any]:
    """Real generation of the installed lookahead policy `name` at `threshold` on the held-out
    problems (the engine at its current version): quality, mean executed rounds, tok/s, the
    share of decode tokens it fired on (they ran exactly `exit_round` rounds), paired difference
    vs full depth and vs the Q-exit Pareto curve of `before` at the same mean rounds."""
    from rltlab.eval.curves import curve_scores_at, pareto_curve
    from rltlab.eval.metrics import paired_difference
    from rltlab.eval.tasks import engine_generate_fn

    cfg, llm = state.cfg, state.llm
    R = state.model.config.num_rounds
    full = next((r for r in before["rows"] if r.get("threshold") is not None
                 and r["threshold"] >= 1.0), None)
    start = time.perf_counter()
    res = tasks.score(engine_generate_fn(llm, _engine_params(
        name, {"threshold": threshold}, cfg.max_tokens, stop=tasks.stop(cfg))),
        state.tokenizer, state.problems, cfg, R, llm.llm_engine.eos_token_id)
    seconds = time.perf_counter() - start
    hist = {int(d): n for d, n in res.get("executed_hist", {}).items()}
    shown = f"p>={round(threshold, 4):g}"   # as notebook 02 shows a calibrated threshold
    row = {"policy": label, "setting": shown, "threshold": None, "depth": None,
           "lookahead_threshold": threshold, "calibrated": calibrated,
           "quality": 100 * res["exact_match"], "quality_se": 100 * res["exact_match_se"],
           "mean_rounds": res.get("mean_executed", math.nan),
           "mean_selected": res.get("mean_selected", math.nan),
           "decode_tokens": res.get("decode_tokens", 0),
           "weight_version": llm.get_weight_version(),
           "executed_hist": res.get("executed_hist", {}),
           "fire_rate": hist.get(exit_round, 0) / max(1, sum(hist.values()))
           if exit_round < R else None,
           "seconds": round(seconds, 3), "tokens_per_s": res["output_tokens"] / seconds,
           "key": f"{label} {shown}"}
    if full is not None:
        d = paired_difference(res["scores"], before["scores"][full["key"]])
        row.update(diff_vs_full_pp=100 * d.diff, diff_vs_full_se_pp=100 * d.se)
    x = row["mean_rounds"]
    # vs this version's Q-exit, and vs the stock gate's (version 0's sweep of this run): an
    # updated gate's sweep may start above the predictor's mean rounds (null then)
    stock = state.results[0]["before"] if state.results else before
    for name, ev in (("q_exit", before), ("stock_q_exit", stock)):
        cx, cs, _ = pareto_curve(curve_points(ev))
        if x is not None and not math.isnan(x) and len(cx) and x >= cx[0]:
            d = paired_difference(res["scores"], curve_scores_at(cx, cs, x))
            row.update({f"{name}_quality_at_same_rounds": 100 * d.mean_b,
                        f"diff_vs_{name}_pp": 100 * d.diff, f"diff_vs_{name}_se_pp": 100 * d.se,
                        f"diff_vs_{name}_z": d.diff / d.se if d.se > 0 else None})
    row["quality_by_kind"] = quality_by_kind(res["scores"], state.problems)
    row["scores"] = res["scores"]
    return row


def _device(model) -> torch.device:
    return next(model.parameters()).device


class _Fp32Head(torch.nn.Module):
    """What a draft component is built and distilled on where the model is not fp32 (bf16 on a
    GPU): the model's config and a frozen fp32 copy of its lm_head on its device. The saved
    component is then loaded onto the model itself (load_draft_component: its dtype)."""

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        weight = model.lm_head.weight
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                       device=weight.device, dtype=torch.float32)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.float())
        self.lm_head.requires_grad_(False)


def draft_head_step(state: LoopState, k: int, tmp: Path) -> dict[str, Any]:
    """Distil the loop-aware draft head on iteration k's traces: inputs h_d, targets
    p_R = softmax(lm_head(h_R)) of every traced decode token (prompt split 80/20 for the
    held-out agreement); save it (draft_component.json records version k and its model hash),
    reload it through rltlab.engine_patches.loop_draft (compatibility check) and measure greedy
    speculative decoding on held-out word problems against target-only decoding and the
    untrained shallow drafter at the same d: tau, acceptance, identical output, speed."""
    from rltlab.draft_heads import build_component, save_component
    from rltlab.draft_heads.evaluate import measure
    from rltlab.draft_heads.heads import component_kwargs
    from rltlab.draft_heads.train import distill_features, token_agreement
    from rltlab.engine_patches.loop_draft import load_draft_component, read_metadata
    from rltlab.exit_predictor.train import split_by_prompt
    from rltlab.traces import load_traces, read_manifest

    cfg, model = state.cfg, state.model
    t0 = time.perf_counter()
    R, d = model.config.num_rounds, cfg.draft_rounds
    device = _device(model)
    # distilled in fp32 on the model's device: the model itself where it is fp32, else a
    # frozen fp32 copy of its lm_head (the saved head is loaded onto the model below)
    base = model if next(model.parameters()).dtype == torch.float32 else _Fp32Head(model)
    tr = load_traces(tmp / "traces", fields=["hidden", "prompt_id"])
    with torch.no_grad():
        target = torch.log_softmax(base.lm_head(tr["hidden"][:, R - 1].to(device, torch.float32))
                                   .float(), -1)
    h = tr["hidden"][:, d - 1].to(device, torch.float32)
    val_m = torch.zeros(len(h), dtype=torch.bool)
    if len(torch.unique(tr["prompt_id"])) >= 2:
        val_m = split_by_prompt(tr["prompt_id"], (0.8, 0.2), seed=cfg.seed)[1]
    tr_m = ~val_m
    val_m, tr_m = val_m.to(device), tr_m.to(device)
    torch.manual_seed(cfg.seed)
    comp = build_component(cfg.draft_kind, base, draft_rounds=d)
    with torch.no_grad():
        shallow = token_agreement(base.lm_head(h[val_m]), target[val_m])
    log = distill_features(comp, h[tr_m], target[tr_m], steps=cfg.draft_steps, lr=cfg.draft_lr,
                           seed=cfg.seed, val=(h[val_m], target[val_m]),
                           log_every=max(1, cfg.draft_steps // 10), model=base)
    with torch.no_grad():
        trained_agree = token_agreement(comp(h[val_m]), target[val_m])
    mhash = state.model_hash()
    manifest = read_manifest(tmp / "traces")
    path = save_component(comp, model, tmp / "draft_head", {
        "weight_version": k, "iteration": k, "train_log": log,
        "trained_on": {"traces": "traces", "tokens": int(tr_m.sum()),
                       "trace_weight_versions": sorted({v for s in manifest["shards"]
                                                        for v in s["weight_versions"]}),
                       "trace_model_hashes": manifest.get("info", {}).get("model_hashes")}})
    # checks sizes and d; the hash save_component recorded against the version's (computed once)
    comp = load_draft_component(path, model, draft_rounds=d, check_hash=False)
    recorded = read_metadata(path).get("base_model_hash")
    if recorded != mhash:
        raise ValueError(f"{path}: draft component recorded base model hash {recorded}, the "
                         f"model at version {k} hashes to {mhash}")
    prompts = [tasks.prompt_ids(state.tokenizer, cfg, p)
               for p in tasks.draft_problems(cfg, state.model_dir)]
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


