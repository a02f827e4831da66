"""Self-distillation of reuse-exact draft heads on the target's own continuations.

Drafts are verified on the target's greedy (T=0) or sampled (T=1) path, so the tokens a head
must predict are the target's round-R distributions along ITS continuations, not along
human-written rows. This module builds that data and trains on it:

  1. prompts: training-split arithmetic questions ([EOT] + question, rltlab.workbench
     .rollout_prompts), training-split stdlib text openings ([EOT] + N tokens,
     rltlab.exit_predictor.data.text_prompts) and, optionally, openings from a corpus of your
     own files (`corpus_prompts`, e.g. the text the drafter will serve: on text the model was
     pretrained on its rounds agree more than on unseen text, so a head trained only there
     learns little about where drafts fail); never the held-out eval set;
  2. continuations: full-depth `generate_plain`, batched, greedy and/or T=1 sampled;
  3. teacher features, one batched full-depth teacher-forced forward per batch of sequences:
     h_d for every requested d and h_R (the target distribution is log_softmax(lm_head(h_R)),
     recomputed per batch, so no [N, V] tensor is stored);
  4. `distill_sequences`: KL(p_R || q) with AdamW (warm-up / linear decay), held-out split of
     the prompts for early stopping (the adapter ends at the best held-out KL, step 0 included:
     a zero-initialised head IS the shallow drafter), per-kind and per-draft-position
     (acc@j) agreement logged, tqdm progress.

The CLI (`python -m rltlab.draft_heads.selfdistill`) reproduces the shipped components under
artifacts/ouro-tiny/draft_heads/ (seeded; see docs/experiments/loop_speculation.md).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from rltlab.common.device import add_device_argument
from rltlab.draft_heads.rollout_data import (KIND_NAMES, SequenceFeatures, corpus_prompts,
                                               rollouts, sequence_features, training_prompts)
from rltlab.draft_heads.train import _frozen, _schedule, restore_best


def seq_metrics(draft: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor,
                max_j: int = 4) -> dict:
    """Agreement of draft logits [S, T, V] with target log-probs over the masked positions:
    agree (top-1), accept_t1 (E sum min(p, q)), kl, acc@j (share of positions whose next j
    drafts all agree, windows inside real tokens only: the per-draft-position proxy)."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    agree = (draft.argmax(-1) == target_logp.argmax(-1)) & mask
    q = torch.softmax(draft, -1)
    kl = F.kl_div(torch.log_softmax(draft, -1), target_logp, log_target=True,
                  reduction="none").sum(-1)
    out = {"kl": float((kl * m).sum() / n), "agree": float(agree.float().sum() / n),
           "accept_t1": float((torch.minimum(q, target_logp.exp()).sum(-1) * m).sum() / n)}
    for j in range(1, max_j + 1):
        if mask.shape[1] >= j:
            win = mask.unfold(1, j, 1).all(-1)
            ok = agree.unfold(1, j, 1).all(-1) & win
            out[f"acc@{j}"] = float(ok.sum() / win.sum().clamp(min=1))
    return out


@torch.no_grad()
def evaluate_features(head, feats: SequenceFeatures, d: int, lm_head, batch_size: int = 64
                      ) -> dict:
    """seq_metrics of head(h_d) (None: lm_head, the shallow drafter) overall and per kind."""
    groups = {"all": torch.arange(len(feats.mask))}
    groups.update({name: (feats.kind == k).nonzero()[:, 0] for k, name in
                   enumerate(KIND_NAMES)})
    out = {}
    for name, idx in groups.items():
        if not len(idx):
            continue
        totals, weight = {}, 0.0
        dev = lm_head.weight.device
        for lo in range(0, len(idx), batch_size):
            b = idx[lo: lo + batch_size]
            h, mask = feats.hidden[d][b].to(dev), feats.mask[b].to(dev)
            draft = (lm_head if head is None else head)(h).float()
            target = torch.log_softmax(lm_head(feats.final[b].to(dev)).float(), -1)
            w = float(mask.sum())
            for key, val in seq_metrics(draft, target, mask).items():
                totals[key] = totals.get(key, 0.0) + val * w
            weight += w
        out[name] = {k: v / max(weight, 1.0) for k, v in totals.items()}
    return out


