"""Distillation of a draft component towards the target (round-R) distributions, on the fly.

Loss = KL(p_R || q) per token, p_R = softmax(lm_head(h_R)) of the frozen model on the same
teacher-forced rows, q = the component's draft distribution (from h_d, or from the adapted
layers' rounds 1..d for the layer LoRA). Logged per step and on a held-out batch:
  agree        top-1(q) == top-1(p_R) (greedy acceptance proxy of one draft token),
  acc@j        fraction of positions whose next j drafts all agree (per-draft-position
               acceptance proxy, teacher-forced),
  accept_t1    E[sum_x min(p_R, q)] (= acceptance probability of one token at T=1).

Data parallel with the same code (state= an accelerate PartialState; see docs/scale_out.md):

    python -m rltlab.draft_heads.run --out DIR [--kind lora_lm_head --steps 150 ...]
    accelerate launch --multi_gpu --num_processes 2 -m rltlab.workbench.scale train-draft
        --out DIR ...
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F

from rltlab.draft_heads.heads import component_input
from rltlab.model.architecture import OuroForCausalLM


def training_rows(tokenizer, num_rows: int, seq_len: int = 128, seed: int = 0,
                  text_bytes: int = 400_000) -> torch.Tensor:
    """[num_rows, seq_len] training-style rows (rltlab.pretrain.data: stdlib text + arithmetic)."""
    from rltlab.pretrain.data import build_training_tensors
    rows = build_training_tensors(tokenizer, text_bytes, None, seed, seq_len)
    if len(rows) < num_rows:
        raise ValueError(f"only {len(rows)} rows of {seq_len} tokens from {text_bytes} bytes")
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return rows[perm[:num_rows]]


@contextlib.contextmanager
def _frozen(model: torch.nn.Module):
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def draft_and_target_logits(model: OuroForCausalLM, component, ids: torch.Tensor):
    """(draft logits with grad, target log-probs without) [B, T, V] for teacher-forced ids
    (moved to the model's device)."""
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model(ids, logits=True)
        target = torch.log_softmax(out.final_logits.float(), -1)
    if component is None or not hasattr(component, "draft_logits"):
        d = 1 if component is None else component.draft_rounds
        h_d = out.hidden_states[d - 1]
        draft = model.lm_head(h_d) if component is None else \
            component(component_input(component, h_d))
    else:
        draft = component.draft_logits(ids)
    return draft.float(), target


def agreement_metrics(draft: torch.Tensor, target_logp: torch.Tensor, max_j: int = 4) -> dict:
    agree = draft.argmax(-1) == target_logp.argmax(-1)
    q = torch.softmax(draft.float(), -1)
    out = {"agree": agree.float().mean().item(),
           "accept_t1": torch.minimum(q, target_logp.exp()).sum(-1).mean().item()}
    for j in range(1, max_j + 1):
        if agree.shape[1] >= j:
            out[f"acc@{j}"] = agree.unfold(1, j, 1).all(-1).float().mean().item()
    return out


@torch.no_grad()
def evaluate(model: OuroForCausalLM, component, rows: torch.Tensor, batch_size: int = 16,
             draft_rounds: int | None = None) -> dict:
    """Agreement metrics of `component` (None: the shallow drafter at draft_rounds) on rows."""
    totals: dict[str, float] = {}
    n = 0
    device = next(model.parameters()).device
    for lo in range(0, len(rows), batch_size):
        ids = rows[lo: lo + batch_size].to(device)
        if component is None:
            out = model(ids)
            draft = model.lm_head(out.hidden_states[(draft_rounds or 1) - 1])
            target = torch.log_softmax(out.final_logits.float(), -1)
        else:
            draft, target = draft_and_target_logits(model, component, ids)
        for key, val in agreement_metrics(draft, target).items():
            totals[key] = totals.get(key, 0.0) + val * len(ids)
        n += len(ids)
    return {k: v / n for k, v in totals.items()}


@torch.no_grad()
def teacher_features(model: OuroForCausalLM, rows: torch.Tensor, draft_rounds: int,
                     batch_size: int = 16, need: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_d [N, T, H], target log-probs [N, T, V] in bf16) of the frozen model, computed once:
    a reuse-exact head only ever sees these, so its training steps skip the 16-layer forward.
    need (bool [N], a data-parallel rank's rows): only the batches of `batch_size` consecutive
    rows that hold a needed row are computed (the others stay zero); the batches are cut the
    same way as without it, so the computed rows have the same bits as in one process.
    The features are on the model's device (rows are moved there batch by batch)."""
    hs = logps = None
    device = next(model.parameters()).device
    for lo in range(0, len(rows), batch_size):
        if need is not None and not bool(need[lo: lo + batch_size].any()):
            continue
        out = model(rows[lo: lo + batch_size].to(device))
        h = out.hidden_states[draft_rounds - 1]
        logp = torch.log_softmax(out.final_logits.float(), -1).bfloat16()
        if hs is None:
            hs = h.new_zeros((len(rows), *h.shape[1:]))
            logps = logp.new_zeros((len(rows), *logp.shape[1:]))
        hs[lo: lo + len(h)], logps[lo: lo + len(h)] = h, logp
    if hs is None:            # nothing needed (or no rows)
        return torch.zeros(0), torch.zeros(0, dtype=torch.bfloat16)
    return hs, logps


def _schedule(params, lr: float, steps: int):
    """AdamW with a linear warm-up over steps // 10 and a linear decay (to 1e-3 of lr)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * (1 - s / max(1, steps)) + 1e-3)
    return opt, sched


def _local(pick: torch.Tensor, state) -> tuple[torch.Tensor, float]:
    """(this rank's contiguous slice of a global batch of row picks, its share of the batch).
    One process (state None or a world of one): the whole batch, share 1.0."""
    if state is None or state.num_processes == 1:
        return pick, 1.0
    local = torch.tensor_split(pick, state.num_processes)[state.process_index]
    return local, len(local) / max(1, len(pick))


def _kl_step(draft_logits, target_logp, params, opt, sched, share: float = 1.0,
             state=None) -> torch.Tensor:
    """One optimizer step on KL(target || draft) (log-prob targets); returns the loss.

    Data parallel (state: accelerate PartialState of several ranks): draft / target are this
    rank's slice of a global batch (None: an empty slice) and share = slice / global batch;
    the slice's mean KL is weighted by share and the gradients are summed over the ranks
    (rltlab.common.distributed.sum_gradients), so every rank clips and steps with the gradient of
    the global batch's mean and the returned loss, summed over the ranks, is the global batch's.
    One process: share 1.0, no communication (the plain single-process step)."""
    from rltlab.common.distributed import sum_gradients

    opt.zero_grad(set_to_none=True)
    if draft_logits is not None and len(draft_logits):
        loss = F.kl_div(torch.log_softmax(draft_logits, -1), target_logp, log_target=True,
                        reduction="none").sum(-1).mean() * share
        loss.backward()
    else:
        loss = torch.zeros(())
    sum_gradients(params, state)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    return loss.detach()


def _global_loss(loss: torch.Tensor, state) -> float:
    """The global batch's loss from this rank's share-weighted one (`_kl_step`)."""
    from rltlab.common.distributed import reduce_weighted
    return reduce_weighted({"kl": loss.item()}, 1.0, state)["kl"]


def _metric_keys(positions: int, max_j: int = 4) -> list[str]:
    """The keys agreement_metrics returns for rows of `positions` tokens."""
    return ["agree", "accept_t1", *[f"acc@{j}" for j in range(1, min(max_j, positions) + 1)]]


def distill(model: OuroForCausalLM, component, rows: torch.Tensor, steps: int = 200,
            batch_size: int = 16, lr: float = 1e-3, seed: int = 0, log_every: int = 20,
            heldout: torch.Tensor | None = None, log_fn=None, precompute: bool = True,
            state=None) -> list[dict]:
    """Train the component's adapter parameters (the base model stays frozen). -> log rows.
    precompute (reuse-exact heads only): teacher features of `rows` once, then steps on them.

    state (accelerate PartialState, rltlab.common.distributed.get_state(); None = one process): data
    parallel over its ranks. Every step draws the same global batch of `batch_size` row picks
    (seeded, as one process draws them); each rank takes its contiguous slice, the gradients
    are summed with each slice weighted by its share (`_kl_step`), so the ranks take the global
    batch's steps and their adapter parameters stay identical (rank 0's are broadcast first).
    A rank computes teacher features only for the feature batches holding rows it picks. The
    logged train KL and agreement are over the global batch; held-out metrics are computed on
    every rank (the same). Collective: every rank calls it with the same arguments."""
    from rltlab.common.distributed import broadcast_parameters, reduce_weighted

    params = component.adapter_parameters()
    broadcast_parameters(params, state)
    opt, sched = _schedule(params, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    picks = [_local(torch.randint(0, len(rows), (batch_size,), generator=gen), state)
             for _ in range(steps)]
    log, started = [], time.perf_counter()
    model.eval()
    cached = None
    if precompute and component.reuse_exact:
        need = torch.zeros(len(rows), dtype=torch.bool)
        for pick, _ in picks:
            need[pick] = True
        cached = teacher_features(model, rows, component.draft_rounds, need=need)
    heldout_feats = None
    with _frozen(model):
        for p in params:
            p.requires_grad_(True)
        for step in range(1, steps + 1):
            pick, share = picks[step - 1]
            draft = target = None
            if len(pick) and cached is not None:
                draft = component(component_input(component, cached[0][pick])).float()
                target = cached[1][pick].float()
            elif len(pick):
                draft, target = draft_and_target_logits(model, component, rows[pick])
            loss = _kl_step(draft, target, params, opt, sched, share, state)
            if step % log_every == 0 or step == steps:
                batch = (agreement_metrics(draft.detach(), target) if draft is not None else
                         dict.fromkeys(_metric_keys(rows.shape[1]), 0.0))
                row = {"step": step, "kl": _global_loss(loss, state),
                       "seconds": time.perf_counter() - started,
                       **reduce_weighted(batch, share, state)}
                if heldout is not None and cached is not None:
                    if heldout_feats is None:
                        heldout_feats = teacher_features(model, heldout, component.draft_rounds)
                    with torch.no_grad():
                        m = agreement_metrics(
                            component(component_input(component, heldout_feats[0])).float(),
                            heldout_feats[1].float())
                    row.update({f"heldout_{k}": v for k, v in m.items()})
                elif heldout is not None:
                    row.update({f"heldout_{k}": v for k, v in
                                evaluate(model, component, heldout).items()})
                log.append(row)
                if log_fn is not None:
                    log_fn(row)
    return log


def token_agreement(draft: torch.Tensor, target_logp: torch.Tensor) -> dict:
    """Per-token agreement of draft logits [N, V] with target log-probs [N, V] (flat tokens,
    e.g. from rollout traces): top-1 agreement and accept@T1 = E sum_x min(p, q)."""
    if len(draft) == 0:
        return {"agree": float("nan"), "accept_t1": float("nan"), "tokens": 0}
    q = torch.softmax(draft.float(), -1)
    return {"agree": (draft.argmax(-1) == target_logp.argmax(-1)).float().mean().item(),
            "accept_t1": torch.minimum(q, target_logp.float().exp()).sum(-1).mean().item(),
            "tokens": int(len(draft))}


def distill_features(component, hidden: torch.Tensor, target_logp: torch.Tensor, *,
                     steps: int = 150, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
                     val: tuple[torch.Tensor, torch.Tensor] | None = None,
                     log_every: int = 50, model: OuroForCausalLM | None = None,
                     keep_best: bool = True, state=None) -> list[dict]:
    """Distil a reuse-exact component (head(h_d) -> logits) on precomputed token features:
    hidden = h_d [N, H] and target_logp = log p_R [N, V] (e.g. from teacher-mode rollout
    traces: h_d and lm_head(h_R) of every decode token). KL(p_R || q) per token, AdamW with the
    warm-up/decay schedule of `distill`; `model` (the base) is frozen meanwhile (no gradients
    into the shared lm_head). Returns log rows (train KL, held-out KL and agreement; a step-0
    row for the untrained component). keep_best (with `val`): the adapter parameters end at
    the logged step with the lowest held-out KL, step 0 included (the zero-initialised
    components ARE the shallow drafter there), so distillation never ends worse on held-out
    tokens than where it started; the chosen step is the last row's "best_step".
    state: data parallel over its ranks as in `distill` (each rank trains on its slice of every
    global batch of tokens, gradients summed; every rank evaluates the same `val`, so every
    rank keeps the same best step); None = one process. The features (and `val`) are moved to
    the component's device, so traces read on the host train on the GPU."""
    from rltlab.common.distributed import broadcast_parameters

    if not component.reuse_exact:
        raise ValueError(f"{component.kind} is not reuse-exact: it needs token ids, not h_d")
    params = component.adapter_parameters()
    broadcast_parameters(params, state)
    opt, sched = _schedule(params, lr, steps)
    gen = torch.Generator().manual_seed(seed)
    log, started = [], time.perf_counter()
    device = params[0].device     # train where the component is (the model's device)
    hidden, target_logp = hidden.to(device).float(), target_logp.to(device).float()
    if val is not None:
        val = (val[0].to(device), val[1].to(device))
    has_val = val is not None and len(val[0]) > 0
    best = {"kl": math.inf, "step": 0, "params": None}

    def check(step: int, row: dict) -> None:
        if has_val:
            with torch.no_grad():
                vd = component(component_input(component, val[0].float())).float()
                row["heldout_kl"] = F.kl_div(torch.log_softmax(vd, -1), val[1].float(),
                                             log_target=True, reduction="none"
                                             ).sum(-1).mean().item()
            row.update({f"heldout_{k}": v for k, v in
                        token_agreement(vd, val[1]).items() if k != "tokens"})
            if keep_best and row["heldout_kl"] < best["kl"]:
                best.update(kl=row["heldout_kl"], step=step,
                            params=[p.detach().clone() for p in params])
        log.append(row)

    check(0, {"step": 0, "kl": math.nan, "seconds": 0.0})
    with _frozen(model) if model is not None else contextlib.nullcontext():
        for p in params:
            p.requires_grad_(True)
        for step in range(1, steps + 1 if len(hidden) else 1):
            pick, share = _local(torch.randint(0, len(hidden), (min(batch_size, len(hidden)),),
                                               generator=gen), state)
            draft = component(component_input(component, hidden[pick])).float() \
                if len(pick) else None
            loss = _kl_step(draft, target_logp[pick], params, opt, sched, share, state)
            if step % log_every == 0 or step == steps:
                check(step, {"step": step, "kl": _global_loss(loss, state),
                             "seconds": time.perf_counter() - started})
    restore_best(params, best, log)
    return log


def restore_best(params, best: dict, log: list[dict]) -> None:
    """Put the parameters of the best held-out step back (None: step 0, the start, was best)
    and log that step on the last row."""
    if best["params"] is not None:
        with torch.no_grad():
            for p, saved in zip(params, best["params"]):
                p.copy_(saved)
    log[-1]["best_step"] = best["step"]


@torch.no_grad()
def trace_distill_data(trace_dir, model: OuroForCausalLM, draft_rounds: int = 1, *,
                       val_fraction: float = 0.2, seed: int = 0, batch_size: int = 1024):
    """distill_features' data from a teacher-mode, unprojected trace directory (notebook 01's
    RUN_DIR/traces): per traced decode token h_d (the stored round-d state) and log p_R =
    log_softmax(lm_head(h_R)) computed in batches on the model's device, split by prompt id
    (a seeded val_fraction of the prompts held out). -> (h, log_p, (val_h, val_log_p)), fp32 on
    the model's device."""
    from rltlab.traces import load_traces, read_manifest

    manifest = read_manifest(trace_dir)
    R = manifest["num_rounds"]
    if not manifest.get("info", {}).get("teacher") or manifest.get("projection"):
        raise ValueError(f"{trace_dir}: draft distillation needs teacher-mode traces of the "
                         "full h_r (collect with TEACHER True and no PROJECTION_DIM)")
    if manifest["hidden_dim"] != model.config.hidden_size or R != model.config.num_rounds:
        raise ValueError(f"{trace_dir}: traces of hidden {manifest['hidden_dim']} x {R} rounds, "
                         f"the model has {model.config.hidden_size} x {model.config.num_rounds}")
    if not 1 <= draft_rounds < R:
        raise ValueError(f"draft_rounds must lie in [1, {R - 1}]")
    tr = load_traces(trace_dir, fields=["hidden", "prompt_id"])
    if len(tr["prompt_id"]) == 0:
        raise ValueError(f"{trace_dir} holds no traced tokens")
    device = next(model.parameters()).device
    weight = model.lm_head.weight
    hidden = tr["hidden"][:, draft_rounds - 1].to(device).float()
    target = torch.cat([torch.log_softmax(
        (tr["hidden"][lo:lo + batch_size, R - 1].to(device).to(weight.dtype) @ weight.T).float(),
        -1) for lo in range(0, len(hidden), batch_size)])
    prompts = torch.unique(tr["prompt_id"])
    order = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))]
    held = order[:max(1, round(val_fraction * len(prompts)))] if len(prompts) > 1 else order[:0]
    val = torch.isin(tr["prompt_id"], held).to(device)
    return hidden[~val], target[~val], (hidden[val], target[val])
