"""Train lookahead heads and pick their tree (rltlab.draft_heads.lookahead, issue 16).

  1. rollouts: the target's own greedy full-depth continuations (eos stops) of TRAINING-split
     prompts (rltlab.draft_heads.rollout_data.training_prompts), keeping h_R of the position
     that produced each token;
  2. heads k = 1..depth learn x_{t+1+k} from (h_R(t), x_{t+1}) by cross-entropy; every 10th
     prompt is held out for calibration: the best step of each head by top-1 accuracy there,
     then the `budget` most frequent rank prefixes there as the tree;
  3. the heads, their tree and this record are saved (atomically) for
     rltlab.model.tree_spec and `python -m rltlab.bench.tree_spec --heads OUT`.

    python -m rltlab.draft_heads.lookahead_train --device cuda --out /tmp/lookahead_h4

--time-limit SECONDS ends the steps by the clock, the learning rate decayed by time as it is by
steps, so that a run inside a device call's limit still saves its heads.

The shipped artifacts/ouro-tiny/draft_heads/lookahead_h4 came from this command on one GPU:
--n-arith 128000 --n-text 128000 --steps 40000 --rollout-batch 2048 (179 s of training). On
32,000 prompts (8,000 of them arithmetic) the heads overfit: heads 1-3 peaked at a quarter to a
half of their steps. With 4x and then 8x the prompts, every head still gained at its last step,
and drafts were accepted more on the held-out prompts; twice as many again did not help
(docs/results.md, "Negative results").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rltlab.common.device import add_device_argument
from rltlab.draft_heads.lookahead import LookaheadHeads, save, tree_from_ranks


@torch.no_grad()
def capture_rollouts(model, prompts: list[list[int]], max_new: int, batch_size: int,
                     eos: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy full-depth decoding -> per prompt (tokens [L], h_R [L, H]) on the CPU, h_R[i]
    being the state that produced tokens[i]; a rollout ends at its first eos."""
    from rltlab.model.architecture import LoopedKVCache
    from rltlab.model.generate import left_pad
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    for lo in tqdm(range(0, len(order), batch_size), desc="rollouts", unit="batch"):
        idx = order[lo:lo + batch_size]
        ids, key_mask, positions = left_pad([prompts[i] for i in idx], 0, device)
        cache = LoopedKVCache(model.config, len(idx), ids.shape[1] + max_new,
                              next(model.parameters()).dtype, device)
        step = model(ids, positions=positions, key_mask=key_mask, cache=cache)
        nxt = positions[:, -1] + 1
        states, tokens = [], []
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        for i in range(max_new):
            states.append(step.final_hidden[:, -1])
            tokens.append(step.final_logits[:, -1].argmax(-1))
            if eos is not None:
                done |= tokens[-1] == eos
            if bool(done.all()) or i == max_new - 1:
                break
            step = model(tokens[-1][:, None], positions=(nxt + i)[:, None], cache=cache)
        toks, hs = torch.stack(tokens, 1).cpu(), torch.stack(states, 1).float().cpu()
        for r, i in enumerate(idx):
            t = toks[r].tolist()
            n = next((j + 1 for j, x in enumerate(t) if x == eos), len(t))
            out[i] = (toks[r, :n].clone(), hs[r, :n].clone())
    return out