def distill_sequences(head, feats: SequenceFeatures, d: int, lm_head, *, steps: int = 1500,
                      batch_size: int = 32, lr: float = 1e-3, weight_decay: float = 0.0,
                      seed: int = 0, eval_every: int = 100, patience: int | None = None,
                      progress: bool = True, log_fn=None) -> list[dict]:
    """Train head (reads h_d) on feats' train split, KL(p_R || q) over real tokens; evaluate on
    the held-out split every eval_every steps; keep the adapter of the best held-out KL
    (step 0 = the untrained head, so the result is never worse on held-out than the shallow
    drafter); stop after `patience` evaluations without improvement. -> log rows (the last
    has best_step)."""
    from tqdm.auto import tqdm
    train = feats.select((feats.split == 0).nonzero()[:, 0])
    held = feats.select((feats.split == 1).nonzero()[:, 0])
    params = head.adapter_parameters()
    dev = lm_head.weight.device
    opt, sched = _schedule(params, lr, steps)
    for group in opt.param_groups:
        group["weight_decay"] = weight_decay
    gen = torch.Generator().manual_seed(seed)
    best = {"kl": math.inf, "step": 0, "params": None, "bad": 0}
    log, started = [], time.perf_counter()

    def check(step, row):
        m = evaluate_features(head, held, d, lm_head) if len(held.mask) else {}
        for group, vals in m.items():
            row.update({f"heldout_{group}_{k}": v for k, v in vals.items()})
        kl = row.get("heldout_all_kl", math.inf)
        if kl < best["kl"]:
            best.update(kl=kl, step=step, params=[p.detach().clone() for p in params], bad=0)
        else:
            best["bad"] += 1
        row["seconds"] = time.perf_counter() - started
        log.append(row)
        if log_fn is not None:
            log_fn(row)

    head.train()
    check(0, {"step": 0, "kl": math.nan})
    bar = tqdm(range(1, steps + 1), desc=f"distil d={d}", disable=not progress)
    with _frozen(lm_head):
        for p in params:
            p.requires_grad_(True)
        for step in bar:
            pick = torch.randint(0, len(train.mask), (batch_size,), generator=gen)
            mask = train.mask[pick]
            with torch.no_grad():   # features live on the CPU; the step runs on lm_head's device
                target = torch.log_softmax(lm_head(train.final[pick][mask].to(dev)).float(), -1)
            draft = head(train.hidden[d][pick][mask].to(dev)).float()
            loss = F.kl_div(torch.log_softmax(draft, -1), target, log_target=True,
                            reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % eval_every == 0 or step == steps:
                check(step, {"step": step, "kl": loss.item()})
                bar.set_postfix(kl=f"{loss.item():.4f}",
                                held_agree=f"{log[-1].get('heldout_all_agree', 0):.4f}",
                                best=best["step"])
                if patience is not None and best["bad"] >= patience:
                    break
    head.eval()
    restore_best(params, best, log)
    return log


def draft_heads_dir(model_dir=None):
    """The folder where a model's trained components live (the embedded model's by default):
    selfdistill writes there, shipped_components and the benches look there."""
    from pathlib import Path

    from rltlab.common.paths import embedded_model_dir
    return Path(model_dir or embedded_model_dir()) / "draft_heads"


def shipped_components(model_dir=None) -> list:
    """Directories of the components shipped with the embedded model (sorted)."""
    from rltlab.draft_heads.heads import META_FILE
    root = draft_heads_dir(model_dir)
    return sorted(p.parent for p in root.glob(f"*/{META_FILE}")) if root.is_dir() else []


def build_features(model, tokenizer, args, progress: bool = True) -> tuple:
    """(SequenceFeatures, data description) from parsed CLI args; --features-cache reuses a
    file written by an earlier run with the same data arguments."""
    from pathlib import Path
    data = {"arith_prompts": args.arith, "text_prompts": args.text,
            "text_prompt_tokens": args.text_prompt_tokens, "max_new_tokens": args.max_tokens,
            "temperatures": list(args.temperatures), "data_seed": args.data_seed,
            "heldout_every": args.heldout_every, "rollout_batch": args.rollout_batch}
    corpus = []
    if args.corpus:
        corpus, data["corpus"] = corpus_prompts(tokenizer, args.corpus, args.corpus_prompts,
                                                args.text_prompt_tokens, args.data_seed)
    cache = Path(args.features_cache) if args.features_cache else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache)
        if saved["data"] == data and set(args.draft_rounds) <= set(saved["feats"]["hidden"]):
            return SequenceFeatures(**saved["feats"]), data
    prompts = training_prompts(tokenizer, args.arith, args.text, args.text_prompt_tokens,
                               args.data_seed, corpus)
    seqs = rollouts(model, prompts, max_tokens=args.max_tokens, temperatures=args.temperatures,
                    seed=args.data_seed, batch_size=args.rollout_batch, progress=progress)
    feats = sequence_features(model, seqs, tuple(sorted({1, 2, *args.draft_rounds})),
                              heldout_every=args.heldout_every, progress=progress)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"data": data, "feats": feats.to_dict()}, cache)
    return feats, data


