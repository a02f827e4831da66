"""The rollout -> gate update -> evaluate loop (notebook 10_rollout_update_evaluate).

Iteration k (weight version k in the engine):
  1. rollout: generate on training-split arithmetic prompts with the stock Q-exit, collecting
     traces in teacher mode (all R rounds per token, so every round has a Stage II label);
  2. update: Stage II gate-only training of the exit gate on those traces (REFERENCE
     section 1): CE_r = -log p_r(round-R token), I_r = max(0, CE_{r-1} - CE_r),
     w_r = sigmoid(slope (I_r - margin)), BCE between 1 - lambda_r and w_r; round 1 takes w_2
     (the convention of rltlab.pretrain.stage2_loss, which trains the embedded model's gate);
  3. push: the new gate through the engine's weight-update API as version k + 1
     (start_weight_update / update_weights / finish_weight_update);
  4. evaluate: quality vs mean executed rounds of the Q-exit threshold sweep at version k + 1
     ("after"; "before" is version k: computed for k = 0, carried over after that).

Checkpoints: everything of iteration k is built in RUN_DIR/.iter_k.tmp-*/ and renamed to
RUN_DIR/iter_k/ once complete (result.json, gate.safetensors, traces/). A finished iteration
is never recomputed: a re-run (same RUN_DIR) loads iter_0..iter_{j} and resumes at j + 1 after
pushing the last finished gate into the engine. A crash leaves only a temporary directory,
removed on the next run.
"""
from __future__ import annotations

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
    temperature: float = 0.0
    seed: int = 0
    hidden_dtype: str = "float32"
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


def train_gate(gate: torch.nn.Linear, hidden: torch.Tensor, ce: torch.Tensor,
               mask: torch.Tensor | None = None, *, steps: int = 200, lr: float = 3e-3,
               batch: int = 512, slope: float = 50.0, margin: float = 0.005, seed: int = 0
               ) -> dict[str, Any]:
    """Stage II on traces: train a COPY of `gate` on hidden [N, R, H] (fp32) with labels from
    ce [N, R]; mask [N, R] marks usable rounds (all rounds in teacher mode). Returns the new
    gate state ({weight, bias}) and the loss before/after (nats, full data)."""
    new = torch.nn.Linear(gate.in_features, 1, bias=True)
    new.load_state_dict({k: v.detach().float().cpu() for k, v in gate.state_dict().items()})
    hidden, ce = hidden.float(), ce.float()
    mask = torch.ones_like(ce, dtype=torch.bool) if mask is None else mask.bool()
    target = 1.0 - stage2_targets(ce, slope, margin)   # BCE(1 - lambda, w) == BCE(g, 1 - w)

    def loss_on(idx=None):
        h, t, m = (hidden, target, mask) if idx is None else (hidden[idx], target[idx], mask[idx])
        logits = new(h).squeeze(-1)
        per = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
        return (per * m).sum() / m.sum().clamp_min(1)

    n = hidden.shape[0]
    with torch.no_grad():
        before = float(loss_on()) if n else math.nan
    opt = torch.optim.Adam(new.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps if n else 0):
        idx = torch.randint(0, n, (min(batch, n),), generator=gen)
        opt.zero_grad()
        loss = loss_on(idx)
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(loss_on()) if n else math.nan
    state = {GATE_WEIGHT: new.weight.detach().clone(), GATE_BIAS: new.bias.detach().clone()}
    return {"state": state,
            "loss_before": before, "loss_after": after, "tokens": n, "steps": steps,
            "label_mean": float((1 - target)[mask].mean()) if n else math.nan}


def train_gate_on_traces(model, trace_dir: str | os.PathLike, cfg: LoopConfig) -> dict[str, Any]:
    from rltlab.traces import load_traces, read_manifest

    manifest = read_manifest(trace_dir)
    if manifest["projection"] is not None or manifest["hidden_dim"] != model.config.hidden_size:
        raise ValueError("gate training needs full hidden states (no projection)")
    tr = load_traces(trace_dir, fields=["hidden", "logprob_ref", "round_mask"])
    return train_gate(model.model.early_exit_gate, tr["hidden"], -tr["logprob_ref"],
                      tr["round_mask"], steps=cfg.gate_steps, lr=cfg.gate_lr,
                      batch=cfg.gate_batch, slope=cfg.slope, margin=cfg.margin, seed=cfg.seed)


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
    done = finished_iterations(run_dir)
    state.results = [read_json(iteration_dir(run_dir, k) / "result.json") for k in done]
    state.resumed_from = len(done)
    if done:
        last = done[-1]
        gate = load_gate(iteration_dir(run_dir, last) / "gate.safetensors")
        push_weights(llm, model, gate, last + 1)
    return state