def cached_rollouts(cache: str | None, settings: dict, capture, refuse_other: bool = False):
    """capture()'s rollouts, or those a run with the same settings saved at `cache` (a file;
    None: no cache). New ones are written there atomically, replacing any of other settings:
    a run stopped after its rollouts (a device call's time limit) resumes from them.
    refuse_other: a cache of other settings (or not a cache at all) raises ValueError instead,
    and stays as it is."""
    path = Path(cache) if cache else None
    if path is not None and path.is_file():
        try:
            saved = torch.load(path)
        except Exception as err:
            if refuse_other:
                raise ValueError(f"cache {path}: not a saved rollouts file ({err})") from err
            raise
        if isinstance(saved, dict) and saved.get("settings") == settings:
            return saved["rollouts"]
        if refuse_other:
            raise ValueError(f"cache {path} was saved for other settings; remove it or pick "
                             f"another path")
    rollouts = capture()
    if path is not None:   # straight to a temporary sibling (GBs: no copy in memory), renamed
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            torch.save({"settings": settings, "rollouts": rollouts}, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return rollouts


def flatten(rollouts, depth: int):
    """-> h [N, H], x_{t+1} [N], targets [N, depth] (x_{t+1+k}; -100 past the end)."""
    hs, nxt, tgt = [], [], []
    for y, h in rollouts:
        t = torch.full((len(y), depth), -100, dtype=torch.long)
        for k in range(1, depth + 1):
            t[:max(len(y) - k, 0), k - 1] = y[k:]
        hs.append(h)
        nxt.append(y)
        tgt.append(t)
    return torch.cat(hs), torch.cat(nxt), torch.cat(tgt)


@torch.no_grad()
def true_ranks(heads, rollouts, device, cap: int = 64, chunk: int = 8192) -> list[torch.Tensor]:
    """Per rollout [L, depth]: the rank of x_{t+1+k} under head k (capped), -1 past the end.
    Every position at once, `chunk` positions a pass (one pass per rollout took minutes for
    12,800 calibration rollouts: launch-bound)."""
    h, nxt, tgt = flatten(rollouts, heads.depth)
    dtype = next(heads.parameters()).dtype
    ranks = []
    for lo in range(0, len(h), chunk):
        t = tgt[lo:lo + chunk].to(device)
        logits = heads(h[lo:lo + chunk].to(device, dtype), nxt[lo:lo + chunk].to(device)).float()
        true = logits.gather(-1, t.clamp(min=0)[..., None])
        rank = (logits > true).sum(-1).clamp(max=cap)
        ranks.append(torch.where(t >= 0, rank, -1).cpu())
    return list(torch.cat(ranks).split([len(y) for y, _ in rollouts]))


def train(model, rollouts, depth: int, inner: int, steps: int, batch: int, lr: float,
          seed: int = 0, time_limit: float | None = None, clock=time.monotonic):
    """-> (heads with each head's best calibration step, calibration rollouts, record).

    time_limit: seconds of steps at most (None: no limit). The learning rate then decays with
    whichever of steps and time is further along, so a run stopped by the clock ends its
    schedule as one of `steps` would, and a device call's time limit never kills it before
    the heads are saved. The record says how many steps ran and what stopped them."""
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds or None, got {time_limit!r}")
    device = next(model.parameters()).device
    fit = [s for i, s in enumerate(rollouts) if i % 10 != 0]
    cal = [s for i, s in enumerate(rollouts) if i % 10 == 0]
    if not fit or not cal:
        raise ValueError(f"need >= 2 rollouts (one for calibration), got {len(rollouts)}")
    H, NX, TG = (t.to(device) for t in flatten(fit, depth))
    vH, vNX, vTG = (t.to(device) for t in flatten(cal, depth))
    torch.manual_seed(seed)
    heads = LookaheadHeads(model, depth, inner).to(device)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator(device=device).manual_seed(seed)
    best = [(-1.0, None, 0)] * depth
    checks = max(1, steps // 8)

    def check(step):
        with torch.no_grad():   # in chunks: [positions, depth, vocab] logits add up
            top1 = torch.cat([heads(vH[i:i + 8192], vNX[i:i + 8192]).argmax(-1)
                              for i in range(0, len(vH), 8192)])
        for k in range(depth):
            ok = vTG[:, k] >= 0   # none on tiny runs: 0, not NaN (a NaN never became best)
            acc = float((top1[ok, k] == vTG[ok, k]).float().mean()) if ok.any() else 0.0
            if acc > best[k][0]:
                state = {n: p.detach().clone() for n, p in heads.heads[k].state_dict().items()}
                best[k] = (acc, state, step)

    started = clock()
    bar = tqdm(total=steps, desc="lookahead heads", unit="step")
    for step in range(1, steps + 1):
        progress = step / steps if time_limit is None else \
            max(step / steps, (clock() - started) / time_limit)
        if time_limit is not None:   # the bar's ETA counts steps; the clock may end it first
            bar.set_postfix_str(f"schedule {progress:.0%} (steps or time limit)", refresh=False)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 100) * max(0.02, 1 - progress)
        pick = torch.randint(0, len(H), (batch,), generator=gen, device=device)
        logits = heads(H[pick], NX[pick])
        loss = F.cross_entropy(logits.flatten(0, 1), TG[pick].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        bar.update()
        if step % checks == 0 or progress >= 1:
            check(step)
        if progress >= 1:
            break
    bar.close()
    for k, (_, state, _) in enumerate(best):
        heads.heads[k].load_state_dict(state)
    record = {"fit_rollouts": len(fit), "calibration_rollouts": len(cal),
              "fit_positions": len(H), "steps": steps, "steps_run": step,
              "stopped_by": "steps" if step == steps else "time limit",
              "time_limit": time_limit, "batch": batch, "lr": lr,
              "seconds": round(clock() - started, 1),
              "calibration_top1": [round(b[0], 4) for b in best],
              "best_step": [b[2] for b in best]}
    return heads.eval(), cal, record


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.draft_heads.lookahead_train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    ap.add_argument("--out", required=True)
    add_device_argument(ap)
    ap.add_argument("--n-arith", type=int, default=8000)
    ap.add_argument("--n-text", type=int, default=24000)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--inner", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="stop the steps after this many seconds, the learning rate decayed "
                         "by time as by steps (a device call's limit; the record says which "
                         "stopped them)")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--budget", type=int, default=16, help="tree nodes")
    ap.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                    help="the heads' weights on disk (bfloat16 halves the file; the engine "
                         "casts them to the model's dtype on load)")
    ap.add_argument("--rollouts-cache", default=None, metavar="FILE",
                    help="reuse the rollouts saved here by a run of the same model and prompt "
                         "settings, else save this run's there")
    ap.add_argument("--rollout-batch", type=int, default=512,
                    help="prompts decoded together for the rollouts (launch-bound on a GPU: "
                         "larger is faster)")
    args = ap.parse_args(argv)
    if min(args.n_arith + args.n_text, args.steps, args.batch, args.budget, args.depth,
           args.rollout_batch) < 1:
        ap.error("--n-arith + --n-text, --steps, --batch, --budget, --depth and --rollout-batch "
                 "must be >= 1")
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    from rltlab.draft_heads.rollout_data import training_prompts
    from rltlab.model.checkpoint import load_model, model_hash
    model, tok, md = load_model(args.model, dtype="float32", device=args.device)
    model.eval().requires_grad_(False)
    prompts = training_prompts(tok, args.n_arith, args.n_text, 24, 0)
    eos = model.config.eos_token_id
    settings = {"model": model_hash(model), "n_arith": args.n_arith, "n_text": args.n_text,
                "max_new": args.max_new, "rollout_batch": args.rollout_batch, "eos": eos}
    rollouts = cached_rollouts(args.rollouts_cache, settings, lambda: capture_rollouts(
        model, [p for p, _ in prompts], args.max_new, args.rollout_batch, eos))
    heads, cal, record = train(model, rollouts, args.depth, args.inner, args.steps,
                               args.batch, args.lr, time_limit=args.time_limit)
    tree = tree_from_ranks(true_ranks(heads, cal, args.device), args.budget)
    record.update(command="python -m rltlab.draft_heads.lookahead_train " +
                  " ".join(argv if argv is not None else sys.argv[1:]),
                  description="self-distilled on the target's own greedy rollouts of "
                              "TRAINING-split prompts; held-out eval prompts never used",
                  arith_prompts=args.n_arith, text_prompts=args.n_text,
                  stored_dtype=args.save_dtype)
    save(heads, args.out, tree, model_hash(model), record, getattr(torch, args.save_dtype))
    print(json.dumps(record, default=str))   # the last line: JSON, as every command's
    return record


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
