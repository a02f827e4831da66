"""Distillation of a draft component towards the target (round-R) distributions, on the fly.

Loss = KL(p_R || q) per token, p_R = softmax(lm_head(h_R)) of the frozen model on the same
teacher-forced rows, q = the component's draft distribution (from h_d, or from the adapted
layers' rounds 1..d for the layer LoRA). Logged per step and on a held-out batch:
  agree        top-1(q) == top-1(p_R) (greedy acceptance proxy of one draft token),
  acc@j        fraction of positions whose next j drafts all agree (per-draft-position
               acceptance proxy, teacher-forced),
  accept_t1    E[sum_x min(p_R, q)] (= acceptance probability of one token at T=1).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from rltlab.model import OuroForCausalLM


def training_rows(tokenizer, num_rows: int, seq_len: int = 128, seed: int = 0,
                  text_bytes: int = 400_000) -> torch.Tensor:
    """[num_rows, seq_len] training-style rows (rltlab.data: stdlib text + arithmetic)."""
    from rltlab.data import build_training_tensors
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
    """(draft logits with grad, target log-probs without) [B, T, V] for teacher-forced ids."""
    with torch.no_grad():
        out = model(ids, logits=True)
        target = torch.log_softmax(out.final_logits.float(), -1)
    if component is None or not hasattr(component, "draft_logits"):
        d = 1 if component is None else component.draft_rounds
        h_d = out.hidden_states[d - 1]
        draft = model.lm_head(h_d) if component is None else component(h_d)
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
    for lo in range(0, len(rows), batch_size):
        ids = rows[lo: lo + batch_size]
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
                     batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_d [N, T, H], target log-probs [N, T, V] in bf16) of the frozen model, computed once:
    a reuse-exact head only ever sees these, so its training steps skip the 16-layer forward."""
    hs, logps = [], []
    for lo in range(0, len(rows), batch_size):
        out = model(rows[lo: lo + batch_size])
        hs.append(out.hidden_states[draft_rounds - 1])
        logps.append(torch.log_softmax(out.final_logits.float(), -1).bfloat16())
    return torch.cat(hs), torch.cat(logps)


def distill(model: OuroForCausalLM, component, rows: torch.Tensor, steps: int = 200,
            batch_size: int = 16, lr: float = 1e-3, seed: int = 0, log_every: int = 20,
            heldout: torch.Tensor | None = None, log_fn=None, precompute: bool = True
            ) -> list[dict]:
    """Train the component's adapter parameters (the base model stays frozen). -> log rows.
    precompute (reuse-exact heads only): teacher features of `rows` once, then steps on them."""
    params = component.adapter_parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * (1 - s / max(1, steps)) + 1e-3)
    gen = torch.Generator().manual_seed(seed)
    log, started = [], time.perf_counter()
    model.eval()
    cached = None
    if precompute and component.reuse_exact:
        cached = teacher_features(model, rows, component.draft_rounds)
    heldout_feats = None
    with _frozen(model):
        for p in params:
            p.requires_grad_(True)
        for step in range(1, steps + 1):
            pick = torch.randint(0, len(rows), (batch_size,), generator=gen)
            if cached is not None:
                draft, target = component(cached[0][pick]).float(), cached[1][pick].float()
            else:
                draft, target = draft_and_target_logits(model, component, rows[pick])
            loss = F.kl_div(torch.log_softmax(draft, -1), target, log_target=True,
                            reduction="none").sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % log_every == 0 or step == steps:
                row = {"step": step, "kl": loss.item(), "seconds": time.perf_counter() - started,
                       **agreement_metrics(draft.detach(), target)}
                if heldout is not None and cached is not None:
                    if heldout_feats is None:
                        heldout_feats = teacher_features(model, heldout, component.draft_rounds)
                    with torch.no_grad():
                        m = agreement_metrics(component(heldout_feats[0]).float(),
                                              heldout_feats[1].float())
                    row.update({f"heldout_{k}": v for k, v in m.items()})
                elif heldout is not None:
                    row.update({f"heldout_{k}": v for k, v in
                                evaluate(model, component, heldout).items()})
                log.append(row)
                if log_fn is not None:
                    log_fn(row)
    return log