def evaluate(state: LoopState, label: str) -> dict[str, Any]:
    """Q-exit threshold sweep at the engine's current version."""
    cfg = state.cfg
    problems = W.eval_problems(state.model_dir, cfg.eval_problems)
    rows, scores = W.evaluate_policies(state.llm, state.tokenizer, problems,
                                       thresholds=cfg.thresholds, max_tokens=cfg.max_tokens,
                                       min_loops=cfg.min_loops, label=label)
    return {"version": state.llm.get_weight_version(), "rows": rows, "scores": scores}


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
    try:
        before = state.results[-1]["after"] if state.results else evaluate(state, f"v{k}")
        prompts, _ = W.rollout_prompts(state.tokenizer, cfg.rollout_prompts,
                                       seed=cfg.seed * 1000 + k)
        outs, manifest = W.collect_rollout_traces(
            llm, prompts, tmp / "traces", threshold=cfg.rollout_threshold,
            max_tokens=cfg.max_tokens, teacher=True, temperature=cfg.temperature,
            seed=cfg.seed + k, min_loops=cfg.min_loops, hidden_dtype=cfg.hidden_dtype,
            info={"iteration": k})
        rollout_versions = sorted({v for o in outs for v in o.outputs[0].weight_versions})
        trained = train_gate_on_traces(state.model, tmp / "traces", cfg)
        if k == cfg.crash_at_iteration:
            raise SimulatedCrash(f"simulated crash in iteration {k} (CRASH_AT_ITERATION)")
        save_gate(tmp / "gate.safetensors", trained["state"], k + 1)
        new_version = push_weights(llm, state.model, trained["state"], k + 1)
        after = evaluate(state, f"v{new_version}")
        summary = W.trace_summary(tmp / "traces")
        result = {
            "iteration": k, "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(time.perf_counter() - t0, 3),
            "rollout_weight_versions": rollout_versions,
            "trace_weight_versions": sorted({v for s in manifest["shards"]
                                             for v in s["weight_versions"]}),
            "trace_tokens": manifest["num_tokens"], "new_weight_version": new_version,
            "gate_training": {k2: v for k2, v in trained.items() if k2 != "state"},
            "trace_mean_selected": summary["mean_selected"],
            "config": asdict(cfg), "before": before, "after": after}
        write_json_atomic(tmp / "result.json", result)
        os.rename(tmp, iteration_dir(run_dir, k))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    state.results.append(result)
    return result


def curves(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quality-vs-depth rows of version 0 ("before" of iteration 0) and every "after"."""
    rows = []
    if results:
        rows += results[0]["before"]["rows"]
    for res in results:
        rows += res["after"]["rows"]
    return [{k: v for k, v in r.items() if k != "executed_hist"} for r in rows]


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


def loop_metrics(state: LoopState) -> dict[str, Any]:
    res = state.results
    per_iter = [{"iteration": r["iteration"],
                 "rollout_weight_versions": r["rollout_weight_versions"],
                 "trace_weight_versions": r["trace_weight_versions"],
                 "new_weight_version": r["new_weight_version"], "trace_tokens": r["trace_tokens"],
                 "gate_loss_before": r["gate_training"]["loss_before"],
                 "gate_loss_after": r["gate_training"]["loss_after"],
                 "started": r["started"], "seconds": r["seconds"]} for r in res]
    headline = {"iterations": len(res), "final_weight_version": state.llm.get_weight_version()}
    if res:
        def best(rows):  # quality at the lowest threshold's mean depth
            first = min(rows, key=lambda x: x["threshold"])
            return first["quality"], first["mean_rounds"]
        q0, d0 = best(res[0]["before"]["rows"])
        q1, d1 = best(res[-1]["after"]["rows"])
        headline.update({"quality_v0_lowest_t": q0, "mean_rounds_v0_lowest_t": d0,
                         "quality_final_lowest_t": q1, "mean_rounds_final_lowest_t": d1})
    return {"headline": headline, "iterations": per_iter, "curves": curves(res),
            "resumed_from": state.resumed_from, "config": asdict(state.cfg)}
