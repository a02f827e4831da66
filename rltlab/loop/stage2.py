"""Stage II gate-only training on teacher-mode traces, gate checkpoints and the weight push."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import safetensors.torch
import torch
import torch.nn.functional as F

from rltlab.loop.config import (GATE_BIAS, GATE_LABELS, GATE_WEIGHT, INJECTED_CANDIDATES,
                                LoopConfig)


def stage2_targets(ce: torch.Tensor, slope: float = 50.0, margin: float = 0.005,
                   label: str = "stage2") -> torch.Tensor:
    """Soft "continue" labels w [.., R] from per-round CE [.., R] of the round-R token.

    label "stage2" (the Ouro paper's Stage II, as pretrain.stage2_loss): I_r = max(0, CE_{r-1}
    - CE_r), the gain round r MADE; round 1 takes w_2. label "remaining": I_r = max(0, CE_r -
    min_{s > r} CE_s), the gain the rounds after r can still make (0 at round R). label
    "stage2_or_remaining": the larger of the two w_r (continue while the round just run gained
    or a later round will). w_r = sigmoid(slope (I_r - margin)) for each.

    The gate's hazard after round r decides whether rounds r+1..R run. "stage2" labels that
    decision with what round r did: on the embedded model it sends a k-hop answer digit whose
    rounds 1-2 are equally wrong (no gain at round 2) out at round 2, and the candidate loses
    the digit (-10.6 pp on the validation traces). "remaining" keeps the digit but labels a
    word problem's chain-of-thought tokens "exit" wherever their own round-R token is already
    reached, which the teacher-forced traces cannot see breaks the later tokens in generation
    (held-out word problems 7-28/50 at thresholds 0.1-0.5). "stage2_or_remaining" keeps both
    (docs/workbench.md, the gate update)."""
    if label == "stage2":
        gain = (ce[..., :-1] - ce[..., 1:]).clamp_min(0)          # I_r for r = 2..R
        w = torch.sigmoid(slope * (gain - margin))
        return torch.cat([w[..., :1], w], dim=-1)                  # round 1 takes w_2
    if label in ("remaining", "stage2_or_remaining"):
        later = ce.flip(-1).cummin(-1).values.flip(-1)            # min_{s >= r} CE_s
        best_after = torch.cat([later[..., 1:], ce[..., -1:]], dim=-1)
        w = torch.sigmoid(slope * ((ce - best_after).clamp_min(0) - margin))
        return w if label == "remaining" else torch.maximum(
            w, stage2_targets(ce, slope, margin, "stage2"))
    raise ValueError(f"gate label must be one of {GATE_LABELS}, got {label!r}")



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
               eval_every: int = 20, patience: int = 5, label: str = "stage2",
               device: torch.device | str | None = None) -> dict[str, Any]:
    """Stage II on traces: train a COPY of `gate` on hidden [N, R, H] (fp32) with labels from
    ce [N, R] (stage2_targets(label)); mask [N, R] marks usable rounds (all rounds in teacher
    mode). The copy trains in fp32 on `device` (default: the gate's); the minibatches are drawn
    by a CPU generator from `seed`, so the steps are the same on every device.

    val = (hidden, ce, mask) of held-out tokens: the validation BCE is computed before
    training (the current gate) and every `eval_every` steps; the state of the best check is
    returned (early stopping after `patience` checks without improvement). Without `val` the
    last state is returned. Returns the state ({weight, bias}, fp32 on the CPU), the train BCE
    before/after (nats, all train tokens), val_before / val_after / best_step / val_curve."""
    device = torch.device(device) if device is not None else gate.weight.device
    new = torch.nn.Linear(gate.in_features, 1, bias=True, device=device)
    new.load_state_dict({k: v.detach().float() for k, v in gate.state_dict().items()})
    hidden, ce = hidden.to(device, torch.float32), ce.to(device, torch.float32)
    mask = torch.ones_like(ce, dtype=torch.bool) if mask is None else mask.to(device).bool()
    target = 1.0 - stage2_targets(ce, slope, margin, label)   # BCE(1 - lambda, w) == BCE(g, 1 - w)
    if val is not None and len(val[0]) == 0:
        val = None
    if val is not None:
        vh, vce = val[0].to(device, torch.float32), val[1].to(device, torch.float32)
        vm = torch.ones_like(vce, dtype=torch.bool) if val[2] is None else \
            val[2].to(device).bool()
        vt = 1.0 - stage2_targets(vce, slope, margin, label)

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
        idx = torch.randint(0, n, (min(batch, n),), generator=gen).to(device)
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
            # no check improved (none ran, or every one was NaN): the returned state's own loss
            "val_before": val_before,
            "val_after": best_val if best is not None else
            (val_loss() if val is not None else None),
            "val_curve": curve,
            "label": label, "label_mean": float((1 - target)[mask].mean()) if n else math.nan}


def trace_gate_curve(gate_state: dict[str, torch.Tensor], hidden: torch.Tensor,
                     top1_id: torch.Tensor, ref_token: torch.Tensor, prompt_id: torch.Tensor,
                     thresholds: Sequence[float], min_loops: int = 1
                     ) -> list[tuple[float, list[float]]]:
    """Teacher-forced Q-exit curve of a gate on teacher-mode traces: per threshold, (mean exit
    round per token, per-prompt scores) with score_p = (agreeing tokens of prompt p) * P / N,
    so mean(score) = share of tokens whose exit round's top-1 equals the round-R token and the
    paired SE is clustered by prompt."""
    from rltlab.model.gates import q_exit_rounds

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


INJECTED_EXIT_ROUND1_BIAS = 30.0    # sigmoid(30) = 1 - 1e-13: lambda_1 > any threshold < 1


def injected_candidate(kind: str, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The test hook's candidate (rltlab.loop.config.INJECTED_CANDIDATES) from the current gate."""
    if kind not in INJECTED_CANDIDATES:
        raise ValueError(f"inject_candidate must be one of {INJECTED_CANDIDATES} or None, got "
                         f"{kind!r}")
    state = {k: v.clone() for k, v in current.items()}
    if kind == "exit_round1":    # logit 30 for every token at every round, whatever h_r
        state[GATE_WEIGHT] = torch.zeros_like(state[GATE_WEIGHT])
        state[GATE_BIAS] = torch.full_like(state[GATE_BIAS], INJECTED_EXIT_ROUND1_BIAS)
    return state


def train_gate_on_traces(model, trace_dir: str | os.PathLike, cfg: LoopConfig) -> dict[str, Any]:
    """Stage II on one iteration's traces with a prompt-level validation split; decides
    whether the candidate is accepted (see the module docstring). "state" is the gate to push:
    the candidate if accepted, else the current gate ("candidate_state" is the trained one, or
    the injected one under cfg.inject_candidate).

    Accepted iff, on the validation prompts, (1) its Stage II BCE is not higher than the
    current gate's and (2) its teacher-forced quality-vs-depth curve is no worse (no point
    lower by more than cfg.curve_z paired SE). A neutral candidate (the current gate) passes."""
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
    device = next(model.parameters()).device

    def train(label: str) -> dict[str, Any]:
        return train_gate(model.model.early_exit_gate, tr["hidden"][tr_m], ce[tr_m],
                          tr["round_mask"][tr_m], steps=cfg.gate_steps, lr=cfg.gate_lr,
                          batch=cfg.gate_batch, slope=cfg.slope, margin=cfg.margin,
                          seed=cfg.seed, val=(tr["hidden"][val_m], ce[val_m],
                                              tr["round_mask"][val_m])
                          if bool(val_m.any()) else None,
                          eval_every=cfg.gate_eval_every, patience=cfg.gate_patience,
                          label=cfg.gate_label if label is None else label, device=device)
    res = train(None)
    if cfg.inject_candidate is not None:
        res["state"] = injected_candidate(cfg.inject_candidate, current)
        res["injected"] = cfg.inject_candidate
        if bool(val_m.any()):
            res["val_after"] = _val_bce(res["state"], tr, ce, val_m, cfg)
    res["val_prompt_ids"] = sorted(int(i) for i in torch.unique(pid[val_m]))
    res["val_prompts"] = len(res["val_prompt_ids"])
    res["train_prompts"] = n_prompts - res["val_prompts"]
    reasons = []
    if res["val_tokens"]:
        args = (tr["hidden"][val_m], tr["top1_id"][val_m], tr["ref_token"][val_m], pid[val_m],
                cfg.thresholds, cfg.min_loops)
        cmp = compare_curves(trace_gate_curve(current, *args),
                             trace_gate_curve(res["state"], *args), z=cfg.curve_z)
        res["val_curve_check"] = {k: cmp[k] for k in ("no_worse", "worst_point", "points",
                                                      "n", "z")}
        res["val_curves"] = {"current": _curve_summary(trace_gate_curve(current, *args)),
                             "candidate": _curve_summary(trace_gate_curve(res["state"], *args))}
        if cfg.gate_label != "stage2":   # the paper's Stage II on the same split: the reference
            ref = train("stage2")
            ref_curve = trace_gate_curve(ref["state"], *args)
            ref_cmp = compare_curves(trace_gate_curve(current, *args), ref_curve, z=cfg.curve_z)
            res["val_curves"]["stage2"] = _curve_summary(ref_curve)
            res["stage2_reference"] = {
                "label": "stage2", "val_before": ref["val_before"], "val_after": ref["val_after"],
                "best_step": ref["best_step"], "no_worse": ref_cmp["no_worse"],
                "worst_point": ref_cmp["worst_point"]}
        if res["val_after"] > res["val_before"]:
            reasons.append(f"validation Stage II BCE higher ({cfg.gate_label} labels: "
                           f"{res['val_after']:.5f} vs "
                           f"{res['val_before']:.5f} for the current gate)")
        if cmp["no_worse"] is False:
            w = cmp["worst_point"]
            reasons.append(f"validation quality-vs-depth curve worse (at {w['mean_rounds']:.3f} "
                           f"rounds {w['diff_pp']:+.2f} pp, SE {w['se_pp']:.2f})")
    else:
        res["val_curve_check"] = None
        reasons.append("no validation split (fewer than 2 rollout prompts or fraction 0): "
                       "not validated")
    broken = _non_finite(res)
    reasons += broken
    res["validation_passed"] = bool(res["val_tokens"]) and not reasons
    res["accepted"] = not broken and (res["validation_passed"] or cfg.gate_keep_worse
                                      or not res["val_tokens"])
    res["reasons"] = reasons
    res["candidate_state"] = res["state"]
    if not res["accepted"]:
        res["state"] = current
    return res


def _curve_summary(points: list[tuple[float, list[float]]]) -> list[list[float]]:
    """[[mean exit round, % of tokens whose exit round's top-1 is the round-R token], ...]."""
    return [[x, 100.0 * sum(s) / max(1, len(s))] for x, s in points]


def _non_finite(res: dict[str, Any]) -> list[str]:
    """Why a candidate can never be pushed: NaN / inf weights, or a validation BCE that is not
    finite (NaN compares as "not higher" and passed for equal). Rejected whatever
    gate_keep_worse says."""
    reasons = [f"candidate gate {name} is not finite ({int((~v.isfinite()).sum())} of "
               f"{v.numel()} values)" for name, v in res["state"].items()
               if not bool(v.isfinite().all())]
    val_after = res.get("val_after")
    if res["val_tokens"] and val_after is not None and not math.isfinite(val_after):
        reasons.append(f"validation Stage II BCE of the candidate is not finite ({val_after})")
    return reasons


def _val_bce(state: dict[str, torch.Tensor], tr: dict[str, torch.Tensor], ce: torch.Tensor,
             val_m: torch.Tensor, cfg: LoopConfig) -> float:
    """Validation Stage II BCE of a gate state (as train_gate computes it)."""
    gate = torch.nn.Linear(state[GATE_WEIGHT].shape[1], 1)
    gate.load_state_dict({"weight": state[GATE_WEIGHT], "bias": state[GATE_BIAS]})
    target = 1.0 - stage2_targets(ce[val_m].float(), cfg.slope, cfg.margin, cfg.gate_label)
    with torch.no_grad():
        return float(_stage2_bce(gate, tr["hidden"][val_m].float(), target,
                                 tr["round_mask"][val_m].bool()))


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