def _without_cache(argv: list) -> list:
    """argv without --features-cache (it only skips recomputing the same features)."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--features-cache"):
            skip = a == "--features-cache"
            continue
        out.append(a)
    return out


def main(argv=None) -> dict:
    import argparse
    import json
    import shlex
    import sys
    from pathlib import Path

    from rltlab.model.checkpoint import load_model
    from rltlab.draft_heads.heads import build_component, save_component
    ap = argparse.ArgumentParser(prog="python -m rltlab.draft_heads.selfdistill",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-root", default=None,
                    help="components land in OUT_ROOT/<kind>_d<d> (default: the model's own "
                         "draft_heads folder, where shipped_components and the benches look)")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    ap.add_argument("--draft-rounds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kind", default="residual_mlp", choices=["residual_mlp", "lora_lm_head"])
    ap.add_argument("--inner", type=int, default=512, help="residual_mlp inner width")
    ap.add_argument("--r", type=int, default=16, help="lora_lm_head rank")
    ap.add_argument("--arith", type=int, default=1024, help="training-split arithmetic prompts")
    ap.add_argument("--text", type=int, default=1536, help="training-split text prompts")
    ap.add_argument("--corpus", nargs="+", default=None, metavar="GLOB",
                    help="also: openings from these files (recursive globs), e.g. the text the "
                    "drafter will serve; quote the globs")
    ap.add_argument("--corpus-prompts", type=int, default=1536, help="openings from --corpus")
    ap.add_argument("--text-prompt-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per rollout")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--heldout-every", type=int, default=10,
                    help="prompts with index %% N == 0 are the early-stopping split")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--patience", type=int, default=None,
                    help="stop after N evaluations without a better held-out KL")
    ap.add_argument("--seed", type=int, default=0, help="init and batch-pick seed")
    ap.add_argument("--features-cache", default=None, help="reuse/write teacher features here")
    ap.add_argument("--threads", type=int, default=1)
    add_device_argument(ap, default="cpu", help="rollouts, features and training (fp32)")
    ap.add_argument("--rollout-batch", type=int, default=64, help="prompts per rollout batch")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer, model_dir = load_model(args.model, threads=args.threads,
                                               device=args.device)
    feats, data = build_features(model, tokenizer, args)
    split = {"train_sequences": int((feats.split == 0).sum()),
             "heldout_sequences": int((feats.split == 1).sum()),
             "train_tokens": int(feats.mask[feats.split == 0].sum()),
             "heldout_tokens": int(feats.mask[feats.split == 1].sum())}
    description = ("self-distillation on the target's own full-depth continuations "
                   "(generate_plain) of TRAINING-split prompts: arithmetic questions "
                   "(rltlab.workbench.rollout_prompts) and stdlib-text openings "
                   "(rltlab.exit_predictor.data.text_prompts, split='train'); teacher = "
                   "log_softmax(lm_head(h_R)) at every real token (prompt and continuation); "
                   "held-out eval prompts of artifacts/ouro-tiny/eval never used"
                   + ("; plus openings of the --corpus files (data.corpus)" if args.corpus
                      else ""))
    results = {}
    for d in args.draft_rounds:
        torch.manual_seed(args.seed)
        cfg = {"inner": args.inner} if args.kind == "residual_mlp" else {"r": args.r}
        head = build_component(args.kind, model, d, **cfg).to(args.device)
        log = distill_sequences(head, feats, d, model.lm_head, steps=args.steps,
                                batch_size=args.batch_size, lr=args.lr,
                                weight_decay=args.weight_decay, seed=args.seed,
                                eval_every=args.eval_every, patience=args.patience)
        held = feats.select((feats.split == 1).nonzero()[:, 0])
        metrics = {"heldout_shallow": evaluate_features(None, held, d, model.lm_head),
                   "heldout_trained": evaluate_features(head, held, d, model.lm_head),
                   "best_step": log[-1]["best_step"]}
        out = Path(args.out_root or draft_heads_dir(model_dir)) / f"{args.kind}_d{d}"
        training = {"description": description, "data": {**data, **split},
                    "kind": args.kind, "component": cfg, "steps": args.steps,
                    "batch_size": args.batch_size, "lr": args.lr,
                    "weight_decay": args.weight_decay, "seed": args.seed,
                    "command": "python -m rltlab.draft_heads.selfdistill "
                               + shlex.join(_without_cache(sys.argv[1:] if argv is None
                                                           else argv))}
        save_component(head, model, out, {"training": training, "metrics": metrics,
                                          "train_log": log})
        results[d] = {"dir": str(out), **metrics}
        print(f"d={d} -> {out}: held-out agree {metrics['heldout_shallow']['all']['agree']:.4f}"
              f" -> {metrics['heldout_trained']['all']['agree']:.4f} (best step "
              f"{metrics['best_step']})", flush=True)
    print(json.dumps(results, default=str))
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
